"""The engine thread: one thread owns the engine; everything else hands it closures.

gRPC handler threads and transfer threads never touch the engine: they `submit` closures to the
`EngineLoop` inbox (or `call` one and wait for its result), and the loop runs them between steps,
then polls the hand-off stages (`idle_hook`) and steps while there is work.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable

from kvferry.engine.engine import LLMEngine

log = logging.getLogger(__name__)


PACE_MIN_RUNNING = 4  # requests running before decode_step_interval_ms paces the steps


class EngineLoop(threading.Thread):
    """Runs `engine.step()` while there is work; runs submitted closures between steps.

    Pacing (`step_interval_ms`, a decode worker's EngineConfig.decode_step_interval_ms): with
    PACE_MIN_RUNNING or more requests running, a step starts no sooner than the interval after the
    previous one. A decode step's cost is mostly the weights it reads, whatever its batch, so a slower
    cadence carries more tokens per step (Little's law: the batch grows with the time a request stays)
    for the same reads, and the time between steps goes to the processes that share the cores
    (prefill, on one host). Fewer running requests (one stream alone) step at full speed.
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: Callable,
        idle_hook: Callable[[], bool] | None = None,
        on_error: Callable[[Exception], None] | None = None,
        sync: Callable[[bool], bool] | None = None,
        step_interval_ms: float | None = None,
        on_sync_lost: Callable[[], None] | None = None,
    ):
        super().__init__(name="engine", daemon=True)
        self.engine = engine
        self.on_outputs = on_outputs
        self.idle_hook = idle_hook  # extra work the loop polls (returns True when it did something)
        self.on_error = on_error  # a step failed: fail the requests in flight (the loop goes on)
        # lock-step groups: sync(this rank has work) -> any rank has work (a collective every
        # iteration); then every rank steps, the idle ones with an empty batch
        self.sync = sync
        if sync is not None and on_sync_lost is None:
            raise ValueError("a lock-step loop needs on_sync_lost: a rank alone cannot step on")
        self.on_sync_lost = on_sync_lost  # the sync failed (a rank is gone); the loop stops after it
        self.idle_wait_s = 0.005 if sync is not None else 0.05
        self.inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.stopped = threading.Event()
        self.step_interval_s = (step_interval_ms or 0.0) / 1e3  # pacing (see the class docstring)
        self.last_step = 0.0

    def submit(self, fn: Callable[[], None]) -> None:
        self.inbox.put(fn)
        self.wake.set()

    def call(self, fn: Callable[[], object], timeout_s: float = 30.0) -> object:
        """Run `fn` on the engine thread between steps and return its result (for handler threads)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.submit(lambda: done.set_result(fn()))
        return done.result(timeout=timeout_s)

    def run(self) -> None:
        while not self.stopped.is_set():
            ran = self._drain()
            if self.idle_hook is not None:
                try:
                    ran = self.idle_hook() or ran
                except Exception:
                    log.exception("engine idle work failed")
            busy = self.engine.has_unfinished()
            if self.sync is not None:
                try:
                    busy = self.sync(busy)
                except Exception:  # a rank of the group is gone: this one cannot step alone
                    log.exception("the worker group's lock-step sync failed")
                    self.stopped.set()
                    if self.on_sync_lost is not None:
                        self.on_sync_lost()
                    return
            if busy:
                self._pace()
                try:
                    outputs = self.engine.step(join=self.sync is not None)
                except Exception as err:
                    log.exception("engine step failed")
                    if self.on_error is not None:
                        self.on_error(err)
                    continue
                try:
                    self.on_outputs(outputs)
                except Exception:
                    log.exception("delivering engine outputs failed")
            elif not ran:
                self.wake.wait(self.idle_wait_s)
                self.wake.clear()

    def _pace(self) -> None:
        if self.step_interval_s and len(self.engine.scheduler.running) >= PACE_MIN_RUNNING:
            left = self.last_step + self.step_interval_s - time.perf_counter()
            if left > 0:
                self.stopped.wait(left)
        self.last_step = time.perf_counter()

    def _drain(self) -> bool:
        ran = False
        while True:
            try:
                fn = self.inbox.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            try:
                fn()
            except Exception:
                log.exception("engine task failed")

    def stop(self) -> None:
        self.stopped.set()
        self.wake.set()
