"""The worker's engine thread: survives a failing step, answers calls (or fails them fast), shows stalls."""

from __future__ import annotations

import threading
import time

import pytest

from kvferry.deploy.fault_harness import wait_for
from kvferry.engine.loop import EngineLoop, EngineStopped, Progress


class FlakyEngine:
    def __init__(self):
        self.calls = 0
        self.pending = 2
        self.num_steps = 0

    def has_unfinished(self) -> bool:
        return self.pending > 0

    def step(self, join=False):
        self.calls += 1
        self.pending -= 1
        if self.calls == 1:
            raise RuntimeError("boom")
        self.num_steps += 1
        return ["out"]


def test_failed_step_is_reported_and_the_loop_goes_on():
    engine = FlakyEngine()
    errors, outputs = [], []
    loop = EngineLoop(engine, outputs.extend, on_error=errors.append)
    loop.start()
    wait_for(lambda: engine.pending == 0 and outputs, 10, "both steps")
    ran = threading.Event()
    loop.submit(ran.set)  # still takes work after the failure
    assert ran.wait(10)
    loop.stop()
    loop.join(10)
    assert [str(e) for e in errors] == ["boom"]
    assert outputs == ["out"]
    assert not loop.is_alive()


class CountingEngine:
    """Steps a fixed number of times with `running` requests in its batch, recording when."""

    def __init__(self, running: int, steps: int):
        self.scheduler = type("Sched", (), {"running": [None] * running})()
        self.left = steps
        self.times: list[float] = []
        self.num_steps = 0

    def has_unfinished(self) -> bool:
        return self.left > 0

    def step(self, join=False):
        self.times.append(time.perf_counter())
        self.left -= 1
        self.num_steps += 1
        return []


def run_loop(engine, **kwargs) -> EngineLoop:
    """Run an EngineLoop over `engine` until it has no work left; the stopped loop."""
    loop = EngineLoop(engine, lambda outputs: None, **kwargs)
    loop.start()
    wait_for(lambda: not engine.has_unfinished(), 10, "every step")
    loop.stop()
    loop.join(10)
    return loop


def run_steps(engine, **kwargs) -> list[float]:
    run_loop(engine, **kwargs)
    return [b - a for a, b in zip(engine.times, engine.times[1:], strict=False)]


def test_paced_steps_wait_for_the_interval_once_enough_requests_run():
    gaps = run_steps(CountingEngine(running=4, steps=5), step_interval_ms=30)
    assert min(gaps) >= 0.029  # every step starts >= 30 ms after the previous one
    # fewer than PACE_MIN_RUNNING requests (one stream alone) step at full speed
    fast = run_steps(CountingEngine(running=3, steps=50), step_interval_ms=30)
    assert sum(fast) < 0.030 * len(fast) / 2
    # no interval: no pacing
    assert sum(run_steps(CountingEngine(running=8, steps=50))) < 0.030 * 49 / 2


def test_the_loop_reports_the_interval_its_streams_see():
    """`step_interval_ms`: the running mean of the time between forward passes (SLO admission's TPOT)."""
    loop = run_loop(CountingEngine(running=4, steps=8), step_interval_ms=30)
    assert 29 <= loop.step_interval_ms < 200


class BurstEngine(CountingEngine):
    """Each step() a pass of 4 decode steps (multi-step decode)."""

    def step(self, join=False):
        out = super().step(join)
        self.num_steps += 3
        return out


def test_a_pass_of_several_decode_steps_paces_and_counts_as_that_many():
    engine = BurstEngine(running=4, steps=5)
    loop = run_loop(engine, step_interval_ms=20)
    gaps = [b - a for a, b in zip(engine.times, engine.times[1:], strict=False)]
    assert min(gaps) >= 0.079  # 4 intervals after the previous pass
    assert 19 <= loop.step_interval_ms < 60  # the time a stream sees between its tokens


class IdleEngine:
    def has_unfinished(self) -> bool:
        return False


def test_call_raises_what_the_function_raised_at_once():
    loop = EngineLoop(IdleEngine(), lambda outputs: None)
    loop.start()
    try:
        assert loop.call(lambda: 41 + 1) == 42

        def boom():
            raise KeyError("nope")

        started = time.monotonic()
        with pytest.raises(KeyError, match="nope"):
            loop.call(boom, timeout_s=20)
        assert time.monotonic() - started < 5  # not the call's timeout
    finally:
        loop.stop()
        loop.join(10)


def test_call_fails_fast_once_the_loop_has_stopped():
    loop = EngineLoop(IdleEngine(), lambda outputs: None)
    loop.start()
    loop.stop()
    loop.join(10)
    started = time.monotonic()
    with pytest.raises(EngineStopped):
        loop.call(lambda: 1, timeout_s=20)
    assert time.monotonic() - started < 5


def test_calls_pending_when_the_loop_stops_fail():
    loop = EngineLoop(IdleEngine(), lambda outputs: None)
    loop.start()
    release, entered = threading.Event(), threading.Event()

    def hold():
        entered.set()
        release.wait(10)

    loop.submit(hold)
    assert entered.wait(10)
    pending = [loop.call_future(lambda: 1) for _ in range(3)]  # queued behind `hold`
    loop.stop()
    release.set()
    loop.join(10)
    for future in pending:
        with pytest.raises(EngineStopped):
            future.result(timeout=5)


def test_progress_records_iterations_and_shows_a_stall():
    progress = Progress(last=100.0)
    assert not progress.stalled(30.0, now=120.0)
    assert progress.stalled(30.0, now=131.0)
    progress.tick(now=131.0)
    assert not progress.stalled(30.0, now=131.5)
    assert progress.stalled_for(now=130.0) == 0.0  # never negative


def test_a_loop_blocked_in_its_work_stops_making_progress():
    loop = EngineLoop(IdleEngine(), lambda outputs: None)
    loop.start()
    release = threading.Event()
    try:
        started = loop.progress.last
        wait_for(lambda: loop.progress.last != started, 10, "an idle iteration")
        assert not loop.progress.stalled(0.5)  # idle: iterates every idle wait
        loop.submit(lambda: release.wait(10))  # the engine thread hangs in its work
        wait_for(lambda: loop.progress.stalled(0.5), 10, "a stall")
        release.set()
        wait_for(lambda: not loop.progress.stalled(0.5), 10, "progress to resume")
    finally:
        release.set()
        loop.stop()
        loop.join(10)
