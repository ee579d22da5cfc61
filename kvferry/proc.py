"""Child processes that never outlive their parent (PR_SET_PDEATHSIG), set by a tiny exec shim in the
child rather than by a preexec_fn.

A preexec_fn makes subprocess fork() where it would vfork(), and fork() runs gRPC's pthread_atfork
handlers: with gRPC live in the parent (every launcher here holds channels or servers), the handler
restarts gRPC's poller thread in the child, then subprocess closes the inherited descriptors before exec,
the poller's epoll descriptor among them, and the poller aborts the child (`epoll_wait error: Bad file
descriptor`, exit -6) before it ever runs its program: grpc/grpc#43055, 1 start in ~300 here with
grpcio 1.85. Without a preexec_fn, subprocess vforks, which runs no atfork handler, and the shim sets the
death signal after exec (it is kept across the exec into the program)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping

# the order a cluster's processes stop in: workers drain while the router still relays their streams
STOP_ORDER = ("prefill", "decode", "router", "pool", "redis")

# argv: signal number, the parent's pid, the program's path, then its argv (its own argv[0] first). The
# death signal follows the thread that spawned the child (the kernel's parent), as a preexec_fn's did; if
# the parent died before it took effect, the child exits at once with 1. SIGPIPE and SIGXFSZ go back to
# their defaults before the exec, which Popen's restore_signals did for the program and Python's start-up
# undid in the shim. Standard library only (-I -S).
_SHIM = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]))\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    os._exit(1)\n"
    "signal.signal(signal.SIGPIPE, signal.SIG_DFL)\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"
    "os.execv(sys.argv[3], sys.argv[4:])\n"
)


def dying_with_parent(
    argv: list[str], sig: int = signal.SIGTERM, env: Mapping[str, str] | None = None
) -> list[str]:
    """`argv` wrapped so that the child gets `sig` when the thread that starts it ends (its parent dies);
    pass the result to subprocess.Popen with no preexec_fn. `argv[0]` is looked up on the PATH of `env`
    (default: this process's) now, so a missing program raises FileNotFoundError here, as Popen would."""
    path = (os.environ if env is None else env).get("PATH", os.defpath)
    program = shutil.which(argv[0], path=path)  # a name with a slash: that file, if it is executable
    if program is None:
        raise FileNotFoundError(errno.ENOENT, f"no executable {argv[0]!r} (PATH {path})", argv[0])
    if sys.platform != "linux":  # no PR_SET_PDEATHSIG
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _SHIM, str(int(sig)), str(os.getpid()), program, *argv]


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
