"""The worker's engine thread survives a failing step and reports it."""

from __future__ import annotations

import threading
import time

from kvferry.engine.loop import EngineLoop


class FlakyEngine:
    def __init__(self):
        self.calls = 0
        self.pending = 2

    def has_unfinished(self) -> bool:
        return self.pending > 0

    def step(self, join=False):
        self.calls += 1
        self.pending -= 1
        if self.calls == 1:
            raise RuntimeError("boom")
        return ["out"]


def test_failed_step_is_reported_and_the_loop_goes_on():
    engine = FlakyEngine()
    errors, outputs = [], []
    loop = EngineLoop(engine, outputs.extend, on_error=errors.append)
    loop.start()
    deadline = time.monotonic() + 10
    while not (engine.pending == 0 and outputs) and time.monotonic() < deadline:
        time.sleep(0.01)
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

    def has_unfinished(self) -> bool:
        return self.left > 0

    def step(self, join=False):
        self.times.append(time.perf_counter())
        self.left -= 1
        return []


def run_steps(engine, **kwargs) -> list[float]:
    loop = EngineLoop(engine, lambda outputs: None, **kwargs)
    loop.start()
    deadline = time.monotonic() + 10
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.005)
    loop.stop()
    loop.join(10)
    assert not engine.has_unfinished()
    return [b - a for a, b in zip(engine.times, engine.times[1:], strict=False)]


def test_paced_steps_wait_for_the_interval_once_enough_requests_run():
    gaps = run_steps(CountingEngine(running=4, steps=5), step_interval_ms=30)
    assert min(gaps) >= 0.029  # every step starts >= 30 ms after the previous one
    # fewer than PACE_MIN_RUNNING requests (one stream alone) step at full speed
    fast = run_steps(CountingEngine(running=3, steps=50), step_interval_ms=30)
    assert sum(fast) < 0.030 * len(fast) / 2
    # no interval: no pacing
    assert sum(run_steps(CountingEngine(running=8, steps=50))) < 0.030 * 49 / 2
