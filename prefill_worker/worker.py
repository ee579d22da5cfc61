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
import torch
import torch.distributed as dist

from kvferry.convert import sampling_from_proto
from kvferry.decode_worker.serving import EngineLoop, EngineWorker, Group, run_worker
from kvferry.engine.engine import LLMEngine
from kvferry.engine.model_runner import StepInputs
from kvferry.engine.request import InvalidRequestError, Request, RequestStatus
from kvferry.kvpool.client import PoolClient, PoolError, from_proto, to_proto
from kvferry.kvpool.transfer import pack_blocks
from kvferry.model.parallel import Comm
from kvferry.rpc import hard_exit
from kvferry.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

PING_S = 30.0  # an idle TP leader's keep-alive to its followers (the group timeout is 600 s)


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

    def __init__(self, engine: LLMEngine, pool: PoolClient, worker_id: str, group: Group | None = None):
        super().__init__(engine, pool, worker_id, group)
        self.jobs: dict[str, Job] = {}
        self.loop = EngineLoop(engine, self._on_outputs, idle_hook=self._keepalive, on_error=self._fail_all)
        self._last_command = time.monotonic()
        self._pending_puts: list[tuple[Job, dict]] = []
        engine.finish_hook = self._capture
        kv = engine.model.shard.kv_heads  # this rank's KV heads: its slice of every pool block
        self.heads = (kv.start, kv.stop)
        if self.group.size > 1:  # tensor-parallel leader: the followers run each step with us
            engine.runner.broadcast_step = lambda step: self._command(
                worker_pb2.GroupCommand(step=step.to_proto())
            )

    def _command(self, cmd: worker_pb2.GroupCommand) -> None:
        """Send a command to the group's other ranks (they execute commands in this order)."""
        self._last_command = time.monotonic()
        try:
            self.group.comm.broadcast_bytes(cmd.SerializeToString())
        except Exception:  # a rank is gone: the group cannot compute any more
            log.exception("tensor-parallel group %s lost a rank; exiting", self.group.group_id)
            hard_exit(1)

    def _keepalive(self) -> bool:
        """Engine thread, every loop iteration: an idle leader pings its followers now and then (they
        wait for the next command in a collective, which would time out after the group timeout)."""
        if self.group.size > 1 and time.monotonic() - self._last_command > PING_S:
            self._command(worker_pb2.GroupCommand(ping=True))
        return False

    def stop(self) -> None:
        super().stop()
        # only from here once the engine thread is gone: two threads must never broadcast at once (if
        # it is stuck in a step, the followers end with this process instead, by PR_SET_PDEATHSIG)
        if self.group.size > 1 and not self.loop.is_alive():
            self._command(worker_pb2.GroupCommand(stop=True))

    def active_ids(self) -> list[str]:
        return list(self.jobs)

    def idle(self) -> bool:
        return not self.jobs and not self._pending_puts

    def load(self) -> dict:
        sched, bm = self.engine.scheduler, self.engine.block_manager
        return {
            "inflight": len(self.jobs),
            "waiting": len(sched.waiting),
            "running": len(sched.running),
            "free_blocks": bm.num_free_blocks,
            "total_blocks": bm.num_blocks,
        }

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
        self.leave_group_if_broken(err)

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
        if self.group.size > 1:
            pull = worker_pb2.GroupPull(
                request_id=req.request_id, blocks=[to_proto(x) for x in locations], block_ids=reserved
            )
            self._command(worker_pb2.GroupCommand(pull=pull))
        error, n = None, 0
        try:
            n = self.pool.pull_into_cache(
                req.request_id, locations, self.engine.runner.kv_cache, reserved, *self.heads
            )
        except Exception as err:
            error = err
        n = group_min(self.group.comm, n)  # a block counts only if every rank got its slice
        if error is not None:
            bm.release(reserved)
            raise error
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
        block_ids = [req.block_ids[i] for i in write]
        data = pack_blocks(self.engine.runner.kv_cache, block_ids) if write else None
        node_id = None
        if write and self.group.size > 1:  # every rank sends its slice of the blocks to one node
            try:
                node_id = self.pool.pick_node()
            except PoolError as err:
                log.warning("no pool node for %s: %s", req.request_id, err)
                write, keys, private, data = [], [], [], None
            else:
                put = worker_pb2.GroupPut(
                    request_id=req.request_id,
                    node_id=node_id,
                    keys=keys,
                    private=private,
                    block_ids=block_ids,
                )
                self._command(worker_pb2.GroupCommand(put=put))
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
            "node_id": node_id,
            "cached": cached,
            "pool_cached": pool_hits,
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
            pending = self.pool.put_async(
                job.req.request_id,
                plan["keys"],
                plan["data"],
                plan["private"],
                plan["node_id"],
                *self.heads,
            )
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
            pool_cached_tokens=plan["pool_cached"],
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


def group_min(comm: Comm, value: int) -> int:
    return int(comm.all_reduce(torch.tensor([value], dtype=torch.int64), dist.ReduceOp.MIN, cpu=True).item())


def follow(engine: LLMEngine, pool: PoolClient, group: Group) -> None:
    """A tensor-parallel rank > 0: run rank 0's commands (forward passes, KV pulls and puts of this
    rank's KV-head slice) in the order they come, until told to stop."""
    comm, runner = group.comm, engine.runner
    shard = engine.model.shard
    heads = (shard.kv_heads.start, shard.kv_heads.stop)
    transfers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-follower")
    log.info("rank %d of group %s following (KV heads %s)", group.rank, group.group_id, heads)
    while True:
        try:
            cmd = worker_pb2.GroupCommand.FromString(comm.broadcast_bytes(None))
        except Exception:
            log.exception("lost rank 0 of group %s", group.group_id)
            return
        kind = cmd.WhichOneof("kind")
        if kind == "step":
            try:
                runner.execute(StepInputs.from_proto(cmd.step))
            except Exception:  # rank 0 is now out of step with us: the group is broken
                log.exception("forward pass failed on rank %d of group %s", group.rank, group.group_id)
                hard_exit(1)
        elif kind == "pull":
            p, n = cmd.pull, 0
            try:
                locations = [from_proto(x) for x in p.blocks]
                n = pool.pull_into_cache(p.request_id, locations, runner.kv_cache, list(p.block_ids), *heads)
            except Exception as err:
                log.warning("pulling KV slice of %s failed: %s", p.request_id, err)
            group_min(comm, n)
        elif kind == "put" and shard.writes_kv:
            p = cmd.put
            data = pack_blocks(runner.kv_cache, list(p.block_ids))  # now: the blocks are reused next step
            transfers.submit(_put_slice, pool, p, data, heads)
        elif kind == "stop":
            transfers.shutdown(wait=True)
            return
        # "ping": nothing to do


def _put_slice(pool: PoolClient, p: worker_pb2.GroupPut, data, heads) -> None:
    def done(future) -> None:
        if future.exception() is not None:
            log.warning("writing KV slice of %s failed: %s", p.request_id, future.exception())

    try:
        pool.put_async(
            p.request_id, list(p.keys), data, list(p.private), p.node_id, *heads
        ).add_done_callback(done)
    except Exception as err:
        log.warning("writing KV slice of %s failed: %s", p.request_id, err)


def main(argv: list[str] | None = None) -> int:
    return run_worker(
        "prefill",
        PrefillWorker,
        lambda servicer, server: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server),
        worker_pb2.DESCRIPTOR,
        argv,
        follow=follow,
    )
