"""A pool node: the gRPC servicer (control) and pair groups (data) around a slab of block slots.

`PoolNode` owns the slab tensor, the peers' pair groups and the Redis metadata writes; which slot
holds what, and every rule about slot states, generations, leases, reservations, eviction and expiry,
is the `SlotTable` in `slots.py`, which the node calls under its one lock. Here:
- `Peer`: one client's pair group and the thread that serves it: it keeps a receive posted for the
  client's next transfer header and runs the transfers in order (`dataplane.py`: a PUT lands its
  blocks, a GET leases and sends them), with no RPC per transfer.
- `PoolNode`: Connect / Reserve / Consumed / Release / GetStats. A put (a PUT header, or a same-host
  client's COMMIT of blocks it wrote into the shared slab) takes the slots its client reserved,
  completes them and answers only once every KV-head slice of its blocks is in (the other TP ranks'
  puts): until then it waits in `awaiting`, answered by whichever event makes it whole (`_wake`), no
  thread blocked on it (the peer's next transfers go on meanwhile); a GET
  leases its slots while it sends. Publishing and unpublishing in Redis happen on a background thread
  (`_publisher`), in order; the heartbeat also runs the expiry sweep (private blocks, unassembled
  blocks, lapsed reservations) and republishes every complete block when Redis comes back empty, or
  when the node's own registry record had lapsed (readers drop the entries of a node missing from it).
- With `disk_dir`, a disk tier (`disk.py`): every published block evicted from the slab is spilled to
  it (copied under the lock that evicted it, so before anyone can write the slot again) and published
  as a `d:` entry (`metadata.DISK_SLOT`). `Restore` brings a get's leading disk blocks back into free
  slots under fresh generations (a copy already in memory is reused; a restore counts in `blocks_in`)
  and publishes them; the client then reads them as any others, over the pair group or the shared slab.
  The files outlive the process: a restarted node publishes them again, after deleting the memory
  entries of those keys that still name it (the previous process's slab).
- On CPU the slab is a /dev/shm file (`shm.py`) advertised in the registry record, so clients on this
  host move KV by memcpy; it is unlinked when the node stops.
- `transfer_timeout_s` bounds every wait on a peer within a transfer (its pair group's sends and
  receives): a client that died or hangs mid-transfer costs its peer thread that long at most. Between
  transfers the peer thread waits for the next header until the client's connection breaks.
The command line (`python -m kvferry.kvpool`) is in `__main__.py`.
"""

from __future__ import annotations

import concurrent.futures
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

from kvferry.kvpool.client import PoolClient
from kvferry.kvpool.config import PoolConfig
from kvferry.kvpool.dataplane import (
    COMMIT,
    GET,
    IDLE,
    Header,
    answer_tag,
    encode_answer,
    header_buffer,
)
from kvferry.kvpool.disk import DiskTier, copy_block
from kvferry.kvpool.hot import HotBlocks, replicator
from kvferry.kvpool.metadata import DISK_SLOT, POOL_ROLE, Location, MetadataStore
from kvferry.kvpool.shm import Mirror, SharedSlab, shm_host
from kvferry.kvpool.slots import PutPlan, SlotState, SlotTable
from kvferry.kvpool.transfer import (
    BlockLayout,
    Staging,
    check_interface,
    chunk_plan,
    make_pair_group,
    next_tag,
    recv_stream,
    runs,
    send_stream,
)
from kvferry.rpc import Heartbeat, service_names, set_serving, start_server
from kvferry.v1 import pool_pb2, pool_pb2_grpc

log = logging.getLogger(__name__)

NODE_ROLE = POOL_ROLE
SPILL_STAGING_BYTES = 256 * 2**20  # the most a disk tier's staging buffers (blocks on their way to disk) hold


@dataclass
class Peer:
    """One client's pair group; `closed` once it failed or the client connected again."""

    peer_id: str
    group: dist.ProcessGroup
    staging: Staging
    name: str = ""
    store: dist.Store | None = None  # its rendezvous: kept while the group lives (a lazy NCCL init reads it)
    closed: bool = False
    answered: int = 0  # put answers sent: the next goes on answer_tag(answered)
    answer_lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Awaiting:
    """A put whose answer waits for its blocks' other KV-head slices (until `deadline`)."""

    peer: Peer
    plan: PutPlan
    tag: int
    deadline: float


