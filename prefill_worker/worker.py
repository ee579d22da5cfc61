"""The prefill worker: the engine in prefill-only mode behind the PrefillWorker gRPC service.

For each request: take the prompt's leading blocks from the worker's own prefix cache, pull the next
ones the pool holds (their keys are registered in the local cache, so the scheduler simply sees a
prefix hit), run chunked prefill over the rest, sample the first token, then copy the prompt's KV
out of the paged cache and write the blocks the pool lacks (full blocks shared by key, the partial
tail as the request's private block) on a transfer thread while the engine moves on. The answer is
the first token and the location of every block. Nothing is kept per request after that.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from dataclasses import dataclass, field, replace

import grpc

from kvferry.convert import sampling_from_proto
from kvferry.decode_worker.engine import LLMEngine
from kvferry.decode_worker.request import InvalidRequestError, Request, RequestStatus
from kvferry.decode_worker.serving import EngineLoop, EngineWorker, run_worker
from kvferry.kvpool.client import PoolClient, PoolError, to_proto
from kvferry.kvpool.transfer import pack_blocks, unpack_blocks
from kvferry.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class Job:
    request: worker_pb2.PrefillRequest
    arrived: float
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    req: Request | None = None
    holder: list[int] = field(default_factory=list)  # pulled / local blocks pinned until admission
    started: float = 0.0
    pool_hit_blocks: int = 0


class PrefillWorker(EngineWorker, worker_pb2_grpc.PrefillWorkerServicer):
    role = "prefill"

    def __init__(self, engine: LLMEngine, pool: PoolClient, worker_id: str):
        super().__init__(engine, pool, worker_id)
        self.jobs: dict[str, Job] = {}
        self.loop = EngineLoop(engine, self._on_outputs, on_error=self._fail_all)
        self._pending_puts: list[tuple[Job, dict]] = []
        engine.finish_hook = self._capture

    def active_ids(self) -> list[str]:
        return list(self.jobs)

    def load(self) -> dict:
        sched = self.engine.scheduler
        return {"inflight": len(self.jobs), "waiting": len(sched.waiting), "running": len(sched.running)}

    # -- gRPC -----------------------------------------------------------------------------------------
    def Prefill(self, request, context):
        job = Job(request, time.perf_counter())
        rid = request.request_id
        context.add_callback(lambda: self.loop.submit(lambda: self._cancel(rid)))
        self.loop.submit(lambda: self._start(job))
        try:
            return job.future.result()
        except InvalidRequestError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except concurrent.futures.CancelledError:
            context.abort(grpc.StatusCode.CANCELLED, f"request {rid} was cancelled")
        except PoolError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except Exception as err:
            context.abort(grpc.StatusCode.INTERNAL, f"prefill of {rid} failed: {err}")

    def _stats(self) -> worker_pb2.WorkerStats:
        return super()._stats(prompt_tokens_computed=self.counters["prompt_tokens_computed"])

    # -- engine thread --------------------------------------------------------------------------------
    def _start(self, job: Job) -> None:
        request, e = job.request, self.engine
        p = request.sampling
        # one token here, whatever the request asks: EOS and stop rules are applied by the router
        params = replace(sampling_from_proto(p), max_tokens=1, stop=(), stop_token_ids=(), ignore_eos=True)
        try:
            if request.request_id in self.jobs:
                raise InvalidRequestError(f"request_id {request.request_id!r} is already in prefill")
            req = e.make_request(None, params, list(request.prompt_token_ids), request.request_id)
        except InvalidRequestError as err:
            job.future.set_exception(err)
            return
        job.req, job.started = req, time.perf_counter()
        self.jobs[req.request_id] = job
        try:
            self._pull_prefix(job)
        except PoolError as err:  # a pool outage costs recompute, never the request
            log.warning("prefix pull for %s failed, computing it: %s", req.request_id, err)
        except Exception as err:
            log.exception("prefix pull for %s failed", req.request_id)
            self._drop(req.request_id)
            job.future.set_exception(err)
            return
        e.submit(req)

    def _fail_all(self, err: Exception) -> None:
        """A step failed: every request in the engine fails (the worker keeps serving new ones)."""
        for request_id, job in list(self.jobs.items()):
            self.engine.abort(request_id)
            self._drop(request_id)
            if not job.future.done():
                job.future.set_exception(RuntimeError(f"engine step failed: {err}"))

    def _pull_prefix(self, job: Job) -> None:
        req, bm = job.req, self.engine.block_manager
        bs = bm.block_size
        usable = (req.num_prompt_tokens - 1) // bs  # leave one token to compute for the logits
        if usable == 0 or not bm.enable_caching:
            return
        bm.update_keys(req)
        keys = req.block_keys[:usable]
        job.holder = bm.take_cached(keys)
        rest = keys[len(job.holder) :]
        locations = self.pool.lookup_prefix(rest) if rest else []
        if not locations:
            return
        reserved = bm.reserve(len(locations))
        if reserved is None:
            return
        cache = self.engine.runner.kv_cache

        def land(first: int, data) -> None:
            unpack_blocks(cache, reserved[first : first + data.shape[0]], data)

        try:
            n = self.pool.get_into(req.request_id, locations, land)
        except Exception:
            bm.release(reserved)
            raise
        for block_id, key in zip(reserved[:n], rest, strict=False):
            bm.register(block_id, key)
        bm.release(reserved[n:])
        job.holder += reserved[:n]
        job.pool_hit_blocks = n
        self.counters["blocks_pulled"] += n

    def _on_outputs(self, outputs) -> None:
        bm = self.engine.block_manager
        for job in list(self.jobs.values()):
            if job.holder and job.req.status != RequestStatus.WAITING:
                bm.release(job.holder)
                job.holder = []
        for out in outputs:
            if out.finished and out.finish_reason == "abort":
                self._drop(out.request_id)
        puts, self._pending_puts = self._pending_puts, []
        for job, plan in puts:
            self.transfers.submit(self._write_out, job, plan)

    def _capture(self, req: Request) -> None:
        """Finish hook: copy the prompt's KV out before the engine frees the blocks."""
        job = self.jobs.get(req.request_id)
        if job is None:
            return
        bs = self.engine.cfg.block_size
        num_full = req.num_prompt_tokens // bs
        self.engine.block_manager.update_keys(req)
        full_keys = req.block_keys[:num_full]
        locations = self.pool.meta.lookup(full_keys)  # blocks the pool already holds are not re-sent
        write = [i for i in range(num_full) if locations[i] is None]
        tail = req.num_prompt_tokens % bs > 0
        if tail:
            write.append(num_full)
        keys = [full_keys[i] if i < num_full else os.urandom(16) for i in write]
        private = [i == num_full for i in write]
        data = pack_blocks(self.engine.runner.kv_cache, [req.block_ids[i] for i in write]) if write else None
        cached = req.num_cached_tokens
        pool_hits = min(job.pool_hit_blocks * bs, cached)
        self.counters["requests"] += 1
        self.counters["prompt_tokens_computed"] += req.num_prompt_tokens - cached
        self.counters["pool_hit_tokens"] += pool_hits
        self.counters["local_hit_tokens"] += cached - pool_hits
        plan = {
            "first_token": req.output_token_ids[-1],
            "locations": locations + [None] * tail,
            "write": write,
            "keys": keys,
            "private": private,
            "data": data,
            "cached": cached,
            "computed": req.num_prompt_tokens - cached,
            "prefill_done": time.perf_counter(),
        }
        self._pending_puts.append((job, plan))

    def _write_out(self, job: Job, plan: dict) -> None:
        """Transfer thread: send the blocks; the pool's reply completes the request (see _answer)."""
        started = time.perf_counter()
        if not plan["write"]:
            self._answer(job, plan, [], started)
            return
        try:
            pending = self.pool.put_async(job.req.request_id, plan["keys"], plan["data"], plan["private"])
        except Exception as err:  # whatever went wrong, the request is answered (its KV will be recomputed)
            log.warning("writing KV of %s to the pool failed: %s", job.req.request_id, err)
            self._answer(job, plan, [None] * len(plan["write"]), started)
            return
        plan["data"] = None  # sent: the copy can go

        def done(future) -> None:
            try:
                stored = future.result()
            except Exception as err:
                log.warning("writing KV of %s to the pool failed: %s", job.req.request_id, err)
                stored = [None] * len(plan["write"])
            self._answer(job, plan, stored, started)

        pending.add_done_callback(done)

    def _answer(self, job: Job, plan: dict, stored: list, started: float) -> None:
        req, locations = job.req, plan["locations"]
        for i, loc in zip(plan["write"], stored, strict=True):
            locations[i] = loc
        self.counters["blocks_put"] += sum(loc is not None for loc in stored)
        prefix = []
        for loc in locations:
            if loc is None:
                break
            prefix.append(loc)
        bs = self.engine.cfg.block_size
        reply = worker_pb2.PrefillResponse(
            first_token_id=plan["first_token"],
            blocks=[to_proto(loc) for loc in prefix],
            num_kv_tokens=min(len(prefix) * bs, req.num_prompt_tokens),
            cached_tokens=plan["cached"],
            computed_tokens=plan["computed"],
            queue_ms=(job.started - job.arrived) * 1e3,
            prefill_ms=(plan["prefill_done"] - job.started) * 1e3,
            kv_put_ms=(time.perf_counter() - started) * 1e3,
        )
        self.loop.submit(lambda: self._drop(req.request_id))
        try:
            job.future.set_result(reply)
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile: free its private tail
            self.pool.release(req.request_id)

    def _cancel(self, request_id: str) -> None:
        job = self.jobs.get(request_id)
        if job is None or job.future.done():
            return
        self.engine.abort(request_id)
        self._drop(request_id)
        job.future.cancel()

    def _drop(self, request_id: str) -> None:
        job = self.jobs.pop(request_id, None)
        if job is not None and job.holder:
            self.engine.block_manager.release(job.holder)
            job.holder = []


def main(argv: list[str] | None = None) -> int:
    return run_worker(
        "prefill",
        PrefillWorker,
        lambda servicer, server: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server),
        worker_pb2.DESCRIPTOR,
        argv,
    )
