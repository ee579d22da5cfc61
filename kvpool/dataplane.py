"""The pair-group data plane: a transfer is a tensor header naming its blocks, then their bytes.

No RPC per transfer. A client runs its transfers to one node one at a time, in order, each on a
block of tags (`transfer.next_tag`): tag T carries the header (client -> node), T + 1 the node's
answer (node -> client), T + 2... the data messages of `chunk_blocks` blocks each. The node keeps a
receive for the next header posted at all times (`PoolNode._serve_peer`), so a transfer starts the
moment the client sends it:
- PUT: header (request id, KV-head slice, per block: key, private flag, the reserved slot and its
  generation it was packed for, or -1), then the data; the node lands it (straight into the slab when
  the slots are one range and the slice is every head), completes it, waits for the other ranks'
  slices of its blocks, and answers on the answer stream.
- GET: header (request id, slice, per block: key, slot, generation); the node leases the leading
  valid blocks, answers their count n (int64 [1]) on T + 1, then sends them.
- COMMIT: a PUT header with no data after it: a same-host client wrote the blocks into the named
  slots of the node's shared slab itself (`shm.py`); the node completes them as a PUT's.
Put answers complete out of order (a TP slice waits for the other ranks'), so they travel on a stream
of their own, tags `ANSWER_TAG + k` in the order the node completes them: int64 [put's tag, n, then
(slot, generation) per block; generation 0 = not stored]. The client keeps one receive posted on it.
The header is raw bytes (struct, little-endian; never pickle) in a fixed-size buffer, so the node can
post its receive before knowing the transfer's size (a gloo receive may be larger than the send).

`PairLink` is the client's end: one per node, it makes the pair group on first use, runs the
transfers on one thread in tag order (a put returns once its data is handed over, a get waits for its
blocks), matches the answers to the puts, and fails whatever a node that died or hangs still owes
within `timeout_s`, dropping the group so the next use makes a new one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import queue
import struct
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from kvferry.kvpool.metadata import Location
from kvferry.kvpool.transfer import (
    CHUNK_BYTES,
    BlockLayout,
    Staging,
    chunk_plan,
    make_pair_group,
    next_tag,
    recv_stream,
    send_stream,
)
from kvferry.v1 import pool_pb2

log = logging.getLogger(__name__)

PUT, GET, COMMIT = 1, 2, 3
HEADER_BYTES = 1 << 16
MAX_REQUEST_ID = 1024  # bytes of utf-8
# op, blocks, head_begin, head_end, chunk_blocks, len(request id), layer_begin, layer_end (0: the last)
_FIXED = struct.Struct("<IIIIIIII")
_BLOCK = struct.Struct("<16sqQ?")  # key, slot (-1: none named), generation, private
MAX_BLOCKS = (HEADER_BYTES - _FIXED.size - MAX_REQUEST_ID) // _BLOCK.size  # per transfer
IDLE = timedelta(days=365)  # waits between transfers (the peer's death ends them, not a timeout)
ANSWER_TAG = 2**30  # put answers: ANSWER_TAG + k % 2**29 (transfer tags stay below 2**30)
RETRY_S = 2.0  # after a failed connect, a node is not tried again for this long
TRANSFER_TIMEOUT_S = 10.0  # the default longest wait on a peer within a transfer (clients and nodes)


class PoolError(RuntimeError):
    """A pool node could not be reached or refused a transfer."""


def answer_tag(k: int) -> int:
    return ANSWER_TAG + k % 2**29


def encode_answer(tag: int, locations: Sequence) -> torch.Tensor:
    """A put's answer: [tag, n, (slot, generation) per block]; `locations` are BlockLocation-like."""
    rows = [v for loc in locations for v in (loc.slot, loc.generation)]
    return torch.tensor([tag, len(locations), *rows], dtype=torch.int64)


