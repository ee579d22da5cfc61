"""Child processes that never outlive their parent (PR_SET_PDEATHSIG), without loading anything in
the forked child: `prctl` is resolved here, at import, since dlopen between fork and exec can deadlock
in a multi-threaded parent."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
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


# Torch's CPU ops run their parallel regions on OpenMP (libgomp in torch's wheels), which keeps a team of
# worker threads for every thread that has started a parallel region, for as long as that thread lives.
# Once a process holds more such threads than it has cores, every team waits at its barriers with a
# throttled spin (at most 1000 iterations; none under OMP_WAIT_POLICY=PASSIVE) and each region pays a futex
# wake-up of the other threads. A worker's engine thread starts ~20 parallel regions a layer, so a second
# team anywhere in the process (the main thread's, left by building the engine; a transfer thread's, from
# one large tensor copy) slowed its steps: a 256-token prefill of the bench model took 69-74 ms in a
# prefill worker with a spinning team against 48 ms with the engine thread's team alone (86 -> 75 ms with
# the shared placement's passive wait), and a colocated cluster's c1 TTFT went from 72 to 52-55 ms. So a
# worker builds its engine on a passing thread (`on_passing_thread`) and confines parallel regions to its
# engine thread (`confine_openmp`): every other thread runs torch ops on itself alone.


@functools.cache
def _omp_set_num_threads():
    """The OpenMP runtime torch loaded: its omp_set_num_threads (per calling thread), or None."""
    import torch  # noqa: F401  (loads the runtime)

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(("libgomp", "libiomp", "libomp")):
            try:
                return ctypes.CDLL(path).omp_set_num_threads
            except (OSError, AttributeError):
                continue
    return None


def run_torch_serially() -> None:
    """Torch ops on the calling thread run on it alone from now on (an OpenMP team of one: no worker
    threads, no barrier), whatever torch.get_num_threads() says for the others."""
    import torch

    torch.get_num_threads()  # torch's per-thread setup first: it applies the process-wide count
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        set_threads(1)


def confine_openmp(compute_threads: tuple[str, ...]) -> None:
    """Threads started from now on that are not named in `compute_threads` run torch ops serially
    (`run_torch_serially`, applied as each starts, through threading.setprofile's per-thread hook);
    the named ones keep torch's thread count. Call early, before the process starts its threads."""
    if _omp_set_num_threads() is None:
        return
    previous = threading.getprofile()

    def on_start(frame, event, arg):
        sys.setprofile(previous)  # once per thread: hand over to whatever profiler was set before
        if threading.current_thread().name not in compute_threads:
            run_torch_serially()
        return None

    threading.setprofile(on_start)


def on_passing_thread(fn, name: str = "build"):
    """`fn()` run on a thread that ends when it returns: its result, or what it raised. For what builds
    an engine whose steps run on another thread: the builder's OpenMP team ends with it."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as err:  # handed to the caller
            box["error"] = err

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
