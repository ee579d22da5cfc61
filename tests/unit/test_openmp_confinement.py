"""A worker's torch parallel regions stay on its engine thread (kvferry.proc.confine_openmp): every other
thread runs torch ops serially, and the engine is built on a thread that ends (on_passing_thread)."""

import subprocess
import sys
import textwrap

import pytest

from kvferry.proc import on_passing_thread


def test_on_passing_thread_returns_and_raises():
    import threading

    assert on_passing_thread(lambda: threading.current_thread().name) == "build"
    with pytest.raises(ValueError, match="bad"):
        on_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))


def test_confine_openmp_leaves_threads_to_the_engine_thread():
    # a fresh interpreter: confinement is process-wide from the call on
    code = textwrap.dedent(
        """
        import concurrent.futures, threading, torch
        from kvferry.proc import confine_openmp
        torch.set_num_threads(2)
        confine_openmp(("engine", "build"))
        seen = {}
        def probe():
            torch.ones(1 << 20).add_(1)  # big enough for a parallel region where allowed
            seen[threading.current_thread().name] = torch.get_num_threads()
        for name in ("engine", "build", "kv-transfer"):
            t = threading.Thread(target=probe, name=name); t.start(); t.join()
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pool") as ex:
            ex.submit(probe).result()
        print(sorted(seen.items()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[('build', 2), ('engine', 2), ('kv-transfer', 1), ('pool_0', 1)]"
