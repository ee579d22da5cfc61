"""The tensor-parallel group protocol, both sides: the leader (rank 0) and its followers.

Only rank 0 serves clients and runs the scheduler. Whatever needs every rank goes to the others as a
`GroupCommand` over the group's gloo broadcast, in one order, from the engine thread only (two
threads must never broadcast at once), and the followers execute them in that order:

- `step`: one forward pass (`StepInputs`, as a `GroupStep`); every rank computes its heads/shard.
- `pull`: start pulling pool blocks into these cache blocks (each rank its KV-head slice) on the
  transfer thread; `pull_done` later waits for that pull and agrees on the count every rank got
  (a MIN all-reduce): a block counts only if all its slices landed.
- `put`: write these cache blocks to one pool node (each KV-writing rank its slice), copied out now
  (the blocks are reused by the next step) and sent on the transfer thread.
- `ping`: an idle leader's keep-alive (a follower waits for the next command inside a collective,
  which would time out after the group timeout); `stop`: the group shuts down.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

from kvferry.engine.engine import LLMEngine
from kvferry.engine.model_runner import StepInputs
from kvferry.kvpool.client import PoolClient, from_proto, to_proto
from kvferry.kvpool.metadata import Location
from kvferry.kvpool.transfer import pack_blocks
from kvferry.rpc import hard_exit
from kvferry.v1 import worker_pb2
from kvferry.worker.group import Group, group_min

log = logging.getLogger(__name__)

PING_S = 30.0  # an idle leader's keep-alive to its followers (more often with a short group timeout)


def step_to_proto(step: StepInputs) -> worker_pb2.GroupStep:
    return worker_pb2.GroupStep(
        input_ids=step.input_ids,
        positions=step.positions,
        slot_blocks=step.slot_blocks,
        slot_offsets=step.slot_offsets,
        decode_tables=[b for t in step.decode_tables for b in t],
        decode_table_lens=[len(t) for t in step.decode_tables],
        decode_context_lens=step.decode_lens,
        prefills=[
            worker_pb2.PrefillPiece(q_start=a, q_len=b, context_len=c, block_table=t)
            for a, b, c, t in step.prefills
        ],
        sample_rows=step.sample_rows,
        mtp_prev=step.mtp_prev,
    )


def step_from_proto(msg: worker_pb2.GroupStep) -> StepInputs:
    flat, tables, pos = list(msg.decode_tables), [], 0
    for n in msg.decode_table_lens:
        tables.append(flat[pos : pos + n])
        pos += n
    return StepInputs(
        list(msg.input_ids),
        list(msg.positions),
        list(msg.slot_blocks),
        list(msg.slot_offsets),
        tables,
        list(msg.decode_context_lens),
        [(p.q_start, p.q_len, p.context_len, list(p.block_table)) for p in msg.prefills],
        list(msg.sample_rows),
        list(msg.mtp_prev),
    )


class TPLeader:
    """Rank 0's side. In a group of one every method is a no-op (`pull_done` returns its count), so
    the prefill worker calls them unconditionally. Engine thread only."""

    def __init__(self, group: Group, engine: LLMEngine):
        self.group = group
        self.active = group.size > 1
        self.last_command = time.monotonic()
        if self.active:  # the followers run each forward pass with us
            engine.mirror_steps(lambda step: self._send(worker_pb2.GroupCommand(step=step_to_proto(step))))

    def _send(self, cmd: worker_pb2.GroupCommand) -> None:
        self.last_command = time.monotonic()
        try:
            self.group.comm.broadcast_bytes(cmd.SerializeToString())
        except Exception:  # a rank is gone: the group cannot compute any more
            log.exception("tensor-parallel group %s lost a rank; exiting", self.group.group_id)
            hard_exit(1)

    def keepalive(self) -> None:
        every = min(PING_S, self.group.comm.timeout_s / 4)  # a waiting follower's collective times out
        if self.active and time.monotonic() - self.last_command > every:
            self._send(worker_pb2.GroupCommand(ping=True))

    def pull(self, request_id: str, locations: list[Location], block_ids: list[int]) -> None:
        if self.active:
            msg = worker_pb2.GroupPull(
                request_id=request_id, blocks=[to_proto(x) for x in locations], block_ids=block_ids
            )
            self._send(worker_pb2.GroupCommand(pull=msg))

    def pull_done(self, request_id: str, served: int) -> int:
        """The blocks of the pull every rank has (this rank served `served`)."""
        if not self.active:
            return served
        self._send(worker_pb2.GroupCommand(pull_done=request_id))
        try:
            return group_min(self.group.comm, served)
        except Exception:  # a rank is gone mid-collective: the group cannot go on
            log.exception("tensor-parallel group %s lost a rank; exiting", self.group.group_id)
            hard_exit(1)

    def put(
        self, request_id: str, nodes: list[str], keys: list[bytes], private: list[bool], block_ids: list[int]
    ):
        if self.active:
            msg = worker_pb2.GroupPut(
                request_id=request_id,
                node_id=nodes[0],
                replica_nodes=nodes[1:],
                keys=keys,
                private=private,
                block_ids=block_ids,
            )
            self._send(worker_pb2.GroupCommand(put=msg))

    def stop(self) -> None:
        if self.active:
            self._send(worker_pb2.GroupCommand(stop=True))


def follow(engine: LLMEngine, pool: PoolClient, group: Group) -> None:
    """A rank > 0: run the leader's commands in the order they come, until told to stop."""
    comm, cache = group.comm, engine.kv.cache
    shard = engine.model.shard
    heads = (shard.kv_heads.start, shard.kv_heads.stop)
    transfers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-follower")
    pulls: dict[str, concurrent.futures.Future] = {}
    log.info("rank %d of group %s following (KV heads %s)", group.rank, group.group_id, heads)

    def pull(p: worker_pb2.GroupPull) -> int:
        try:
            locations = [from_proto(x) for x in p.blocks]
            return pool.pull_into_cache(p.request_id, locations, cache, list(p.block_ids), *heads)
        except Exception as err:
            log.warning("pulling KV slice of %s failed: %s", p.request_id, err)
            return 0

    while True:
        try:
            cmd = worker_pb2.GroupCommand.FromString(comm.broadcast_bytes(None))
        except Exception:
            log.exception("lost rank 0 of group %s", group.group_id)
            return
        kind = cmd.WhichOneof("kind")
        if kind == "step":
            try:
                engine.execute(step_from_proto(cmd.step))
            except Exception:  # rank 0 is now out of step with us: the group is broken
                log.exception("forward pass failed on rank %d of group %s", group.rank, group.group_id)
                hard_exit(1)
        elif kind == "pull":
            pulls[cmd.pull.request_id] = transfers.submit(pull, cmd.pull)
        elif kind == "pull_done":
            future = pulls.pop(cmd.pull_done, None)
            group_min(comm, future.result() if future is not None else 0)
        elif kind == "put" and shard.writes_kv:
            p = cmd.put
            data = pack_blocks(cache, list(p.block_ids))  # now: the blocks are reused next step
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
            p.request_id, list(p.keys), data, list(p.private), [p.node_id, *p.replica_nodes], *heads
        ).add_done_callback(done)
    except Exception as err:
        log.warning("writing KV slice of %s failed: %s", p.request_id, err)
