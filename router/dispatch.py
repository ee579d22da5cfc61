"""The prefill: the worker KV-aware routing picks (`router.prefix_routing`), the call with the request's
block keys and pool lookup, and failover to another worker when one dies or refuses
(`router.failover`).

`PrefillDispatch` is one of the five parts of `router.server.Router` (with `router.admission`,
`router.slo`, `router.relay` and `router.sequences`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from kvferry.kvpool.client import to_proto
from kvferry.router.admission import Inflight, RequestRejected, WorkerFailed
from kvferry.router.directory import Member
from kvferry.router.failover import MAX_RETRIES, SUSPECT_S, connection_lost, relay_code, retryable
from kvferry.router.prefix_routing import Choice
from kvferry.v1 import worker_pb2

log = logging.getLogger(__name__)


def cached_of(prefill: worker_pb2.PrefillResponse) -> tuple[int, int]:
    """(prefix-cache hit tokens, of which pulled from the pool) of a prefill."""
    return prefill.cached_tokens, prefill.pool_cached_tokens


class PrefillDispatch:
    """Router methods: the prefill of a request, and what every worker call shares (retry, failure)."""

    async def _prefill(
        self, handle: Inflight, ids: list[int], sampling, keys: worker_pb2.PromptKeys, pooled
    ) -> worker_pb2.PrefillResponse | None:
        """The prefill on the worker `self.routing` chooses (`pooled`: where the pool holds the leading
        `keys`, which the worker gets too); one that dies or refuses is replaced by another (at most
        MAX_RETRIES times, never the same one twice). None: Abort() came meanwhile."""
        request = worker_pb2.PrefillRequest(
            request_id=handle.request_id,
            prompt_token_ids=ids,
            sampling=sampling,
            keys=keys,
            looked_up=True,
            pooled=[to_proto(loc) for loc in pooled],
            priority=handle.priority,
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
                prefill = await self._call_prefill(handle, choice, request)
            except WorkerFailed as err:
                self.routing.failed(choice)
                if not self._retry(handle, err, "prefill", tries):
                    raise
                failed = err
                handle.release_pool = True  # the failed one may have put part of the prompt's KV
                continue
            if prefill is not None:
                self.metrics.prefilled(choice, cached_of(prefill))
            return prefill

    async def _call_prefill(self, handle, choice: Choice, request: worker_pb2.PrefillRequest):
        worker = choice.worker
        worker.inflight += 1
        worker.inflight_tokens += choice.compute_tokens
        self.prefill_sent(handle, worker, choice.compute_tokens)
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
            raise self._failed(worker, "prefill", err) from None
        finally:
            worker.inflight -= 1
            worker.inflight_tokens -= choice.compute_tokens
            self.prefill_ended(handle, worker)
            handle.calls.remove(call)

    def _retry(self, handle: Inflight, err: WorkerFailed, role: str, tries: int) -> bool:
        """Whether a failed worker call is tried again on another worker of `role` (logged, counted)."""
        if not err.retry or tries > MAX_RETRIES or handle.aborted or handle.remaining() <= 0:
            return False
        log.warning("%s of %s failed, trying another worker: %s", role, handle.request_id, err)
        self.metrics.failover(role, err.code.name)
        return True

    def _failed(self, worker: Member, role: str, err: grpc.aio.AioRpcError) -> WorkerFailed:
        """The WorkerFailed of a failed call; a worker whose connection broke gets nothing new for a while."""
        if connection_lost(err):
            self.directory.suspect(worker, SUSPECT_S)
        return WorkerFailed(
            relay_code(err), f"{role} worker {worker.member_id}: {err.details()}", retryable(role, err)
        )
