"""A stage of the KV hand-off whose work runs off the engine thread, polled by the engine loop.

Each worker names its hand-off as stages a request moves through (SGLang's disaggregation reads the
same way: prealloc -> transfer -> waiting -> running). A `TransferStage` holds the requests whose
transfer (a pool lookup, a pull into the paged cache, a write to the pool) is in flight on the
worker's transfer thread; the engine loop `poll`s it between steps and moves the finished ones on. A
request aborted meanwhile is `discard`ed: its transfer cannot be interrupted, so it comes back from
`poll` as abandoned, and whoever polls frees what it held.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Done(Generic[T]):
    """A finished transfer: its item, what the work returned (or the exception it raised)."""

    request_id: str
    item: T
    value: object = None
    error: BaseException | None = None


class TransferStage(Generic[T]):
    """Items keyed by request id, whose work runs on `executor` (the worker's one transfer thread).

    `work()` may return a value, or a `concurrent.futures.Future` (an asynchronous write): the item
    is done when that future is. `on_done`, if given, runs on the finishing thread right away (a
    reply that must not wait for the engine loop); everything else happens in `poll`, on the engine
    thread. `wake` tells the engine loop there is something to poll.
    """

    def __init__(
        self,
        name: str,
        executor: concurrent.futures.Executor,
        wake: Callable[[], None],
        on_done: Callable[[Done[T]], None] | None = None,
    ):
        self.name = name
        self.executor = executor
        self.wake = wake
        self.on_done = on_done
        self.items: dict[str, T] = {}
        self._finished: queue.SimpleQueue[Done[T]] = queue.SimpleQueue()

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.items

    def start(self, request_id: str, item: T, work: Callable[[], object]) -> None:
        """Engine thread: the item enters the stage and its work is queued (if the executor refuses it,
        the item does not enter). What finishes is only taken by `poll`, on this same thread."""
        self.executor.submit(self._run, request_id, item, work)
        self.items[request_id] = item

    def discard(self, request_id: str) -> T | None:
        """Engine thread: the request left (aborted); its transfer ends as abandoned in `poll`."""
        return self.items.pop(request_id, None)

    def poll(self) -> tuple[list[Done[T]], list[Done[T]]]:
        """Engine thread: (finished, abandoned) since the last poll, in the order they finished."""
        finished, abandoned = [], []
        while True:
            try:
                done = self._finished.get_nowait()
            except queue.Empty:
                return finished, abandoned
            if self.items.get(done.request_id) is done.item:
                del self.items[done.request_id]
                finished.append(done)
            else:
                abandoned.append(done)

    def _run(self, request_id: str, item: T, work: Callable[[], object]) -> None:
        try:
            value = work()
        except BaseException as err:
            self._finish(Done(request_id, item, error=err))
            return
        if isinstance(value, concurrent.futures.Future):
            value.add_done_callback(lambda f: self._finish(_outcome(request_id, item, f)))
        else:
            self._finish(Done(request_id, item, value))

    def _finish(self, done: Done[T]) -> None:
        if self.on_done is not None:
            try:
                self.on_done(done)
            except Exception:
                log.exception("%s: finishing %s failed", self.name, done.request_id)
        self._finished.put(done)
        self.wake()


def _outcome(request_id: str, item, future: concurrent.futures.Future) -> Done:
    if future.cancelled():
        return Done(request_id, item, error=concurrent.futures.CancelledError())
    error = future.exception()
    return Done(request_id, item, None if error is not None else future.result(), error)
