"""The decode side of the KV hand-off: what a request carries through each stage.

    admitted -> prealloc -> transfer -> waiting -> running -> finished
               (blocks)    (pool -> cache)  (the engine's queues)

- **prealloc** (`DecodeWorker.prealloc`, a queue in arrival order): the request waits for free cache
  blocks to pull its KV into. The head of the queue takes its local prefix-cache hits and reserves
  blocks for the rest as soon as enough are free.
- **transfer** (`KVPull`, a `kvferry.worker.stages.TransferStage`): the transfer thread pulls the
  blocks from the pool straight into the reserved blocks while the running batch keeps stepping.
- **waiting / running**: the engine's scheduler owns the request (`add_with_kv`): it resumes from
  the tokens whose KV arrived and recomputes the rest, so a pool miss costs time, never correctness.

A colocated request (`prefill_here`) skips the hand-off and goes to the engine whole.

The engine thread sends each message to the call's handler (a coroutine on the server's event loop)
through the stream's `LoopQueue`; an Abort that comes before its Decode call is remembered a while in
`EarlyAborts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvferry.engine.request import Request
from kvferry.kvpool.metadata import Location
from kvferry.v1 import worker_pb2


@dataclass
class HandoffReport:
    """What the request's first message reports about its hand-off."""

    kv_pull_ms: float = 0.0
    kv_ready: float = 0.0  # when the engine took it (perf_counter)
    pulled_tokens: int = 0
    recomputed_tokens: int = 0


class LoopQueue:
    """An asyncio.Queue that another thread feeds: `put` from any thread, `get` on the event loop that
    created it (a message put after that loop closed is dropped: nobody listens any more)."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        with contextlib.suppress(RuntimeError):  # the server's loop is closed (shutdown)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def get(self):
        return await self.queue.get()


class LinkOut:
    """The outgoing side of one Relay link (a router's one stream to this worker): the engine thread
    puts (request id, message) pairs, and the link's handler on the event loop takes all that came since
    its last wake-up as one RelayBatch: one message per engine step for every stream the router relays."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.items: deque = deque()
        self.armed = False  # a wake-up is on its way
        self.ready = asyncio.Event()
        self.closed = False  # the link broke or ended (event loop thread)

    def put(self, request_id: str, item, wake: bool = True) -> None:
        """Any thread (the engine's, mostly). `wake=False`: more come; `wake()` once they are all in
        (an engine step's messages: one batch)."""
        self.items.append((request_id, item))
        if wake:
            self.wake()

    def wake(self) -> None:
        if not self.armed:
            self.armed = True
            with contextlib.suppress(RuntimeError):  # the server's loop is closed (shutdown)
                self.loop.call_soon_threadsafe(self.ready.set)

    async def take(self) -> list:
        """Event loop: everything put since the last take (waits for something)."""
        await self.ready.wait()
        self.ready.clear()
        self.armed = False  # before draining: a put after this point wakes the next take
        out = []
        while self.items:
            out.append(self.items.popleft())
        return out


class LinkSink:
    """The `out` of a stream started on a Relay link: its messages go out tagged with its id."""

    __slots__ = ("link", "request_id")

    def __init__(self, link: LinkOut, request_id: str):
        self.link, self.request_id = link, request_id

    def put(self, item) -> None:
        self.link.put(self.request_id, item)


class _Discard:
    """The queue of a stream no call streams any more: what is put is dropped."""

    def put(self, item) -> None:
        pass


DISCARD = _Discard()


@dataclass
class Stream:
    """One Decode call: its request, the queue its handler streams from, its first report."""

    request: worker_pb2.DecodeRequest
    out: LoopQueue | LinkSink | _Discard
    req: Request | None = None
    report: HandoffReport | None = field(default_factory=HandoffReport)  # None once sent
    held: list[int] = field(default_factory=list)  # tokens not sent yet (EngineConfig.stream_interval)
    held_logprobs: list = field(default_factory=list)  # their logprobs, when the request asks
    matcher: object | None = None  # its structured output's matcher (compiled in the gRPC handler)
    # a detachable stream (DecodeRequest.detach_grace_s > 0) keeps every token it produced, for Attach
    emitted: list[int] = field(default_factory=list)
    emitted_logprobs: list = field(default_factory=list)
    detached_until: float | None = None  # monotonic deadline while no call streams it (its router died)
    finish_reason: str = ""  # set when it finished while detached (kept for the resume until the grace)


@dataclass
class KVPull:
    """A request in the transfer stage: the blocks it holds and the ones being filled."""

    stream: Stream
    local: list[int]  # blocks found in the local prefix cache
    reserved: list[int]  # blocks the pulled KV lands in
    remote: list[Location]  # where the rest lies in the pool


TAKEN_OVER = object()  # put in a call's queue when Attach moved its stream to another call


class EarlyAborts:
    """Abort calls that came before their Decode call, which then ends at once with "abort".

    Bounded: an entry expires after `ttl_s`, and at most `cap` are kept (the oldest go first). Only an
    Abort for an id this worker does not hold makes one, and not if a stream of that id finished here
    within `ttl_s` (that Abort is late, not early): a finished request leaves nothing behind, so its id
    can be used again at once.
    """

    def __init__(self, ttl_s: float = 30.0, cap: int = 4096):
        self.ttl_s, self.cap = ttl_s, cap
        self.pending: OrderedDict[str, float] = OrderedDict()  # request id -> when its Abort came
        self.owners: dict[str, str] = {}  # request id -> the only owner its abort is for (if any)
        self.finished: OrderedDict[str, float] = OrderedDict()  # request id -> when its stream ended

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, request_id: str, now: float | None = None, owner: str | None = None) -> bool:
        """An Abort for an id not held here; True if it is remembered (its Decode call may come).
        `owner`: it aborts only that owner's request of the id (an abort another router passed on)."""
        now = time.monotonic() if now is None else now
        self._expire(self.finished, now)
        if request_id in self.finished:
            return False
        self._put(self.pending, request_id, now)
        if owner is None:
            self.owners.pop(request_id, None)
        else:
            self.owners[request_id] = owner
        return True

    def take(self, request_id: str, now: float | None = None, owner: str = "") -> bool:
        """A Decode call of `owner`'s arrived: True if it was aborted already (the entry is used up)."""
        now = time.monotonic() if now is None else now
        self.finished.pop(request_id, None)  # a new request holds the id now
        at = self.pending.pop(request_id, None)
        only = self.owners.pop(request_id, None)
        return at is not None and now - at <= self.ttl_s and (not only or only == owner)

    def stream_finished(self, request_id: str, now: float | None = None) -> None:
        self._put(self.finished, request_id, time.monotonic() if now is None else now)

    def _put(self, entries: OrderedDict[str, float], request_id: str, now: float) -> None:
        entries.pop(request_id, None)
        entries[request_id] = now
        self._expire(entries, now)

    def _expire(self, entries: OrderedDict[str, float], now: float) -> None:
        while entries and (len(entries) > self.cap or now - next(iter(entries.values())) > self.ttl_s):
            request_id, _ = entries.popitem(last=False)
            if entries is self.pending:
                self.owners.pop(request_id, None)
