"""kvferry.proc.dying_with_parent: children die with the thread that started them, run with their own
argv, and start reliably while gRPC is busy in the parent (no fork handlers: grpc/grpc#43055)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvferry.deploy.fault_harness import process_alive, wait_for
from kvferry.proc import dying_with_parent


def test_the_child_gets_the_signal_when_its_parent_ends(tmp_path):
    """A parent process starts a sleeping child, waits until the child's program runs (the shim has set
    the death signal and exec'd), and exits; the child is killed within seconds."""
    ready = tmp_path / "ready"
    sleeper = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(120)"
    parent = textwrap.dedent(
        f"""
        import pathlib, signal, subprocess, sys, time
        sys.path[:0] = {sys.path!r}
        from kvferry.proc import dying_with_parent
        argv = dying_with_parent([sys.executable, "-c", {sleeper!r}, {str(ready)!r}], signal.SIGKILL)
        print(subprocess.Popen(argv).pid, flush=True)
        deadline = time.monotonic() + 30
        while not pathlib.Path({str(ready)!r}).exists():
            assert time.monotonic() < deadline, "the child's program never ran"
            time.sleep(0.01)
        """
    )
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout)
    assert ready.exists()
    wait_for(lambda: not process_alive(pid), 20, f"child {pid} to die with its parent")


def test_the_child_runs_its_program_with_its_own_argv():
    # `; exit 0`: the shell forks `tr` rather than exec it, so /proc/$$ is still the shell's
    argv = ["sh", "-c", 'printf "%s|" "$0" "$1"; tr "\\0" "|" < /proc/$$/cmdline; exit 0', "zero", "one"]
    out = subprocess.run(dying_with_parent(argv), capture_output=True, text=True, timeout=30, check=True)
    # sh sees $0 and $1 as given, and its own argv[0] is "sh", not the shim's or a resolved path
    assert out.stdout == "zero|one|sh|-c|" + argv[2] + "|zero|one|"


def test_the_program_gets_default_sigpipe():
    """Popen's restore_signals, kept through the shim: Python ignores SIGPIPE, the program must not."""
    argv = ["sh", "-c", "grep -E '^Sig(Ign|Cgt):' /proc/self/status"]
    out = subprocess.run(dying_with_parent(argv), capture_output=True, text=True, timeout=30, check=True)
    ignored = int(out.stdout.split("SigIgn:")[1].split()[0], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1)), out.stdout
    assert not ignored & (1 << (signal.SIGXFSZ - 1)), out.stdout


def test_a_missing_program_raises_at_once(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-program"):
        dying_with_parent(["no-such-program-kvferry", "--help"])
    with pytest.raises(FileNotFoundError):
        dying_with_parent(["sh"], env={"PATH": "/nonexistent"})
    with pytest.raises(FileNotFoundError):  # a directory is no program
        dying_with_parent([str(tmp_path)])


def test_a_dead_parent_is_noticed_before_the_program_runs(tmp_path):
    """The shim compares its parent with the pid it was given: a mismatch (the parent died before the
    death signal was set, and the child was reparented) exits 1 without running the program."""
    marker = tmp_path / "ran"
    argv = dying_with_parent(["sh", "-c", f"touch {marker}"])
    assert argv[6] == str(os.getpid())
    argv[6] = "1"  # as if the parent were gone: the shim's parent is this process, not pid 1
    assert subprocess.run(argv, timeout=30).returncode == 1
    assert not marker.exists()


@pytest.mark.slow
def test_children_start_while_grpc_calls_run_in_the_parent():
    """With a preexec_fn (fork() and gRPC's atfork handlers) about 1 start in 300 aborted here before
    exec (exit -6, `epoll_wait error: Bad file descriptor`); through the shim none may."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()

    calls = [0, 0]

    def load(i: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                calls[i] += 1

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    try:
        codes = []
        for _ in range(300):
            proc = subprocess.Popen(
                dying_with_parent(["true"], signal.SIGKILL),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            try:
                _, err = proc.communicate(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            codes.append((proc.returncode, err[-300:]))
        assert [c for c in codes if c[0] != 0] == []
        assert all(t.is_alive() for t in threads) and min(calls) > 300, calls  # gRPC was busy throughout
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        server.stop(0).wait()
