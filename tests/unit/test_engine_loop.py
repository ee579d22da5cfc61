"""The worker's engine thread survives a failing step and reports it."""

from __future__ import annotations

import threading
import time

from kvferry.decode_worker.serving import EngineLoop


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
