"""Prefill and decode sharing a host's cores (engine.host_share): prefill's mark, decode's yield."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from test_engine_loop import CountingEngine  # steps with `running` requests, recording when

from kvferry.deploy.fault_harness import wait_for
from kvferry.engine.host_share import MARK, STALE_S, HostPrefill, PrefillMark
from kvferry.engine.loop import EngineLoop


def test_a_decode_rank_sees_a_prefill_mark_while_it_is_set(tmp_path):
    host = HostPrefill(tmp_path)
    assert not host.busy()
    mark = PrefillMark(tmp_path)
    host._scanned = float("-inf")  # rescan now (a decode rank rescans every RESCAN_S)
    assert not host.busy()
    mark.set(True)
    assert host.busy()
    mark.set(False)
    assert not host.busy()
    mark.set(True)
    mark.close()  # a prefill that stops clears its mark and removes it
    assert not host.busy()
    assert list(tmp_path.iterdir()) == []
    host.close()


def test_a_stale_mark_holds_nobody_back(tmp_path):
    """A prefill that hangs inside a step (or died without clearing) stops counting after STALE_S."""
    mark = PrefillMark(tmp_path)
    host = HostPrefill(tmp_path)
    MARK.pack_into(mark._map, 0, time.monotonic_ns() - int((STALE_S + 1) * 1e9))
    assert not host.busy()
    mark.set(True)
    assert host.busy()
    mark.close()


def test_the_mark_of_a_killed_prefill_is_removed(tmp_path):
    code = (
        "import sys, time; from kvferry.engine.host_share import PrefillMark; "
        "m = PrefillMark(sys.argv[1]); m.set(True); print('marked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "marked"
        host = HostPrefill(tmp_path)
        assert host.busy()
    finally:
        proc.kill()
        proc.wait(10)
    assert host.busy()  # its mark is fresh: until the next rescan it still counts
    host._scanned = float("-inf")  # the rescan (every RESCAN_S) finds its process gone: dropped, removed
    assert not host.busy()
    assert list(tmp_path.iterdir()) == []
    host.close()


def test_a_new_prefill_with_a_dead_ones_pid_does_not_shrink_its_file(tmp_path):
    """No O_TRUNC: the file keeps its 8 bytes (a reader still mapping it would fault on a shorter one)."""
    stale = tmp_path / f"prefill.{os.getpid()}"
    stale.write_bytes(MARK.pack(12345))
    mark = PrefillMark(tmp_path)
    assert stale.stat().st_size == MARK.size and MARK.unpack(stale.read_bytes())[0] == 0
    mark.close()


def test_wait_idle_returns_when_the_prefill_is_done_or_at_the_deadline(tmp_path):
    mark, host, stopped = PrefillMark(tmp_path), HostPrefill(tmp_path), threading.Event()
    assert host.wait_idle(time.perf_counter() + 5, stopped) < 0.05  # nothing to wait for
    mark.set(True)
    held = host.wait_idle(time.perf_counter() + 0.05, stopped)
    assert 0.045 <= held < 1.0  # busy the whole time: held to the deadline
    threading.Timer(0.05, mark.set, (False,)).start()
    held = host.wait_idle(time.perf_counter() + 5, stopped)
    assert 0.04 <= held < 2.0  # released when the prefill cleared its mark, long before the deadline
    mark.set(True)
    threading.Timer(0.05, stopped.set).start()
    assert host.wait_idle(time.perf_counter() + 5, stopped) < 2.0  # a stopping loop does not wait on
    mark.close()


def test_a_decode_loop_yields_to_a_busy_prefill_up_to_its_bound(tmp_path):
    """While a prefill of the host computes, each decode step waits (even a batch of one, which pacing
    leaves alone) until decode_yield_ms after the previous one; once prefill is idle it steps freely."""
    mark = PrefillMark(tmp_path)
    mark.set(True)
    engine = CountingEngine(running=1, steps=4)
    loop = EngineLoop(engine, lambda outputs: None)
    loop.share_host(str(tmp_path), "decode", 40.0)
    loop.start()
    try:
        wait_for(lambda: not engine.has_unfinished(), 10, "every decode step")
        gaps = [b - a for a, b in zip(engine.times, engine.times[1:], strict=False)]
        assert min(gaps) >= 0.039  # held to the bound while prefill was busy
        assert loop.yielded_s >= 0.039 * 3
        mark.set(False)
        engine.left = 50
        start = time.perf_counter()
        wait_for(lambda: not engine.has_unfinished(), 10, "the free decode steps")
        assert time.perf_counter() - start < 50 * 0.039 / 2  # no prefill busy: no yielding
    finally:
        loop.stop()
        loop.join(10)
        mark.close()


def test_a_prefill_loop_marks_while_it_has_work(tmp_path):
    host = HostPrefill(tmp_path)
    release = threading.Event()

    class SlowEngine(CountingEngine):
        def step(self, join=False):
            release.wait(10)
            return super().step(join)

    engine = SlowEngine(running=1, steps=1)
    loop = EngineLoop(engine, lambda outputs: None)
    loop.share_host(str(tmp_path), "prefill", None)
    loop.start()
    try:
        host._scanned = float("-inf")
        wait_for(host.busy, 10, "the prefill's mark while it steps")
        release.set()
        wait_for(lambda: not engine.has_unfinished(), 10, "the prefill step")
        wait_for(lambda: not host.busy(), 10, "the mark cleared once idle")
    finally:
        loop.stop()
        loop.join(10)
    assert list(tmp_path.iterdir()) == []  # the stopped loop removed its mark
    host.close()
