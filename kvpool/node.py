"""A pool node: a preallocated slab of block slots, served over gRPC (control) + pair groups (data).

Slot life: FREE -> WRITING (a put reserved it; not visible) -> PUBLISHED (complete: every KV head
written; its location is now in Redis) or PRIVATE (a request's tail block, never published) -> FREE.
A slot's generation rises each time it is reused, and a get names (slot, generation, key): a stale
location (the slot was evicted and reused) is refused, so lost or old metadata means a miss, never
wrong KV. Reads lease their slots for the duration of the transfer; eviction is LRU over published,
unleased slots. Private blocks are freed after their first get, on Release, or after `private_ttl_s`.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import itertools
import logging
import queue
import signal
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist

from kvferry.kvpool.metadata import Location, MetadataStore
from kvferry.kvpool.transfer import (
    BlockLayout,
    Staging,
    chunk_plan,
    make_pair_group,
    next_tag,
    recv_stream,
    runs,
    send,
    send_stream,
)
from kvferry.rpc import Heartbeat, hard_exit, service_names, set_serving, start_server
from kvferry.v1 import pool_pb2, pool_pb2_grpc

log = logging.getLogger(__name__)

NODE_ROLE = "pool"


class SlotState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    PUBLISHED = 2
    PRIVATE = 3


@dataclass(slots=True)
class Slot:
    index: int
    state: SlotState = SlotState.FREE
    key: bytes = b""
    generation: int = 0
    heads_written: int = 0  # bitmask of KV heads received so far (a TP put brings one slice per rank)
    writers: int = 0  # puts whose bytes are landing here now: the slot is neither freed nor evictable
    leases: int = 0
    request_id: str = ""  # owner of a private block
    expires: float = 0.0


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
    private_ttl_s: float = 120.0
    assemble_timeout_s: float = 30.0  # how long a block waits for the other ranks' KV-head slices
    transfer_timeout_s: float = 60.0


class PoolNode(pool_pb2_grpc.KVPoolServicer):
    def __init__(self, cfg: PoolNodeConfig, layout: BlockLayout):
        self.cfg = cfg
        self.node_id = cfg.node_id or f"pool-{uuid.uuid4().hex[:8]}"
        self.layout = layout
        self.device = torch.device(cfg.device)
        self.slab = torch.zeros((cfg.num_slots, *layout.shape), dtype=layout.torch_dtype, device=self.device)
        self.slots = [Slot(i) for i in range(cfg.num_slots)]
        self.free: deque[int] = deque(range(cfg.num_slots))
        self.lru: OrderedDict[int, None] = OrderedDict()  # published, unleased: eviction order
        self.index: dict[bytes, int] = {}  # shared key -> slot (WRITING or PUBLISHED)
        self.leases: Counter[str] = Counter()
        self.counters = Counter()
        self.lock = threading.Lock()
        self.assembled = threading.Condition(self.lock)  # a block got its last KV-head slice
        self.peers: dict[str, Peer] = {}
        self.meta = MetadataStore(cfg.redis_url, cfg.namespace)
        self.store = dist.TCPStore(cfg.host, cfg.store_port, is_master=True, wait_for_workers=False)
        self.all_heads = (1 << layout.num_kv_heads) - 1
        self._redis_id: str | None = None
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

    # -- slot bookkeeping (callers hold self.lock) -----------------------------------------------------
    def _allocate(self, evicted: list[Location]) -> Slot | None:
        if self.free:
            slot = self.slots[self.free.popleft()]
        elif self.lru:
            index, _ = self.lru.popitem(last=False)
            slot = self.slots[index]
            evicted.append(Location(slot.key, self.node_id, slot.index, slot.generation))
            self._evict(slot)
        else:
            return None
        slot.generation += 1
        return slot

    def _evict(self, slot: Slot) -> None:
        self.counters["evictions"] += 1
        self.index.pop(slot.key, None)
        slot.state, slot.key, slot.heads_written = SlotState.FREE, b"", 0

    def _release(self, slot: Slot) -> None:
        if slot.state in (SlotState.WRITING, SlotState.PUBLISHED) and self.index.get(slot.key) == slot.index:
            del self.index[slot.key]
        self.lru.pop(slot.index, None)
        slot.state, slot.key, slot.heads_written, slot.request_id, slot.leases = SlotState.FREE, b"", 0, "", 0
        self.free.append(slot.index)
        self.assembled.notify_all()  # a Put waiting for this slot's other slices stops waiting

    def _location(self, slot: Slot) -> pool_pb2.BlockLocation:
        return pool_pb2.BlockLocation(
            key=slot.key, node_id=self.node_id, slot=slot.index, generation=slot.generation
        )

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
        mask = ((1 << head_end) - 1) ^ ((1 << head_begin) - 1)
        targets: list[Slot | None] = []
        stale: list[Location] = []
        republish: list[Location] = []  # a writer found it missing in Redis: the entry was lost
        with self.lock:
            for block in request.blocks:
                # a key being written already (another rank's head slice of it) is joined, not re-made
                slot = self._existing(block.key)
                if slot is not None and block.private and slot.request_id != request.request_id:
                    slot = None  # never write into another request's private block
                if slot is not None and slot.state == SlotState.PUBLISHED:
                    targets.append(None)  # already complete here: drop the bytes on arrival
                    republish.append(Location(slot.key, self.node_id, slot.index, slot.generation))
                    continue
                if slot is None:
                    slot = self._allocate(stale)
                    if slot is not None:
                        slot.key = block.key
                        slot.state = SlotState.WRITING
                        slot.request_id = request.request_id if block.private else ""
                        self.index[block.key] = slot.index  # private keys: only while being written
                        slot.expires = time.monotonic() + self.cfg.private_ttl_s
                if slot is not None:
                    slot.writers += 1  # pinned (no release, no eviction) until this put is done
                targets.append(slot)
        for loc in stale:
            self.outbox.put(("unpublish", loc))
        n = len(request.blocks)
        rows = [i for i, slot in enumerate(targets) if slot is not None]
        full = head_begin == 0 and head_end == self.layout.num_kv_heads
        slot_ids = [targets[i].index for i in rows]
        direct = full and len(rows) == n and len(runs(slot_ids)) == 1  # one slab range: receive in place
        plan = chunk_plan(n, request.chunk_blocks or n or 1)
        dest_slab = self.slab[:, :, :, head_begin:head_end]
        row_slot = {row: targets[row].index for row in rows}

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
            with peer.turn(request.tag, len(plan), self.cfg.transfer_timeout_s):
                recv_stream(peer.group, 1, request.tag + 1, plan, dest, None if direct else land)
        except Exception as err:
            self._drop_peer(request.peer_id, peer)
            with self.lock:
                for slot in targets:
                    if slot is None:
                        continue
                    slot.writers -= 1
                    if slot.writers == 0 and slot.state == SlotState.WRITING:
                        self._release(slot)  # no complete copy can come of it now
                    elif slot.writers == 0 and slot.state == SlotState.PUBLISHED and slot.leases == 0:
                        self.lru[slot.index] = None
            context.abort(grpc.StatusCode.UNAVAILABLE, f"receiving {n} blocks failed: {err}")
        publish, reply = [], pool_pb2.PutResponse()
        gens = [None if slot is None else slot.generation for slot in targets]
        with self.lock:
            for block, slot in zip(request.blocks, targets, strict=True):
                if slot is None:
                    continue
                slot.writers -= 1
                slot.heads_written |= mask
                if slot.heads_written == self.all_heads and slot.state == SlotState.WRITING:
                    self.assembled.notify_all()
                    if block.private:
                        slot.state = SlotState.PRIVATE
                        slot.expires = time.monotonic() + self.cfg.private_ttl_s  # from completion
                        if self.index.get(slot.key) == slot.index:
                            del self.index[slot.key]
                    else:
                        slot.state = SlotState.PUBLISHED
                        publish.append(Location(slot.key, self.node_id, slot.index, slot.generation))
                if slot.state == SlotState.PUBLISHED and slot.writers == 0 and slot.leases == 0:
                    self.lru[slot.index] = None  # evictable only once nobody writes or reads it
                if slot.state == SlotState.WRITING and slot.writers == 0:
                    slot.expires = time.monotonic() + self.cfg.assemble_timeout_s  # the other slices'
            self.counters["blocks_in"] += len(rows)
            # a block is usable only once every KV head is in: a tensor-parallel writer's reply waits
            # for the other ranks' slices, so whoever answers with these locations can trust them
            deadline = time.monotonic() + self.cfg.assemble_timeout_s
            while any(
                slot is not None and slot.state == SlotState.WRITING and slot.generation == gen
                for slot, gen in zip(targets, gens, strict=True)
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.assembled.wait(left)
            for block, slot, gen in zip(request.blocks, targets, gens, strict=True):
                if slot is None:  # the key was complete here already
                    slot, gen = self._existing(block.key), None
                complete = (
                    slot is not None
                    and slot.state in (SlotState.PUBLISHED, SlotState.PRIVATE)
                    and slot.key == block.key
                    and gen in (None, slot.generation)
                )
                reply.locations.append(
                    self._location(slot) if complete else pool_pb2.BlockLocation(key=block.key)
                )
        publish += republish
        if publish:
            self.outbox.put(("publish", publish))  # off the transfer path; a reader never needs it sooner
        return reply

    def _existing(self, key: bytes) -> Slot | None:
        index = self.index.get(key)
        return None if index is None else self.slots[index]

    def Get(self, request, context):
        peer = self._peer(request, context)
        head_begin, head_end = self._heads(request, context)
        leased: list[Slot] = []
        with self.lock:
            for loc in request.blocks:
                slot = self.slots[loc.slot] if loc.slot < len(self.slots) else None
                if (
                    slot is None
                    or slot.key != loc.key
                    or slot.generation != loc.generation
                    or slot.state not in (SlotState.PUBLISHED, SlotState.PRIVATE)
                ):
                    self.counters["stale_gets"] += 1
                    if slot is not None and loc.node_id == self.node_id:  # drop the stale entry
                        self.outbox.put(
                            ("unpublish", Location(loc.key, loc.node_id, loc.slot, loc.generation))
                        )
                    break
                slot.leases += 1
                self.lru.pop(slot.index, None)
                leased.append(slot)
            self.leases[request.request_id] += len(leased)
        try:
            n = len(leased)
            header = torch.tensor([n], dtype=torch.int64, device=self.device)
            slot_ids = [s.index for s in leased]
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
                self.leases[request.request_id] -= len(leased)
                if self.leases[request.request_id] <= 0:
                    del self.leases[request.request_id]
                full = head_end - head_begin == self.layout.num_kv_heads
                for slot in leased:
                    slot.leases -= 1
                    if slot.state == SlotState.PRIVATE:
                        # a tail block serves one decode worker: gone after a whole read (readers of
                        # head slices leave it to Release / the TTL, not knowing who else needs it)
                        if full and slot.leases == 0 and slot.writers == 0:
                            self._release(slot)
                    elif slot.state == SlotState.PUBLISHED and slot.leases == 0 and slot.writers == 0:
                        self.lru[slot.index] = None
                        self.lru.move_to_end(slot.index)
                self.counters["blocks_out"] += len(leased)
        return pool_pb2.GetResponse(num_served=len(leased))

    def Release(self, request, context):
        released = 0
        with self.lock:
            for slot in self.slots:
                if (
                    slot.state in (SlotState.PRIVATE, SlotState.WRITING)
                    and slot.request_id == request.request_id
                    and slot.leases == 0
                    and slot.writers == 0
                ):
                    self._release(slot)
                    released += 1
        return pool_pb2.ReleaseResponse(released=released)

    def GetStats(self, request, context):
        with self.lock:
            states = Counter(s.state for s in self.slots)
            return pool_pb2.PoolStats(
                node_id=self.node_id,
                num_slots=len(self.slots),
                used_slots=len(self.slots) - len(self.free),
                published=states[SlotState.PUBLISHED],
                private_blocks=states[SlotState.PRIVATE],
                leases=dict(self.leases),
                blocks_in=self.counters["blocks_in"],
                blocks_out=self.counters["blocks_out"],
                evictions=self.counters["evictions"],
                stale_gets=self.counters["stale_gets"],
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
        """Republish every complete block when Redis comes back empty (restarted, or a new server)."""
        server = self.meta.server_id()
        if server is None or server == self._redis_id:
            return
        if self._redis_id is not None:
            with self.lock:
                held = [
                    Location(s.key, self.node_id, s.index, s.generation)
                    for s in self.slots
                    if s.state == SlotState.PUBLISHED
                ]
            log.warning("redis restarted (run id %s): republishing %d blocks", server, len(held))
            self.outbox.put(("publish", held))
        self._redis_id = server

    def expire_private(self) -> None:
        now = time.monotonic()
        with self.lock:
            for slot in self.slots:
                if (
                    (slot.request_id or slot.state == SlotState.WRITING)  # private, or never completed
                    and slot.state in (SlotState.PRIVATE, SlotState.WRITING)
                    and slot.leases == slot.writers == 0
                    and slot.expires < now
                ):
                    self._release(slot)

    def info(self) -> dict:
        return {
            "addr": f"{self.cfg.host}:{self.port}",
            "store": f"{self.cfg.host}:{self.store.port}",
            "device": self.device.type,
            "layout": self.layout.to_list(),
            "num_slots": len(self.slots),
            "free_slots": len(self.free) + len(self.lru),
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
            len(self.slots),
        )
        stop.wait()
        set_serving(health, names, False)
        heartbeat.stop()
        server.stop(grace=2).wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvferry.kvpool", description="run one KV pool node")
    p.add_argument("--node-id", default="")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--store-port", type=int, default=0)
    p.add_argument("--num-slots", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--namespace", default="default")
    p.add_argument("--layout", required=True, help="num_layers,num_kv_heads,block_size,head_dim,dtype")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pool %(levelname)s %(message)s")
    layout = BlockLayout.from_list(args.layout.split(","))
    cfg = PoolNodeConfig(
        node_id=args.node_id,
        host=args.host,
        port=args.port,
        store_port=args.store_port,
        num_slots=args.num_slots,
        device=args.device,
        redis_url=args.redis_url,
        namespace=args.namespace,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    PoolNode(cfg, layout).serve(stop)
    hard_exit(0)
