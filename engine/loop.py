"""The engine thread: one thread owns the engine; everything else hands it closures.

gRPC handlers and transfer threads never touch the engine: they `submit` closures to the
`EngineLoop` inbox (or `call` one and get its result or its exception), and the loop runs them between
steps, then polls the hand-off stages (`idle_hook`) and steps while there is work. Every iteration it
completes is recorded (`progress`): a loop stuck in a step or a collective shows as stalled, which is
what the worker's heartbeat checks before it re-registers.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.engine.engine import LLMEngine
from kvferry.engine.host_share import HostPrefill, PrefillMark

log = logging.getLogger(__name__)


PACE_MIN_RUNNING = 4  # requests running before decode_step_interval_ms paces the steps
INTERVAL_WEIGHT = 0.2  # the observed step interval's running mean: each step's weight


class EngineStopped(RuntimeError):
    """The engine loop has stopped: a call submitted to it will never run."""


@dataclass
class Progress:
    """When the engine loop last completed an iteration (time.monotonic).

    An idle loop completes one every few tens of milliseconds, so the time since the last one is how
    long the loop has been inside one piece of work (a step, a closure, a collective).
    """

    last: float = field(default_factory=time.monotonic)

    def tick(self, now: float | None = None) -> None:
        self.last = time.monotonic() if now is None else now

    def stalled_for(self, now: float | None = None) -> float:
        return max(0.0, (time.monotonic() if now is None else now) - self.last)

    def stalled(self, limit_s: float, now: float | None = None) -> bool:
        """True once the current iteration has run longer than `limit_s`."""
        return self.stalled_for(now) > limit_s


@dataclass
class _Call:
    """An inbox entry whose result (or exception) someone waits for."""

    fn: Callable[[], object]
    future: concurrent.futures.Future

    def __call__(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # the caller gave up on it
        try:
            self.future.set_result(self.fn())
        except Exception as err:  # the caller gets it (raised from its `result()`)
            self.future.set_exception(err)


class EngineLoop(threading.Thread):
    """Runs `engine.step()` while there is work; runs submitted closures between steps.

    Pacing (`step_interval_ms`, a decode worker's EngineConfig.decode_step_interval_ms): with
    PACE_MIN_RUNNING or more requests running, a step starts no sooner than the interval after the
    previous one (a pass of several decode steps, multi-step decode, that many intervals after it). A
    decode step's cost is mostly the weights it reads, whatever its batch, so a slower
    cadence carries more tokens per step (Little's law: the batch grows with the time a request stays)
    for the same reads, and the time between steps goes to the processes that share the cores
    (prefill, on one host). Fewer running requests (one stream alone) step at full speed.

    Sharing a host's cores (`share_host`, engine.host_share): a prefill loop marks when it has work; a
    decode loop holds each step back while a prefill of its host computes, up to `decode_yield_ms` after
    its previous step started, whatever its batch.
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
        self.progress = Progress()
        self.wake = threading.Event()
        self.stopped = threading.Event()
        self.step_interval_s = (step_interval_ms or 0.0) / 1e3  # pacing (see the class docstring)
        self.last_step = 0.0
        self.step_interval_ms = 0.0  # observed: the running mean of the time between busy steps
        self._busy_since: float | None = None
        self._busy_steps = 1  # the decode steps of the pass that started at _busy_since
        self.prefill_mark: PrefillMark | None = None  # a prefill loop on a shared host
        self.host_prefill: HostPrefill | None = None  # a decode loop on a shared host
        self.yield_s = 0.0
        self.yielded_s = 0.0  # held back for the host's prefill, in all

    def share_host(self, directory: str, role: str, yield_ms: float | None) -> None:
        """Share this host's cores with the other kind of worker (engine.host_share): a prefill loop
        marks when it has work in `directory`; a decode loop (`yield_ms` > 0) yields to those marks."""
        if role == "prefill":
            self.prefill_mark = PrefillMark(directory)
        elif yield_ms:
            self.host_prefill = HostPrefill(directory)
            self.yield_s = yield_ms / 1e3

    def submit(self, fn: Callable[[], None]) -> None:
        self.inbox.put(fn)
        self.wake.set()

    def call_future(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between steps; the future gets its result or its exception,
        or EngineStopped if the loop has stopped (or stops before it runs)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.submit(_Call(fn, done))
        if self.stopped.is_set():  # the loop may have drained its inbox already: nobody else will
            self._fail_pending()
        return done

    def call(self, fn: Callable[[], object], timeout_s: float = 30.0) -> object:
        """`call_future(fn)`'s result: raises what `fn` raised, EngineStopped, or TimeoutError."""
        return self.call_future(fn).result(timeout=timeout_s)

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.stopped.set()
            self._fail_pending()
            for shared in (self.prefill_mark, self.host_prefill):
                if shared is not None:
                    shared.close()

    def _fail_pending(self) -> None:
        """The loop is done: whoever waits on a call learns it now (plain closures are dropped)."""
        dropped = 0
        while True:
            try:
                fn = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(fn, _Call):
                if fn.future.set_running_or_notify_cancel():
                    fn.future.set_exception(EngineStopped("the engine loop has stopped"))
            else:
                dropped += 1
        if dropped:
            log.info("engine loop stopped with %d task(s) not run", dropped)

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.progress.tick()
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
            if self.prefill_mark is not None:
                self.prefill_mark.set(busy)
            if busy:
                self._pace()
                start, steps = time.perf_counter(), self.engine.num_steps
                try:
                    outputs = self.engine.step(join=self.sync is not None)
                    if self.engine.num_steps > steps:  # a forward pass ran (not just queue bookkeeping)
                        self._interval(start, self.engine.num_steps - steps)
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
                self._busy_since, self._busy_steps = None, 1  # idle: the next interval starts afresh
                self.wake.wait(self.idle_wait_s)
                self.wake.clear()

    def _interval(self, now: float, steps: int) -> None:
        """The running mean of the time between the starts of consecutive forward passes with no idle
        wait between them (a decode's TPOT as its streams see it: the step, the pacing, and whatever
        else took the cores meanwhile), a pass of several decode steps (multi-step decode) counted as
        that many; `steps`: the pass starting `now`."""
        if self._busy_since is not None:
            ms = (now - self._busy_since) * 1e3 / self._busy_steps
            if self.step_interval_ms:
                self.step_interval_ms += INTERVAL_WEIGHT * (ms - self.step_interval_ms)
            else:
                self.step_interval_ms = ms
        self._busy_since, self._busy_steps = now, steps

    def _pace(self) -> None:
        if self.step_interval_s and len(self.engine.scheduler.running) >= PACE_MIN_RUNNING:
            left = self.last_step + self.step_interval_s * self._busy_steps - time.perf_counter()
            if left > 0:
                self.stopped.wait(left)
        if self.host_prefill is not None and self.last_step:
            self.yielded_s += self.host_prefill.wait_idle(self.last_step + self.yield_s, self.stopped)
        self.last_step = time.perf_counter()

    def _drain(self) -> bool:
        ran = False
        while not self.stopped.is_set():  # once stopped, what is left fails (_fail_pending)
            try:
                fn = self.inbox.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            try:
                fn()
            except Exception:
                log.exception("engine task failed")
        return ran

    def stop(self) -> None:
        self.stopped.set()
        self.wake.set()
