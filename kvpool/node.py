"""A pool node: the gRPC servicer (control) and pair groups (data) around a slab of block slots.

`PoolNode` owns the slab tensor, the peers' pair groups and the Redis metadata writes; which slot
holds what, and every rule about slot states, generations, leases, eviction and expiry, is the
`SlotTable` in `slots.py`, which the node calls under its one lock. Here:
- `Peer`: one client's pair group, whose transfers run strictly in the order of their tags.
- `PoolNode`: Connect / Put / Get / Release / GetStats. A put reserves slots, receives the bytes
  (straight into the slab when the slots are one range), then completes them and answers only once
  every KV-head slice of its blocks is in (the other TP ranks' puts), waiting on a Condition; a get
  leases its slots for the transfer. Publishing and unpublishing in Redis happen on a background
  thread (`_publisher`), in order; the heartbeat also runs the expiry sweep and republishes every
  complete block when Redis comes back empty, or when the node's own registry record had lapsed
  (readers drop the entries of a node missing from the registry).
- `transfer_timeout_s` bounds every wait on a peer (its pair group's sends and receives, the wait for
  a transfer's turn): a client that died or hangs costs a handler thread that long at most.
The command line (`python -m kvferry.kvpool`) is in `__main__.py`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist

from kvferry.kvpool.metadata import POOL_ROLE, Location, MetadataStore
from kvferry.kvpool.slots import SlotTable
from kvferry.kvpool.transfer import (
    BlockLayout,
    Staging,
    chunk_plan,
    host_store,
    make_pair_group,
    next_tag,
    recv_stream,
    runs,
    send,
    send_stream,
)
from kvferry.rpc import Heartbeat, service_names, set_serving, start_server
from kvferry.v1 import pool_pb2, pool_pb2_grpc

log = logging.getLogger(__name__)

NODE_ROLE = POOL_ROLE


@dataclass
class Peer:
    """One client's pair group. Its transfers run one at a time in the order of their tags (the client
    numbers them as it sends), however the gRPC threads that carry the requests get scheduled; that
    lets a client start its next transfer before the previous reply is back. Each waiting transfer
    has its own event, so finishing one wakes only the next (no thundering herd of handler threads)."""

    group: dist.ProcessGroup
    staging: Staging
    name: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_tag: int = 1
    waiting: dict[int, threading.Event] = field(default_factory=dict)
    closed: bool = False

    @contextlib.contextmanager
    def turn(self, tag: int, messages: int, timeout_s: float):
        with self.lock:
            ready = self.next_tag == tag
            event = None if ready else self.waiting.setdefault(tag, threading.Event())
        if event is not None and not event.wait(timeout_s):
            with self.lock:
                self.waiting.pop(tag, None)
            raise TimeoutError(f"transfer tag {tag} never came up (at {self.next_tag})")
        if self.closed:
            raise ConnectionError("the peer reconnected or failed")
        try:
            yield
        finally:
            with self.lock:
                self.next_tag = next_tag(tag, messages)
                woken = self.waiting.pop(self.next_tag, None)
            if woken is not None:
                woken.set()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            waiting, self.waiting = list(self.waiting.values()), {}
        for event in waiting:
            event.set()


@dataclass(frozen=True)
class PoolNodeConfig:
    node_id: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    store_port: int = 0
    num_slots: int = 1024
    device: str = "cpu"
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "default"
    heartbeat_s: float = 1.0
    ttl_s: float = 5.0
    # a request's private tail block that nobody reads or releases (its router died between the prefill
    # and the decode) is freed this long after it was written; a decode that pulls later recomputes it
    private_ttl_s: float = 20.0
    assemble_timeout_s: float = 30.0  # how long a block waits for the other ranks' KV-head slices
    transfer_timeout_s: float = 10.0


def _proto(loc: Location) -> pool_pb2.BlockLocation:
    return pool_pb2.BlockLocation(key=loc.key, node_id=loc.node_id, slot=loc.slot, generation=loc.generation)


class PoolNode(pool_pb2_grpc.KVPoolServicer):
    def __init__(self, cfg: PoolNodeConfig, layout: BlockLayout):
        self.cfg = cfg
        self.node_id = cfg.node_id or f"pool-{uuid.uuid4().hex[:8]}"
        self.layout = layout
        self.device = torch.device(cfg.device)
        self.slab = torch.zeros((cfg.num_slots, *layout.shape), dtype=layout.torch_dtype, device=self.device)
        self.table = SlotTable(
            cfg.num_slots,
            layout.num_kv_heads,
            self.node_id,
            private_ttl_s=cfg.private_ttl_s,
            assemble_timeout_s=cfg.assemble_timeout_s,
        )
        self.lock = threading.Lock()  # guards self.table and self.peers
        self.assembled = threading.Condition(self.lock)  # a block got its last KV-head slice, or was freed
        self.peers: dict[str, Peer] = {}
        self.meta = MetadataStore(cfg.redis_url, cfg.namespace)
        self.store = host_store(cfg.host, cfg.store_port, None)  # listening on the node's host only
        self._redis_id: str | None = None
        self._registrations = 0  # meta.fresh_registrations as of the last check
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # metadata writes, done by _publisher
        threading.Thread(target=self._publisher, name="publisher", daemon=True).start()

    def _publisher(self) -> None:
        while True:
            items = [self.outbox.get()]
            while not self.outbox.empty():
                items.append(self.outbox.get())
            # in order, a run of same-kind writes at a time: an eviction's unpublish must not land
            # after the publish of the key's newer copy, nor before its older one
            for kind, group in itertools.groupby(items, key=lambda item: item[0]):
                if kind == "unpublish":
                    self.meta.unpublish([loc for _, loc in group])
                else:
                    self.meta.publish([loc for _, batch in group for loc in batch])

    # -- gRPC ----------------------------------------------------------------------------------------
    def Connect(self, request, context):
        if request.backend == "nccl" and self.device.type != "cuda":
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"pool node {self.node_id} keeps blocks on CPU"
            )
        try:
            group = make_pair_group(
                self.store,
                request.group_name,
                0,
                request.backend or "gloo",
                self.cfg.host,
                self.cfg.transfer_timeout_s,
            )
        except Exception as err:  # the peer never joined, or the backend failed
            context.abort(grpc.StatusCode.UNAVAILABLE, f"pair group {request.group_name!r} failed: {err}")
        with self.lock:
            old = self.peers.get(request.peer_id)
            self.peers[request.peer_id] = Peer(
                group, Staging(self.slab.dtype, self.device), request.group_name
            )
        if old is not None:
            self._drop_peer(request.peer_id, old)
        log.info("connected peer %s (%s)", request.peer_id, request.backend or "gloo")
        return pool_pb2.ConnectResponse()

    def _peer(self, request, context) -> Peer:
        peer = self.peers.get(request.peer_id)
        if peer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"peer {request.peer_id!r} has not connected")
        if request.group_name and request.group_name != peer.name:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"pair group {request.group_name!r} is gone")
        return peer

    def _heads(self, request, context) -> tuple[int, int]:
        begin, end = request.head_begin, request.head_end or self.layout.num_kv_heads
        try:
            self.layout.check_heads(begin, end)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return begin, end

    def Put(self, request, context):
        peer = self._peer(request, context)
        head_begin, head_end = self._heads(request, context)
        keys = [block.key for block in request.blocks]
        with self.lock:
            plan = self.table.begin_write(
                request.request_id, keys, [block.private for block in request.blocks]
            )
        for loc in plan.evicted:
            self.outbox.put(("unpublish", loc))
        n = len(keys)
        rows = plan.rows
        full = head_begin == 0 and head_end == self.layout.num_kv_heads
        slot_ids = [plan.slots[i] for i in rows]
        direct = full and len(rows) == n and len(runs(slot_ids)) == 1  # one slab range: receive in place
        chunks = chunk_plan(n, request.chunk_blocks or n or 1)
        dest_slab = self.slab[:, :, :, head_begin:head_end]
        row_slot = {row: plan.slots[row] for row in rows}

        def dest(i: int, first: int, count: int) -> torch.Tensor:
            if direct:
                return self.slab[slot_ids[0] + first : slot_ids[0] + first + count]
            return peer.staging.view(self.layout.slice_shape(count, head_begin, head_end), i)

        def land(i: int, first: int, count: int, data: torch.Tensor) -> None:
            keep = [r for r in range(first, first + count) if r in row_slot]  # duplicates are dropped
            for pos, slot0, length in runs([row_slot[r] for r in keep]):
                r0 = keep[pos] - first
                dest_slab[slot0 : slot0 + length].copy_(data[r0 : r0 + length])

        try:
            with peer.turn(request.tag, len(chunks), self.cfg.transfer_timeout_s):
                recv_stream(peer.group, 1, request.tag + 1, chunks, dest, None if direct else land)
        except Exception as err:
            self._drop_peer(request.peer_id, peer)
            with self.lock:
                if self.table.abort_write(plan):
                    self.assembled.notify_all()  # a put waiting for a freed slot's other slices stops
            context.abort(grpc.StatusCode.UNAVAILABLE, f"receiving {n} blocks failed: {err}")
        with self.lock:
            publish, assembled = self.table.finish_write(plan, head_begin, head_end)
            if assembled:
                self.assembled.notify_all()
            # a block is usable only once every KV head is in: a tensor-parallel writer's reply waits
            # for the other ranks' slices, so whoever answers with these locations can trust them
            deadline = time.monotonic() + self.cfg.assemble_timeout_s
            while self.table.pending(plan):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.assembled.wait(left)
            found = self.table.locations_for(plan)
        reply = pool_pb2.PutResponse(
            locations=[
                pool_pb2.BlockLocation(key=key) if loc is None else _proto(loc)
                for key, loc in zip(keys, found, strict=True)
            ]
        )
        if publish:
            self.outbox.put(("publish", publish))  # off the transfer path; a reader never needs it sooner
        return reply

    def Get(self, request, context):
        peer = self._peer(request, context)
        head_begin, head_end = self._heads(request, context)
        with self.lock:
            slot_ids, stale = self.table.lease(request.request_id, request.blocks)
            if stale is not None:  # drop the stale entry
                self.outbox.put(("unpublish", stale))
        try:
            n = len(slot_ids)
            header = torch.tensor([n], dtype=torch.int64, device=self.device)
            direct = head_begin == 0 and head_end == self.layout.num_kv_heads and len(runs(slot_ids)) == 1
            src = self.slab[:, :, :, head_begin:head_end]

            def chunk(i: int, first: int, count: int) -> torch.Tensor:
                if direct:  # one slab range: send in place
                    return self.slab[slot_ids[0] + first : slot_ids[0] + first + count]
                data = peer.staging.view(self.layout.slice_shape(count, head_begin, head_end), i)
                for pos, slot0, length in runs(slot_ids[first : first + count]):
                    data[pos : pos + length].copy_(src[slot0 : slot0 + length])
                return data

            chunk_blocks = request.chunk_blocks or len(request.blocks) or 1
            budget = len(chunk_plan(len(request.blocks), chunk_blocks))  # tags the client set aside
            try:
                with peer.turn(request.tag, budget, self.cfg.transfer_timeout_s):
                    send(peer.group, header, 1, request.tag)
                    send_stream(peer.group, 1, request.tag + 1, chunk_plan(n, chunk_blocks), chunk)
            except Exception as err:
                self._drop_peer(request.peer_id, peer)
                context.abort(grpc.StatusCode.UNAVAILABLE, f"sending {n} blocks failed: {err}")
        finally:
            with self.lock:
                whole = head_end - head_begin == self.layout.num_kv_heads
                self.table.end_lease(request.request_id, slot_ids, whole)
        return pool_pb2.GetResponse(num_served=len(slot_ids))

    def Release(self, request, context):
        with self.lock:
            released = self.table.release(request.request_id)
            if released:
                self.assembled.notify_all()  # a put waiting for a freed slot's other slices stops
        return pool_pb2.ReleaseResponse(released=released)

    def GetStats(self, request, context):
        with self.lock:
            stats = self.table.stats()
        return pool_pb2.PoolStats(
            node_id=self.node_id,
            num_slots=stats["num_slots"],
            used_slots=stats["used_slots"],
            published=stats["published"],
            private_blocks=stats["private_blocks"],
            leases=stats["leases"],
            blocks_in=stats["blocks_in"],
            blocks_out=stats["blocks_out"],
            evictions=stats["evictions"],
            stale_gets=stats["stale_gets"],
            block_shape=list(self.layout.shape),
            dtype=self.layout.dtype,
        )

    # -- housekeeping ----------------------------------------------------------------------------------
    def _drop_peer(self, peer_id: str, peer: Peer) -> None:
        with self.lock:
            if self.peers.get(peer_id) is peer:
                del self.peers[peer_id]
        peer.close()

    def check_redis(self) -> None:
        """Republish every complete block when Redis comes back empty (restarted, or a new server), or
        when this node's registry record had lapsed (a reader then drops its entries as a dead node's)."""
        server = self.meta.server_id()
        if server is None:
            return
        fresh, self._registrations = self._registrations, self.meta.fresh_registrations
        if self._redis_id is None:  # the first check: the node's first registration, nothing to redo
            self._redis_id = server
            return
        restarted, lapsed = server != self._redis_id, fresh < self._registrations
        self._redis_id = server
        if restarted or lapsed:
            with self.lock:
                held = self.table.published_locations()
            why = f"redis restarted (run id {server})" if restarted else "the registry record had lapsed"
            log.warning("%s: republishing %d blocks", why, len(held))
            self.outbox.put(("publish", held))

    def expire_private(self) -> None:
        """The heartbeat's sweep: private blocks past their TTL, blocks whose other slices never came."""
        with self.lock:
            if self.table.expire():
                self.assembled.notify_all()

    def info(self) -> dict:
        with self.lock:
            free_slots = self.table.available()
        return {
            "addr": f"{self.cfg.host}:{self.port}",
            "store": f"{self.cfg.host}:{self.store.port}",
            "device": self.device.type,
            "layout": self.layout.to_list(),
            "num_slots": self.table.num_slots,
            "free_slots": free_slots,
        }

    def serve(self, stop: threading.Event) -> None:
        names = service_names(pool_pb2.DESCRIPTOR)
        server, self.port, health = start_server(
            lambda s: pool_pb2_grpc.add_KVPoolServicer_to_server(self, s),
            names,
            self.cfg.host,
            self.cfg.port,
            32,
        )
        heartbeat = Heartbeat(
            self.meta, NODE_ROLE, self.node_id, self.info, self.cfg.heartbeat_s, self.cfg.ttl_s
        )
        heartbeat.extra += [self.expire_private, self.check_redis]
        heartbeat.beat()
        heartbeat.start()
        set_serving(health, names)
        log.info(
            "pool node %s serving on %s:%d (%d slots)",
            self.node_id,
            self.cfg.host,
            self.port,
            self.table.num_slots,
        )
        stop.wait()
        set_serving(health, names, False)
        heartbeat.stop()
        server.stop(grace=2).wait()
