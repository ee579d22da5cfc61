"""Child processes that never outlive their parent (PR_SET_PDEATHSIG), without loading anything in
the forked child: `prctl` is resolved here, at import, since dlopen between fork and exec can deadlock
in a multi-threaded parent."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable

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


def settle_heap(young_threshold: int = 50_000) -> None:
    """Call once a server has started (model loaded, servers bound): the objects alive now move out of
    the cyclic garbage collector's reach (`gc.freeze`), and it looks at new objects less often.

    A serving loop makes thousands of short-lived objects per second (protobuf messages, token lists,
    futures), which reference counting frees at once. With the default threshold (700) the collector
    still ran every few decode steps and walked every tracked object in the process, the model's and
    libraries' included: 3-5% of a decode worker's CPU in a profile under load."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_threshold, 20, 20)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS's pick; a later bind may still race another process)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def terminate(procs: Iterable[subprocess.Popen], limit_s: float) -> None:
    """SIGTERM every process at once (each drains or shuts down in parallel), then SIGKILL whichever
    still runs `limit_s` later; returns once all of them have exited and been reaped."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + limit_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.01, deadline - time.monotonic()))
        if proc.poll() is None:
            proc.kill()
            proc.wait()