@dataclass(frozen=True)
class Header:
    op: int
    request_id: str
    head_begin: int
    head_end: int
    chunk_blocks: int
    keys: list[bytes]
    slots: list[int] = field(default_factory=list)  # -1: no slot named
    generations: list[int] = field(default_factory=list)
    private: list[bool] = field(default_factory=list)
    layer_begin: int = 0  # a layer-wise put: the layers it carries (layer_end 0: to the last)
    layer_end: int = 0

    @property
    def messages(self) -> int:
        """Data messages the transfer's tags make room for (a GET's budget, even if fewer are served)."""
        return 0 if self.op == COMMIT else len(chunk_plan(len(self.keys), self.chunk_blocks))

    def encode(self) -> torch.Tensor:
        rid = self.request_id.encode()
        n = len(self.keys)
        if len(rid) > MAX_REQUEST_ID or n > MAX_BLOCKS:
            raise ValueError(
                f"a transfer carries <= {MAX_BLOCKS} blocks and a request id <= {MAX_REQUEST_ID} B"
            )
        if any(len(k) != 16 for k in self.keys):
            raise ValueError("block keys are 16 bytes")
        slots = self.slots or [-1] * n
        gens = self.generations or [0] * n
        private = self.private or [False] * n
        out = bytearray(
            _FIXED.pack(
                self.op,
                n,
                self.head_begin,
                self.head_end,
                self.chunk_blocks,
                len(rid),
                self.layer_begin,
                self.layer_end,
            )
        )
        out += rid
        for row in zip(self.keys, slots, gens, private, strict=True):
            out += _BLOCK.pack(*row)
        return torch.frombuffer(out, dtype=torch.uint8)

    @classmethod
    def decode(cls, buf: torch.Tensor) -> Header:
        data = buf.numpy().tobytes()
        op, n, head_begin, head_end, chunk_blocks, rid_len, layer_begin, layer_end = _FIXED.unpack_from(data)
        if op not in (PUT, GET, COMMIT) or n > MAX_BLOCKS or rid_len > MAX_REQUEST_ID or chunk_blocks == 0:
            raise ValueError(f"malformed transfer header (op {op}, {n} blocks)")
        start = _FIXED.size + rid_len
        rows = list(_BLOCK.iter_unpack(data[start : start + n * _BLOCK.size]))
        return cls(
            op,
            data[_FIXED.size : start].decode(),
            head_begin,
            head_end,
            chunk_blocks,
            [r[0] for r in rows],
            [r[1] for r in rows],
            [r[2] for r in rows],
            [r[3] for r in rows],
            layer_begin,
            layer_end,
        )


def header_buffer() -> torch.Tensor:
    return torch.zeros(HEADER_BYTES, dtype=torch.uint8)


@dataclass
class Put:
    """One put on its way: what `put_async` was given, the reserved slots it names, its future."""

    request_id: str
    keys: list[bytes]
    data: torch.Tensor | Callable[[int, int, torch.Tensor], None]
    private: list[bool]
    named: list[tuple[int, int]]  # reserved (slot, generation) for the leading blocks
    head_begin: int
    head_end: int
    done: concurrent.futures.Future
    layer_begin: int = 0  # a layer-wise put: the layers it carries (layer_end 0: to the last)
    layer_end: int = 0

    def settle(self, found=None, error: Exception | None = None) -> None:
        """Resolve the future once (the answer and the deadline may race)."""
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if error is not None:
                self.done.set_exception(error)
            else:
                self.done.set_result(found)