class PoolNode(pool_pb2_grpc.KVPoolServicer):
    def __init__(self, cfg: PoolConfig, layout: BlockLayout):
        check_interface(cfg.data_interface)
        cfg = cfg.for_layout(layout.block_bytes)
        self.cfg = cfg
        self.node_id = cfg.node_id or f"pool-{uuid.uuid4().hex[:8]}"
        self.layout = layout
        self.device = torch.device(cfg.device)
        self.shm = self._shared_slab()
        if self.shm is not None:
            self.slab = self.shm.slab
        else:
            shape = (cfg.num_slots, *layout.shape)
            self.slab = torch.zeros(shape, dtype=layout.torch_dtype, device=self.device)
        self.table = SlotTable(
            cfg.num_slots,
            layout.num_kv_heads,
            self.node_id,
            num_layers=layout.num_layers,
            private_ttl_s=cfg.private_ttl_s,
            assemble_timeout_s=cfg.assemble_timeout_s,
            reserve_ttl_s=cfg.reserve_ttl_s,
            on_change=None if self.shm is None else Mirror(self.shm.meta),
        )
        self.lock = threading.Lock()  # guards self.table and self.peers
        self.assembled = threading.Condition(self.lock)  # a block got its last KV-head slice, or was freed
        self.peers: dict[str, Peer] = {}
        self.awaiting: list[Awaiting] = []  # puts to answer once whole (under the lock)
        # sends the put answers: a peer's answer never waits on the thread that completed its block
        self.answers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="put-answer")
        self.meta = MetadataStore(cfg.redis_url, cfg.namespace)
        self._redis_id: str | None = None
        self._registrations = 0  # meta.fresh_registrations as of the last check
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # metadata writes, done by _publisher
        threading.Thread(target=self._publisher, name="publisher", daemon=True).start()
        self.hot = HotBlocks(cfg.hot_reads, cfg.hot_window_s, cfg.hot_replicas)
        self.disk: DiskTier | None = None
        if cfg.disk_dir:
            # one Reserve (or a put's eviction) may push out a client's whole batch at once: stage that
            # many spills (allocated as needed, within SPILL_STAGING_BYTES) instead of dropping them
            depth = min(cfg.max_reserve, cfg.num_slots // 8, SPILL_STAGING_BYTES // layout.block_bytes)
            self.disk = DiskTier(
                cfg.disk_dir,
                int(cfg.disk_max_gib * 2**30),
                layout,
                self.node_id,
                queue_depth=max(8, depth),
                on_stored=lambda key, gen: self.outbox.put(("publish", [self._on_disk(key, gen)])),
                on_dropped=lambda key, gen: self.outbox.put(("unpublish", self._on_disk(key, gen))),
            )

    def _on_disk(self, key: bytes, generation: int) -> Location:
        return Location(key, self.node_id, DISK_SLOT, generation)

    def _shared_slab(self) -> SharedSlab | None:
        if not self.cfg.shm or self.device.type != "cpu":
            return None
        try:
            return SharedSlab.create(self.layout, self.cfg.num_slots, uuid.uuid4().hex[:8])
        except OSError as err:  # no /dev/shm, or too small: same-host clients use the pair group
            log.warning("no shared-memory slab (%s): same-host clients use the pair group", err)
            return None

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
            store = self.meta.rendezvous(request.group_name, self.cfg.transfer_timeout_s)
            group = make_pair_group(
                store,
                request.group_name,
                0,
                request.backend or "gloo",
                self.cfg.host,
                self.cfg.transfer_timeout_s,
                self.cfg.data_interface,
            )
        except Exception as err:  # the peer never joined, or the backend failed
            context.abort(grpc.StatusCode.UNAVAILABLE, f"pair group {request.group_name!r} failed: {err}")
        peer = Peer(request.peer_id, group, Staging(self.slab.dtype, self.device), request.group_name, store)
        with self.lock:
            old = self.peers.get(request.peer_id)
            self.peers[request.peer_id] = peer
        if old is not None:
            self._drop_peer(old)
        threading.Thread(
            target=self._serve_peer, args=(peer,), name=f"peer-{peer.peer_id}", daemon=True
        ).start()
        log.info("connected peer %s (%s)", request.peer_id, request.backend or "gloo")
        return pool_pb2.ConnectResponse()

    def Reserve(self, request, context):
        count = min(request.count, self.cfg.max_reserve)
        with self.lock:
            slots, evicted = self.table.reserve(request.peer_id, count)
            self._evicted(evicted)
        return pool_pb2.ReserveResponse(
            slots=[s for s, _ in slots], generations=[g for _, g in slots], ttl_s=self.cfg.reserve_ttl_s
        )

    def Consumed(self, request, context):
        with self.lock:
            released = self.table.consumed(request.blocks)
            if released:
                self._wake()
        return pool_pb2.ReleaseResponse(released=released)

    def Release(self, request, context):
        with self.lock:
            released = self.table.release(request.request_id)
            if released:
                self._wake()  # a put waiting for a freed slot's other slices stops
        return pool_pb2.ReleaseResponse(released=released)

    def _wake(self) -> None:
        """Under the lock: a block was assembled or freed. Wake the restores waiting on one, and answer
        the puts that no longer wait for another rank's slice (or waited past the assemble timeout)."""
        self.assembled.notify_all()
        now = time.monotonic()
        for waiting in list(self.awaiting):
            if now >= waiting.deadline or not self.table.pending(waiting.plan):
                self.awaiting.remove(waiting)
                self._send_answer(waiting)

    def _send_answer(self, waiting: Awaiting) -> None:
        """Under the lock: answer a put where its blocks are (None: not stored or never completed), off
        this thread (a hung peer must not hold the lock's holder)."""
        found = self.table.locations_for(waiting.plan)
        locations = [Location(b"", "", 0, 0) if loc is None else loc for loc in found]
        self.answers.submit(self._post_answer, waiting.peer, waiting.tag, locations)

    def _post_answer(self, peer: Peer, tag: int, locations: list[Location]) -> None:
        with peer.answer_lock:  # answers go out in the order of their tags on the answer stream
            sent = peer.group.send([encode_answer(tag, locations)], 1, answer_tag(peer.answered))
            peer.answered += 1
        try:
            sent.wait()
        except Exception as err:
            log.warning("answering peer %s failed: %s", peer.peer_id, err)
            self._drop_peer(peer)

    # -- the pair-group data plane ---------------------------------------------------------------------
    def _serve_peer(self, peer: Peer) -> None:
        """The peer's transfers, in tag order. The next header's receive is posted as soon as the
        current header is read, so the client's next transfer never waits for a round trip."""
        bufs, tag = [header_buffer(), header_buffer()], 1
        work = peer.group.recv([bufs[0]], 1, tag)
        for i in itertools.count():
            try:
                work.wait(IDLE)
                header = Header.decode(bufs[i % 2])
                self.layout.check_heads(
                    header.head_begin, header.head_end, header.layer_begin, header.layer_end
                )
                following = next_tag(tag, header.messages)
                work = peer.group.recv([bufs[(i + 1) % 2]], 1, following)
                if header.op == GET:
                    self._send_blocks(peer, header, tag)
                elif header.op == COMMIT:
                    self._commit_blocks(peer, header, tag)
                else:
                    self._land_blocks(peer, header, tag)
            except Exception as err:  # the peer died, hangs, or sent garbage: its group is unusable
                if not peer.closed:
                    log.warning("pair group of peer %s failed: %s", peer.peer_id, err)
                self._drop_peer(peer)
                return
            tag = following

    def _land_blocks(self, peer: Peer, h: Header, tag: int) -> None:
        named = [None if s < 0 else (s, g) for s, g in zip(h.slots, h.generations, strict=True)]
        with self.lock:
            plan = self.table.begin_write(h.request_id, h.keys, h.private, owner=peer.peer_id, named=named)
            self._evicted(plan.evicted)
        n, rows = len(h.keys), plan.rows
        hb, he, lb, le = h.head_begin, h.head_end, h.layer_begin, h.layer_end or self.layout.num_layers
        full = self.layout.whole(hb, he, lb, le)
        slot_ids = [plan.slots[i] for i in rows]
        direct = full and len(rows) == n and len(runs(slot_ids)) == 1  # one slab range: receive in place
        dest_slab = self.slab[:, lb:le, :, hb:he]
        row_slot = {row: plan.slots[row] for row in rows}

        def dest(i: int, first: int, count: int) -> torch.Tensor:
            if direct:
                return self.slab[slot_ids[0] + first : slot_ids[0] + first + count]
            return peer.staging.view(self.layout.slice_shape(count, hb, he, lb, le), i)

        def land(i: int, first: int, count: int, data: torch.Tensor) -> None:
            keep = [r for r in range(first, first + count) if r in row_slot]  # duplicates are dropped
            start = 0
            for j in range(1, len(keep) + 1):  # one copy per run consecutive in rows AND in slots
                if (
                    j < len(keep)
                    and keep[j] == keep[j - 1] + 1
                    and row_slot[keep[j]] == row_slot[keep[j - 1]] + 1
                ):
                    continue
                r0, slot0 = keep[start] - first, row_slot[keep[start]]
                dest_slab[slot0 : slot0 + j - start].copy_(data[r0 : r0 + j - start])
                start = j

        try:
            recv_stream(peer.group, 1, tag + 2, chunk_plan(n, h.chunk_blocks), dest, None if direct else land)
        except Exception:
            with self.lock:
                if self.table.abort_write(plan):
                    self._wake()  # a put waiting for a freed slot's other slices stops
            raise

        self._answer(peer, plan, h, tag)

    def _commit_blocks(self, peer: Peer, h: Header, tag: int) -> None:
        """A same-host put: the bytes are in the named slots already; only blocks whose slot is still
        the client's reservation are stored (a lapsed one may hold someone else's block now)."""
        if self.shm is None:
            raise ValueError("a COMMIT to a node without a shared slab")
        hb, he, lb, le = h.head_begin, h.head_end, h.layer_begin, h.layer_end or self.layout.num_layers
        named = [(s, g) for s, g in zip(h.slots, h.generations, strict=True)]
        with self.lock:
            plan = self.table.begin_write(
                h.request_id, h.keys, h.private, owner=peer.peer_id, named=named, allocate=False
            )
            # a block that joined another writer's slot (a TP rank's slice came first) moves there
            for src, dst in zip(plan.sources, plan.slots, strict=True):
                if src is not None and dst is not None and src != dst:
                    self.slab[dst, lb:le, :, hb:he] = self.slab[src, lb:le, :, hb:he]
            self._evicted(plan.evicted)  # none: a commit takes only its reserved slots
        self._answer(peer, plan, h, tag)

    def _answer(self, peer: Peer, plan: PutPlan, h: Header, tag: int) -> None:
        """Complete the put's slice (publishing the blocks it completed) and answer it on the peer's
        answer stream: now, or, while a block waits for other ranks' slices, once `_wake` finds it
        whole (or past `assemble_timeout_s`), so whoever answers with these locations can trust them.
        No thread waits meanwhile: the peer's next transfers go on."""
        waiting = Awaiting(peer, plan, tag, time.monotonic() + self.cfg.assemble_timeout_s)
        with self.lock:
            publish, assembled = self.table.finish_write(
                plan, h.head_begin, h.head_end, h.layer_begin, h.layer_end or None
            )
            if self.table.pending(plan):
                self.awaiting.append(waiting)
            else:
                self._send_answer(waiting)
            if assembled:
                self._wake()
        if publish:
            self.outbox.put(("publish", publish))  # off the transfer path; a reader never needs it sooner

    def _send_blocks(self, peer: Peer, h: Header, tag: int) -> None:
        blocks = [
            Location(k, self.node_id, s, g) for k, s, g in zip(h.keys, h.slots, h.generations, strict=True)
        ]
        with self.lock:
            slot_ids, stale = self.table.lease(h.request_id, blocks)
        if stale is not None:  # drop the stale entry
            self.outbox.put(("unpublish", stale))
        head_begin, head_end = h.head_begin, h.head_end
        try:
            n = len(slot_ids)
            told = peer.group.send([torch.tensor([n], dtype=torch.int64)], 1, tag + 1)
            direct = head_begin == 0 and head_end == self.layout.num_kv_heads and len(runs(slot_ids)) == 1
            src = self.slab[:, :, :, head_begin:head_end]

            def chunk(i: int, first: int, count: int) -> torch.Tensor:
                if direct:  # one slab range: send in place
                    return self.slab[slot_ids[0] + first : slot_ids[0] + first + count]
                data = peer.staging.view(self.layout.slice_shape(count, head_begin, head_end), i)
                for pos, slot0, length in runs(slot_ids[first : first + count]):
                    data[pos : pos + length].copy_(src[slot0 : slot0 + length])
                return data

            send_stream(peer.group, 1, tag + 2, chunk_plan(n, h.chunk_blocks), chunk)
            told.wait()
            if head_begin == 0:  # one read per reader, however many KV-head slices it asks for
                self.hot.read(h.keys[:n])
        finally:
            with self.lock:
                whole = head_end - head_begin == self.layout.num_kv_heads
                self.table.end_lease(h.request_id, slot_ids, whole)

    # -- the disk tier ---------------------------------------------------------------------------------
    def _evicted(self, evicted: list[Location]) -> None:
        """Blocks just evicted from their slots: unpublish them, and spill them to the disk tier (a copy;
        at most the tier's `queue_depth` blocks, the rest are dropped at once). Called under the lock
        that evicted them, before it is let go: from then on another rank's put of the slot's new key
        may join it and land its slice there."""
        for loc in evicted:
            self.outbox.put(("unpublish", loc))
            if self.disk is not None:
                self.disk.spill(loc.key, self.slab[loc.slot])

    def Restore(self, request, context):
        """The leading blocks of a get that this node holds, its disk blocks restored into the slab
        (memory locations pass as they are: the get checks them); all within `transfer_timeout_s`."""
        deadline = time.monotonic() + self.cfg.transfer_timeout_s
        out = []
        for block in request.blocks:
            loc = Location(block.key, block.node_id, block.slot, block.generation)
            if loc.slot == DISK_SLOT:
                if self.disk is None or loc.node_id != self.node_id:
                    break
                loc = self._restore(loc, deadline)
                if loc is None:
                    break
            out.append(
                pool_pb2.BlockLocation(
                    key=loc.key, node_id=loc.node_id, slot=loc.slot, generation=loc.generation
                )
            )
        return pool_pb2.RestoreResponse(blocks=out)

    def _restore(self, loc: Location, deadline: float) -> Location | None:
        """Where block `loc` (on this node's disk) is in the slab: its copy there, if one is complete
        (waiting, bounded, for one being written: another TP rank's restore of it), else a free or
        evicted slot it is loaded into; None on a miss (its `d:` entry is dropped)."""
        with self.lock:
            while (slot := self.table.existing(loc.key)) is not None and slot.state == SlotState.WRITING:
                if not self.assembled.wait(max(0.0, deadline - time.monotonic())):
                    return None
            if slot is not None:  # PUBLISHED
                return self.table.location(slot)
            plan = self.table.begin_write("", [loc.key])
            self._evicted(plan.evicted)
        if plan.slots[0] is None:  # every slot is pinned
            return None
        loaded = self._load(loc.key, plan.slots[0])
        with self.lock:
            if loaded:
                publish, _ = self.table.finish_write(plan)
                found = self.table.locations_for(plan)[0]
            else:
                self.table.abort_write(plan)
                found = None
            self._wake()  # restores of the same key waiting on this one
        if loaded:
            self.outbox.put(("publish", publish))
        else:  # compare-and-delete: a newer file of the key keeps its entry
            self.outbox.put(("unpublish", loc))
        return found

    def _load(self, key: bytes, slot: int) -> bool:
        """Read the block's file, and only once it checked out copy it into the slot: a put of the same
        key (another rank's slice) may join the slot meanwhile, and must never find a bad file's bytes."""
        block = self.disk.load(key)
        if block is not None:
            copy_block(self.slab[slot], block)
        return block is not None

    def _copy_out(self, keys: list[bytes]) -> dict[bytes, torch.Tensor]:
        """The published blocks of `keys` this node holds, copied out (for the hot-block replicator)."""
        out = {}
        with self.lock:
            for key in keys:
                slot = self.table.existing(key)
                if slot is not None and slot.state == SlotState.PUBLISHED:
                    out[key] = self.slab[slot.index].clone()
        return out

    def _disk_locations(self) -> list[Location]:
        return [] if self.disk is None else [self._on_disk(k, g) for k, g in self.disk.entries()]

    def GetStats(self, request, context):
        with self.lock:
            stats = self.table.stats()
        disk = {} if self.disk is None else self.disk.stats()
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
            reserved=stats["reserved"],
            disk_files=disk.get("files", 0),
            disk_bytes=disk.get("bytes_used", 0),
            disk_hits=disk.get("disk_hits", 0),
            disk_misses=disk.get("disk_misses", 0),
            disk_spills=disk.get("spills", 0),
            disk_spill_drops=disk.get("spill_drops", 0),
            disk_corrupt=disk.get("corrupt", 0),
            disk_evictions=disk.get("evictions", 0),
            hot_copies=self.hot.copied,
            hot_copy_failures=self.hot.failed,
            block_shape=list(self.layout.shape),
            dtype=self.layout.dtype,
        )

    # -- housekeeping ----------------------------------------------------------------------------------
    def _drop_peer(self, peer: Peer) -> None:
        with self.lock:
            if self.peers.get(peer.peer_id) is peer:
                del self.peers[peer.peer_id]
        peer.closed = True

    def check_redis(self) -> None:
        """Republish every complete block (and disk block) when Redis comes back empty (restarted, or a
        new server), or when this node's registry record had lapsed (a reader then drops its entries as a
        dead node's). The first check publishes the disk tier's blocks (kept from a previous run), after
        deleting the memory entries of those keys that name this node (the previous run's slab)."""
        server = self.meta.server_id()
        if server is None:
            return
        fresh, self._registrations = self._registrations, self.meta.fresh_registrations
        if self._redis_id is None:  # the first check: the node's first registration
            self._redis_id = server
            held = self._disk_locations()
            if held:
                self.meta.forget_node_blocks([loc.key for loc in held], self.node_id)
                log.info("publishing %d blocks of the disk tier", len(held))
                self.outbox.put(("publish", held))
            return
        restarted, lapsed = server != self._redis_id, fresh < self._registrations
        self._redis_id = server
        if restarted or lapsed:
            with self.lock:
                held = self.table.published_locations()
            held += self._disk_locations()
            why = f"redis restarted (run id {server})" if restarted else "the registry record had lapsed"
            log.warning("%s: republishing %d blocks", why, len(held))
            self.outbox.put(("publish", held))

    def expire_private(self) -> None:
        """The heartbeat's sweep: private blocks past their TTL, blocks whose other slices never came,
        reservations their client stopped using."""
        with self.lock:
            self.table.expire()
            self._wake()  # also answers the puts waiting past the assemble timeout

    def info(self) -> dict:
        with self.lock:
            free_slots = self.table.available()
        shm = {} if self.shm is None else {"shm": str(self.shm.path), "shm_host": shm_host()}
        return {
            **shm,
            "addr": f"{self.cfg.host}:{self.port}",
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
        if self.hot.enabled:  # its client copies hot blocks to the other nodes
            client = PoolClient(
                self.meta,
                self.layout,
                peer_id=f"{self.node_id}-hot",
                host=self.cfg.host,
                device=self.cfg.device,
                transfer_timeout_s=self.cfg.transfer_timeout_s,
                reserve_blocks=16,
                data_interface=self.cfg.data_interface,
            )
            threading.Thread(
                target=replicator,
                args=(self.hot, client, self.node_id, self._copy_out, stop),
                name="hot-replicator",
                daemon=True,
            ).start()
        set_serving(health, names)
        log.info(
            "pool node %s serving on %s:%d (%d slots)",
            self.node_id,
            self.cfg.host,
            self.port,
            self.table.num_slots,
        )
        try:
            stop.wait()
            set_serving(health, names, False)
            heartbeat.stop()
            server.stop(grace=2).wait()
        finally:
            if self.shm is not None:
                self.shm.unlink()  # mapped clients keep their view; nobody new can open it
            if self.disk is not None:
                self.disk.close()  # writes what is queued, releases the directory
