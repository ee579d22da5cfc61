"""n sequences of one prompt (`sampling.n`, OpenAI's `n` and `best_of`): prefilled once, decoded apart.

The request's own handle leads; sequences 1 .. n-1 are sibling handles (`<id>-<i>`, in flight like any
request, each with its own decode stream, failover and release). The leader's prefill asks the worker
for n first tokens drawn from the same logits, and each sibling takes its own from that answer, with
the same KV blocks: the prompt is computed once and its pooled blocks are shared (a sibling whose
decode finds the leader's private tail block gone recomputes that tail, under one block). Colocated,
the siblings start once the leader's first token is out, so its prompt is in the decode worker's prefix
cache, and go to the leader's worker while it is up. A leader that fails or is aborted before its
prefill answers leaves each sibling to prefill alone. Messages carry their sequence's `index`.

`Sequences` runs the n streams (`run`, each through the router's one-sequence pipeline it is given) and
makes each sequence's prefill (`prefill`: its own through `router.dispatch`, or its share of the
leader's).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import grpc

from kvferry.auth import unscoped_id
from kvferry.convert import sampling_to_proto
from kvferry.router.inflight import Inflight, RequestRejected
from kvferry.v1 import generate_pb2, worker_pb2

if TYPE_CHECKING:
    from kvferry.router.admission import Admission
    from kvferry.router.dispatch import PrefillDispatch
    from kvferry.router.metrics import RouterMetrics

Stream = AsyncIterator[generate_pb2.GenerateResponse]


@dataclass
class SharedPrefill:
    """What the sequences of one request share: the leader's prefill, and when its stream started."""

    n: int
    prefill: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    started: asyncio.Event = field(default_factory=asyncio.Event)
    leader: Inflight | None = None


class LeaderGone(Exception):
    """The leader's prefill will not come (it failed, or the leader ended first)."""


class Sequences:
    """The sequences of a request: n of them run at once (`run`), and each one's prefill (`prefill`)."""

    def __init__(self, admission: Admission, dispatch: PrefillDispatch, metrics: RouterMetrics):
        self.admission = admission
        self.dispatch = dispatch
        self.metrics = metrics

    async def run(self, handle: Inflight, run_one: Callable[[Inflight], Stream]) -> Stream:
        """Run the n sequences of `handle` at once, each as `run_one` streams one (and releases what it
        holds); their messages, with `index` set, as they come. Raises the first error of any."""
        n = handle.params.n
        shared = SharedPrefill(n, leader=handle)
        handle.shared = shared
        try:
            for i in range(1, n):
                handle.siblings.append(self._sibling(handle, i, shared))
        except RequestRejected:  # an id taken: nothing ran, so nothing is left in flight
            for sibling in handle.siblings:
                self.admission.withdraw(sibling)
            self.admission.withdraw(handle)
            raise
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, h: Inflight) -> None:
            try:
                async with contextlib.aclosing(run_one(h)) as stream:
                    async for message in stream:
                        message.index = index
                        queue.put_nowait(message)
                        if index == 0:
                            shared.started.set()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                queue.put_nowait(err)
            finally:
                if index == 0:
                    shared.started.set()
                    if not shared.prefill.done():
                        shared.prefill.set_exception(LeaderGone())
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate([handle, *handle.siblings])]
        try:
            open_streams = n
            while open_streams:
                item = await queue.get()
                if item is None:
                    open_streams -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not shared.prefill.done():
                shared.prefill.cancel()
            elif not shared.prefill.cancelled():
                shared.prefill.exception()  # (retrieved: never "exception was never retrieved")

    def _sibling(self, handle: Inflight, index: int, shared: SharedPrefill) -> Inflight:
        """Sequence `index` of `handle` as a request in flight of its own (its own seed: seed + index)."""
        rid = f"{handle.request_id}-{index}"
        if self.admission.holds(rid):
            raise RequestRejected(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {unscoped_id(handle.owner, rid)!r} (sequence {index}) is already in flight",
            )
        seed = handle.params.seed
        params = replace(handle.params, n=1, seed=None if seed is None else (seed + index) % 2**64)
        sibling = Inflight(
            rid, handle.deadline, handle.t0, list(handle.ids), params, owner=handle.owner, api=handle.api
        )
        sibling.track = self.metrics.track(handle.track.api, handle.t0)
        sibling.cache_salt, sibling.shared, sibling.index = handle.cache_salt, shared, index
        sibling.priority = handle.priority
        sibling.prompt_keys, sibling.pooled = handle.prompt_keys, handle.pooled  # the request's one lookup
        self.admission.add(sibling)
        return sibling

    async def prefill(self, handle: Inflight) -> worker_pb2.PrefillResponse | None:
        """The prefill of a sequence: its own (one sequence, or a sibling whose leader's did not come),
        or, for the leader of n, one that samples every sequence's first token. None: Abort() came."""
        shared = handle.shared
        if shared is not None and handle.index:
            prefill = await self._sibling_prefill(handle)
            if prefill is not None:
                return prefill
        n = shared.n if shared is not None and not handle.index else 1
        sampling = sampling_to_proto(replace(handle.params, n=n))
        try:
            prefill = await self.dispatch.prefill(handle, sampling, handle.prompt_keys, handle.pooled)
        except BaseException as err:
            if shared is not None and not handle.index and not shared.prefill.done():
                shared.prefill.set_exception(LeaderGone(str(err)))
            raise
        if shared is not None and not handle.index and not shared.prefill.done():
            shared.prefill.set_result(prefill)
        return prefill

    async def _sibling_prefill(self, handle: Inflight) -> worker_pb2.PrefillResponse | None:
        """A sibling's view of the leader's prefill: its own first token, the same KV. None: the leader's
        did not come (the sibling prefills alone)."""
        try:
            leader = await asyncio.shield(handle.shared.prefill)
        except (LeaderGone, asyncio.CancelledError):
            if asyncio.current_task().cancelling():
                raise
            return None
        if leader is None or len(leader.sibling_first_token_ids) < handle.index:
            return None
        own = worker_pb2.PrefillResponse()
        own.CopyFrom(leader)
        own.first_token_id = leader.sibling_first_token_ids[handle.index - 1]
        own.ClearField("first_logprob")
        if len(leader.sibling_first_logprobs) >= handle.index:
            own.first_logprob.CopyFrom(leader.sibling_first_logprobs[handle.index - 1])
        return own
