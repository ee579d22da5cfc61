"""Child processes that never outlive their parent (PR_SET_PDEATHSIG), without loading anything in
the forked child: `prctl` is resolved here, at import, since dlopen between fork and exec can deadlock
in a multi-threaded parent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

# the order a cluster's processes stop in: workers drain while the router still relays their streams
STOP_ORDER = ("prefill", "decode", "router", "pool", "redis")

_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: no death signal
    _prctl = None


def die_with_parent(sig: int = signal.SIGTERM):
    """A preexec_fn: the child gets `sig` when the thread that started it ends (its parent dies).
    If the parent died before the call took effect, the child exits at once."""
    parent = os.getpid()

    def preexec() -> None:
        if _prctl is not None:
            with contextlib.suppress(OSError):
                _prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os._exit(1)

    return preexec