@dataclass
class PairLink:
    """This client's pair group with one node (see the module docstring)."""

    node_id: str
    rendezvous: Callable[[str, float], dist.Store]  # the store of a pair group by name (MetadataStore's)
    node_device: str
    stub: object  # KVPoolStub
    layout: BlockLayout
    peer_id: str
    host: str
    device: torch.device
    timeout_s: float
    interface: str = ""  # PoolConfig.data_interface ("": `host`)
    store: dist.Store | None = None  # the pair group's rendezvous, kept while the group lives
    staging: Staging = field(init=False)
    group: dist.ProcessGroup | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_tag: int = 1
    pending: dict[int, Put] = field(default_factory=dict)  # put tag -> put awaiting its answer
    jobs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    deadlines: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    down_until: float = 0.0  # a connect failed: fail fast until then

    def __post_init__(self) -> None:
        self.staging = Staging(self.layout.torch_dtype, self.device)
        threading.Thread(target=self._run_jobs, name=f"kv-{self.node_id}", daemon=True).start()
        threading.Thread(target=self._watch_deadlines, name=f"kv-due-{self.node_id}", daemon=True).start()

    @contextlib.contextmanager
    def _locked(self):
        """Hold `lock`, waiting no longer than the timeout (another caller may be stuck connecting
        to a node that hangs)."""
        if not self.lock.acquire(timeout=self.timeout_s):
            raise PoolError(f"pool node {self.node_id} is busy past {self.timeout_s}s (hung?)")
        try:
            yield
        finally:
            self.lock.release()

    # -- transfers -------------------------------------------------------------------------------------
    def put(self, put: Put, commit: bool = False) -> None:
        """Send a PUT header and the data (a COMMIT header alone: the data is in the named slots of
        the shared slab already); the node's answer resolves `put.done`."""
        hb, he, n = put.head_begin, put.head_end, len(put.keys)
        lb, le = put.layer_begin, put.layer_end
        chunk_blocks = self._chunk_blocks(hb, he)
        plan = [] if commit else chunk_plan(n, chunk_blocks)
        unnamed = n - len(put.named)
        header = Header(
            COMMIT if commit else PUT,
            put.request_id,
            hb,
            he,
            chunk_blocks,
            put.keys,
            [slot for slot, _ in put.named] + [-1] * unnamed,
            [gen for _, gen in put.named] + [0] * unnamed,
            put.private,
            lb,
            le,
        ).encode()

        def chunk(i: int, first: int, count: int) -> torch.Tensor:
            if isinstance(put.data, torch.Tensor):
                return put.data[first : first + count]
            out = self.staging.view(self.layout.slice_shape(count, hb, he, lb, le), i)
            put.data(first, count, out)
            return out

        with self._locked():
            group = self._connect()
            tag = self._tags(len(plan))
            self.pending[tag] = put

            def run() -> None:
                told = group.send([header], 0, tag)
                send_stream(group, 0, tag + 2, plan, chunk)
                told.wait()

            sent = self._submit(group, run)

        def after_send(job) -> None:
            if job.exception() is not None:
                self.drop(group, job.exception(), f"put of {n} blocks")
            else:
                self.deadlines.put((time.monotonic() + self.timeout_s, put, group))

        sent.add_done_callback(after_send)

    def get(
        self, request_id: str, run: Sequence[Location], head_begin: int, head_end: int, offset, consume
    ) -> int:
        """A GET header; the node answers the count it serves, then the blocks (`consume`d here)."""
        chunk_blocks = self._chunk_blocks(head_begin, head_end)
        header = Header(
            GET,
            request_id,
            head_begin,
            head_end,
            chunk_blocks,
            [loc.key for loc in run],
            [loc.slot for loc in run],
            [loc.generation for loc in run],
        )
        encoded = header.encode()
        # a receive that outlives the caller's wait must not land data in blocks the caller has given up
        landing = threading.Lock()
        abandoned = False

        def dest(i: int, first: int, count: int) -> torch.Tensor:
            return self.staging.view(self.layout.slice_shape(count, head_begin, head_end), i)

        def land(i: int, first: int, count: int, data: torch.Tensor) -> None:
            with landing:
                if abandoned:
                    raise PoolError("the caller stopped waiting")
                consume(offset + first, data)

        with self._locked():
            group = self._connect()
            tag = self._tags(header.messages)

            def receive() -> int:
                told = group.send([encoded], 0, tag)
                count = torch.zeros(1, dtype=torch.int64)
                group.recv([count], 0, tag + 1).wait()
                n = int(count.item())
                recv_stream(group, 0, tag + 2, chunk_plan(n, chunk_blocks), dest, land)
                told.wait()
                return n

            received = self._submit(group, receive)
        try:
            return received.result(timeout=self.timeout_s)
        except Exception as err:  # the transfer failed, or timed out (the node died or hangs)
            with landing:
                abandoned = True
            if isinstance(err, concurrent.futures.TimeoutError):
                err = TimeoutError(f"no data after {self.timeout_s}s")
            raise self.drop(group, err, f"get of {len(run)} blocks") from err

    def drop(self, group, err: Exception, what: str) -> PoolError:
        """Forget `group` after a failure (unless it was replaced already: a late failure of an old
        group must not tear down a healthy new one) and fail the puts still waiting on it."""
        error = PoolError(f"{what} on pool node {self.node_id} failed: {err}")
        with self.lock:
            orphans = []
            if self.group is group:
                self.group, self.next_tag = None, 1
                orphans, self.pending = list(self.pending.values()), {}
        for put in orphans:
            put.settle(error=error)
        return error

    def close(self) -> None:
        self.jobs.put(None)
        self.deadlines.put(None)

    # -- internals -------------------------------------------------------------------------------------
    def _connect(self) -> dist.ProcessGroup:
        """The pair group (caller holds `lock`); made on first use."""
        if self.group is not None:
            return self.group
        if time.monotonic() < self.down_until:
            raise PoolError(f"pool node {self.node_id} refused a connection less than {RETRY_S}s ago")
        # gloo, CUDA ends included: headers, counts and answers are CPU tensors matched by tag, which
        # NCCL can carry neither (an NCCL data plane needs its control stream on a separate gloo group)
        backend = "gloo"
        name = f"{self.peer_id}/{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + self.timeout_s
        reply = None
        try:
            joined = self._join(name, backend)
            reply = self.stub.Connect.future(
                pool_pb2.ConnectRequest(peer_id=self.peer_id, group_name=name, backend=backend),
                timeout=self.timeout_s,
            )
            # a dead node fails the RPC at once: do not wait out the rendezvous then
            while not joined.done():
                if reply.done() and reply.exception() is not None:
                    raise reply.exception()
                if time.monotonic() > deadline:
                    raise concurrent.futures.TimeoutError()
                concurrent.futures.wait([joined], timeout=0.01)
            group, store = joined.result(timeout=0)
            reply.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as err:  # store unreachable, peer never joined, RPC failed: the node is down
            if reply is not None:
                reply.cancel()
            self.down_until = time.monotonic() + RETRY_S
            if isinstance(err, concurrent.futures.TimeoutError):
                err = TimeoutError(f"no pair group after {self.timeout_s}s")
            raise PoolError(f"cannot connect to pool node {self.node_id}: {err}") from err
        self.group, self.store, self.next_tag, self.pending = group, store, 1, {}
        threading.Thread(
            target=self._answers, args=(group,), name=f"kv-ans-{self.node_id}", daemon=True
        ).start()
        return group

    def _join(self, name: str, backend: str) -> concurrent.futures.Future:
        """Join pair group `name` (its rendezvous in the cluster's Redis: kvpool.rendezvous) on a
        thread of its own, so the caller's wait is bounded however the join goes; a join that finishes
        after the caller gave up is dropped."""
        joined: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                store = self.rendezvous(name, self.timeout_s)
                group = make_pair_group(store, name, 1, backend, self.host, self.timeout_s, self.interface)
                joined.set_result((group, store))
            except Exception as err:
                joined.set_exception(err)

        threading.Thread(target=run, name=f"kv-join-{name}", daemon=True).start()
        return joined

    def _answers(self, group) -> None:
        """The node's put answers on `group`, in the order it completes them, until the group breaks."""
        buf = torch.empty(2 + 2 * MAX_BLOCKS, dtype=torch.int64)
        for k in itertools.count():
            try:
                group.recv([buf], 0, answer_tag(k)).wait(IDLE)
            except Exception as err:
                self.drop(group, err, "waiting for put answers")
                return
            tag, n = int(buf[0]), int(buf[1])
            rows = buf[2 : 2 + 2 * n].view(n, 2).tolist()
            with self.lock:
                put = self.pending.pop(tag, None) if self.group is group else None
            if put is not None:
                found = [
                    Location(k, self.node_id, s, g) if g else None
                    for k, (s, g) in zip(put.keys, rows, strict=True)
                ]
                put.settle(found)

    def _watch_deadlines(self) -> None:
        """Fail the group whose node owes an answer past the timeout (it died or hangs). Puts come in
        the order they were sent, so in the order of their deadlines."""
        while (item := self.deadlines.get()) is not None:
            deadline, put, group = item
            try:
                put.done.exception(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.CancelledError:
                continue
            except concurrent.futures.TimeoutError:
                self.drop(
                    group,
                    TimeoutError(f"no answer after {self.timeout_s}s"),
                    f"put of {len(put.keys)} blocks",
                )

    def _submit(self, group, job: Callable[[], object]) -> concurrent.futures.Future:
        """Queue a transfer on `group` for the data-plane thread (caller holds `lock`). A transfer
        whose pair group was dropped before its turn fails at once: its tags are gone."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> object:
            if self.group is not group:
                raise PoolError(f"the pair group with pool node {self.node_id} was dropped")
            return job()

        self.jobs.put((run, future))
        return future

    def _run_jobs(self) -> None:
        while (item := self.jobs.get()) is not None:
            job, future = item
            try:
                future.set_result(job())
            except Exception as err:
                future.set_exception(err)

    def _chunk_blocks(self, head_begin: int, head_end: int) -> int:
        per_block = self.layout.block_bytes * (head_end - head_begin) // self.layout.num_kv_heads
        return max(1, CHUNK_BYTES // per_block)

    def _tags(self, messages: int) -> int:
        """A base tag with room for the header, the count and `messages` data messages after them."""
        base = self.next_tag
        self.next_tag = next_tag(base, messages)
        return base
