"""The prefill: the worker KV-aware routing picks (`router.prefix_routing`), the call with the request's
block keys and pool lookup, and failover to another worker when one dies or refuses
(`router.failover`). `PrefillDispatch` counts each prefill in flight on its worker (the routing's load,
and the SLO predictor's queues) until the worker answers.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from kvferry.kvpool.client import to_proto
from kvferry.router.inflight import Inflight, RequestRejected, WorkerFailed
from kvferry.v1 import generate_pb2, worker_pb2

if TYPE_CHECKING:
    from kvferry.kvpool.metadata import Location
    from kvferry.router.failover import Failover
    from kvferry.router.metrics import RouterMetrics
    from kvferry.router.prefix_routing import Choice, PrefillRouting
    from kvferry.router.slo import SloPredictor


def cached_of(prefill: worker_pb2.PrefillResponse) -> tuple[int, int]:
    """(prefix-cache hit tokens, of which pulled from the pool) of a prefill."""
    return prefill.cached_tokens, prefill.pool_cached_tokens


class PrefillDispatch:
    """Sends a request's prefill to the worker `routing` chooses (`prefill`), another one when it fails."""

    def __init__(
        self, routing: PrefillRouting, metrics: RouterMetrics, slo: SloPredictor, failover: Failover
    ):
        self.routing = routing
        self.metrics = metrics
        self.slo = slo
        self.failover = failover

    async def prefill(
        self,
        handle: Inflight,
        sampling: generate_pb2.SamplingParams,
        keys: worker_pb2.PromptKeys,
        pooled: Sequence[Location],
    ) -> worker_pb2.PrefillResponse | None:
        """The prefill of `handle`'s prompt on the worker `self.routing` chooses (`pooled`: where the
        pool holds the leading `keys`, which the worker gets too); one that dies or refuses is replaced by
        another (at most MAX_RETRIES times, never the same one twice). None: Abort() came meanwhile.
        Raises WorkerFailed (the last failure) or RequestRejected UNAVAILABLE (no worker to try)."""
        ids = handle.ids
        request = worker_pb2.PrefillRequest(
            request_id=handle.request_id,
            prompt_token_ids=ids,
            sampling=sampling,
            keys=keys,
            looked_up=True,
            pooled=[to_proto(loc) for loc in pooled],
            priority=handle.priority,
            owner=handle.owner,
        )
        tried: set[str] = set()
        failed: WorkerFailed | None = None
        for tries in itertools.count(1):
            choice = self.routing.choose(keys.block_keys, pooled, len(ids), tried)
            if choice is None:  # none left to try: the last failure is the answer
                raise failed or RequestRejected(grpc.StatusCode.UNAVAILABLE, "no prefill worker is available")
            tried.add(choice.worker.member_id)
            self.metrics.routed(choice)
            try:
                prefill = await self._call(handle, choice, request)
            except WorkerFailed as err:
                self.routing.failed(choice)
                if not self.failover.retry(handle, err, "prefill", tries):
                    raise
                failed = err
                handle.release_pool = True  # the failed one may have put part of the prompt's KV
                continue
            if prefill is not None:
                self.metrics.prefilled(choice, cached_of(prefill))
            return prefill

    async def _call(
        self, handle: Inflight, choice: Choice, request: worker_pb2.PrefillRequest
    ) -> worker_pb2.PrefillResponse | None:
        worker = choice.worker
        worker.inflight += 1
        worker.inflight_tokens += choice.compute_tokens
        self.slo.prefill_sent(handle, worker, choice.compute_tokens)
        call = worker.stub.Prefill(request, timeout=handle.remaining())
        handle.calls.append(call)
        try:
            return await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if handle.aborted and task is not None and not task.cancelling():
                return None  # Abort() cancelled the call: finish the stream with "abort"
            raise
        except grpc.aio.AioRpcError as err:
            raise self.failover.failed(worker, "prefill", err) from None
        finally:
            worker.inflight -= 1
            worker.inflight_tokens -= choice.compute_tokens
            self.slo.prefill_ended(handle, worker)
            handle.calls.remove(call)
