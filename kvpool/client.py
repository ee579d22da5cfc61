"""The pool client used by workers (put / get blocks) and the router (prefix lookup).

One `PoolClient` per process. It finds nodes in the Redis registry (caching what it learned, so a
Redis outage does not lose the addresses of nodes it already talks to) and moves KV without an RPC
per transfer:
- Puts name slots the client reserved ahead (`Reserve`: one control call per batch of
  `reserve_blocks`, a lease the node renews on every put and takes back when the client stops using it).
- To a node on this host that advertises its shared slab (`shm.py`; same boot id, the file opens), a
  put is one memcpy into the reserved slots and a COMMIT header on the pair group (answered
  asynchronously, as a put's), and a get is a lock-free memcpy out of the slab checked against the
  slot generations (no RPC, no socket; `Consumed` only for private blocks read whole). A client that
  cannot map the file, or `shm=False`, uses the pair group.
- A get that names blocks in a node's disk tier (`metadata.DISK_SLOT`) first asks that node to
  `Restore` them (one RPC per node per get): the answer names the slots they were loaded into, read
  then as any others (a same-host reader cannot load a file itself: it reads only the slab).
- Otherwise the pair group to the node (`dataplane.PairLink`: made the first time it is needed; gloo,
  CUDA ends included, as its headers are CPU tensors matched by tag) carries a tensor header and the
  data. Its transfers run in tag order on one thread per node, so a put returns once its data is handed over
  and the node's answer (the locations) resolves its future later.

No caller waits on a node longer than `transfer_timeout_s` (connecting, reserving, the pair group's
sends and receives, the answers, the wait for its turn): a node that died or hangs turns a get into a
miss (the caller recomputes) and a put into blocks not stored, and the pair group is dropped, to be made
again on the next use (a node that refused a connection is not tried again for `RETRY_S`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import grpc
import torch

from kvferry.kvpool.dataplane import MAX_BLOCKS, RETRY_S, TRANSFER_TIMEOUT_S, PairLink, PoolError, Put
from kvferry.kvpool.metadata import DISK_SLOT, POOL_ROLE, Location, MetadataStore
from kvferry.kvpool.shm import SharedSlab, shm_host
from kvferry.kvpool.transfer import BlockLayout, Staging, check_interface, runs, unpack_blocks
from kvferry.rpc import channel as rpc_channel
from kvferry.v1 import pool_pb2, pool_pb2_grpc

__all__ = ["PoolClient", "PoolError", "failed_future", "from_proto", "gather", "to_proto", "wait_for_nodes"]

log = logging.getLogger(__name__)

RESERVE_BLOCKS = 256  # slots reserved per Reserve call (at most a sixteenth of the node's slab)


@dataclass
class _Node:
    node_id: str
    channel: grpc.Channel
    stub: pool_pb2_grpc.KVPoolStub
    link: PairLink  # the pair group: used when the slab is not mapped
    num_slots: int
    shm: SharedSlab | None = None  # the node's slab, mapped: this client is on the node's host
    shm_path: str = ""  # the slab file last advertised (mapped, or failed to map)
    shm_staging: Staging | None = None  # for KV-head slices written through shm (under shm_lock)
    shm_lock: threading.Lock = field(default_factory=threading.Lock)
    # a get's blocks gathered from scattered slots in one copy (under shm_get_lock)
    shm_get_staging: Staging | None = None
    shm_get_lock: threading.Lock = field(default_factory=threading.Lock)
    # slots reserved for this client's puts, lowest first, usable until `reserved_until` (half the lease)
    reserve_lock: threading.Lock = field(default_factory=threading.Lock)
    reserved: list[tuple[int, int]] = field(default_factory=list)
    reserved_until: float = 0.0
    reserve_ttl_s: float = 0.0
    refilling: bool = False  # a background Reserve is on its way


def to_proto(loc: Location) -> pool_pb2.BlockLocation:
    """The location and its replicas (which have none of their own)."""
    return pool_pb2.BlockLocation(
        key=loc.key,
        node_id=loc.node_id,
        slot=loc.slot,
        generation=loc.generation,
        replicas=[to_proto(r) for r in loc.replicas],
    )


def from_proto(loc: pool_pb2.BlockLocation) -> Location:
    replicas = tuple(Location(r.key, r.node_id, r.slot, r.generation) for r in loc.replicas)
    return Location(loc.key, loc.node_id, loc.slot, loc.generation, replicas)


class PoolClient:
    def __init__(
        self,
        meta: MetadataStore,
        layout: BlockLayout,
        peer_id: str = "",
        host: str = "127.0.0.1",
        device: str = "cpu",
        transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
        shm: bool = True,
        reserve_blocks: int = RESERVE_BLOCKS,
        replicas: int = 1,
        data_interface: str = "",
    ):
        self.meta = meta
        check_interface(data_interface)
        self.data_interface = data_interface  # PoolConfig.data_interface: where the pair groups connect
        self.layout = layout
        self.peer_id = peer_id or f"peer-{uuid.uuid4().hex[:8]}"
        self.host = host
        self.device = torch.device(device)
        self.transfer_timeout_s = transfer_timeout_s
        self.use_shm = shm and self.device.type == "cpu"
        self.reserve_blocks = reserve_blocks
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.replicas = replicas  # copies of each block a put stores (on distinct nodes, as many as live)
        # background reservations: blocking calls off the caller's thread
        self._control = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-control")
        self._refreshing = False  # a background registry read is queued (pick_nodes(wait=False))
        self.nodes: dict[str, _Node] = {}
        self._known: dict[str, dict] = {}  # node id -> last registry record seen
        self._known_at = -1e9
        self._lock = threading.Lock()

    # -- discovery ------------------------------------------------------------------------------------
    def refresh(self, max_age_s: float = 0.0) -> dict[str, dict]:
        """Live nodes from the registry (the last known set while Redis is unreachable).

        `max_age_s` > 0 reuses a registry read younger than that (the hot path reads it per put).
        """
        now = time.monotonic()
        if max_age_s <= 0 or now - self._known_at > max_age_s:
            members = self.meta.members(POOL_ROLE)
            if members is not None:
                with self._lock:
                    self._known, self._known_at = members, now
                    nodes = list(self.nodes.values())
                for node in nodes:  # a node gone (or restarted) from this host: drop (or remap) its slab
                    self._remap(node, members.get(node.node_id))
        return dict(self._known)

    def _refresh_in_background(self) -> None:
        try:
            self.refresh(max_age_s=1.0)
        finally:
            self._refreshing = False

    def pick_nodes(self, count: int | None = None, wait: bool = True) -> list[str]:
        """The nodes a put's copies go to: `count` (default: `replicas`) distinct live nodes, or all
        there are when fewer. First this host's node (its slab mapped: the put is a memcpy and crosses
        no link; a reader elsewhere pulls it once) while it has at least half the free slots of the
        emptiest node, so one busy host's node does not evict while others stand empty; then the
        nodes with the most free slots. `wait=False` (on an engine thread): never wait on Redis; the
        registry as last read, refreshed in the background once over a second old."""
        if wait or not self._known:  # (never read, or no node known: read now)
            nodes = self.refresh(max_age_s=1.0)
        else:
            nodes = dict(self._known)
            if time.monotonic() - self._known_at > 1.0 and not self._refreshing:
                self._refreshing = True
                self._control.submit(self._refresh_in_background)
        if not nodes:
            raise PoolError("no KV pool node is registered")
        free = {n: nodes[n].get("free_slots", 0) for n in nodes}
        most = max(free.values())
        ranked = sorted(
            nodes, key=lambda n: (self.near(n) == 0 and 2 * free[n] >= most, free[n], n), reverse=True
        )
        return ranked[: count or self.replicas]

    def near(self, node_id: str) -> int:
        """How far a node is (`MetadataStore.lookup`'s `prefer`): 0 on this host with its slab mapped (a
        get is a memcpy; for a node not used yet: its record advertises a slab on this host), else 1."""
        node = self.nodes.get(node_id)
        if node is not None:
            return 0 if node.shm is not None else 1
        info = self._known.get(node_id, {})  # not talked to yet: what its record advertises
        return 0 if self.use_shm and info.get("shm") and info.get("shm_host") == shm_host() else 1

    def _node(self, node_id: str) -> _Node:
        with self._lock:
            node = self.nodes.get(node_id)
            if node is not None:
                return node
            info = self._known.get(node_id)
        if info is None:
            info = self.refresh().get(node_id)
            if info is None:
                raise PoolError(f"pool node {node_id!r} is not registered")
        layout = BlockLayout.from_list(info["layout"])
        if layout != self.layout:
            raise PoolError(f"pool node {node_id} stores {layout}, this worker needs {self.layout}")
        channel = rpc_channel(info["addr"])
        stub = pool_pb2_grpc.KVPoolStub(channel)
        link = PairLink(
            node_id,
            self.meta.rendezvous,
            info["device"],
            stub,
            self.layout,
            self.peer_id,
            self.host,
            self.device,
            self.transfer_timeout_s,
            self.data_interface,
        )
        node = _Node(node_id, channel, stub, link, int(info.get("num_slots", 0)))
        self._remap(node, info)
        node.shm_staging = Staging(self.layout.torch_dtype, self.device)
        node.shm_get_staging = Staging(self.layout.torch_dtype, self.device)
        with self._lock:
            if node_id in self.nodes:  # another thread made it meanwhile
                link.close()
                channel.close()
            node = self.nodes.setdefault(node_id, node)
        return node

    def _remap(self, node: _Node, info: dict | None) -> None:
        """Map the node's shared slab when its registry record advertises one on this host (same boot)
        and it opens; unmap it when the node left the registry (its slab dies with it)."""
        path = info.get("shm", "") if info is not None and info.get("shm_host") == shm_host() else ""
        if not self.use_shm or path == node.shm_path:
            return
        node.shm, node.shm_path = None, path
        if path:
            try:
                node.shm = SharedSlab.open(path, self.layout, int(info["num_slots"]))
            except (OSError, ValueError, RuntimeError) as err:
                log.warning(
                    "pool node %s: shared slab unusable (%s), using its pair group", node.node_id, err
                )

    # -- puts ---------------------------------------------------------------------------------------
    def put(self, *args, **kwargs) -> list[Location | None]:
        """`put_async(...).result()`."""
        return self.put_async(*args, **kwargs).result()

    def put_async(
        self,
        request_id: str,
        keys: Sequence[bytes],
        data: torch.Tensor | Callable[[int, int, torch.Tensor], None],
        private: Sequence[bool] = (),
        node_id: str | Sequence[str] | None = None,
        head_begin: int = 0,
        head_end: int | None = None,
        layers: tuple[int, int] | None = None,
    ) -> concurrent.futures.Future:
        """Store blocks under `keys`; a future of the location of each (None = not stored: pool full).

        `node_id`: the node, or the nodes each block gets a copy on (None: `pick_nodes()`). With several,
        the future completes once every copy was answered (a copy that failed is only a copy fewer),
        each location naming the block's other copies as its `replicas`.

        Returns once the data is sent (copied into a same-host node's slab, or handed to the pair
        group): the node's answer completes the future later, so the next transfer can start meanwhile.

        `data` is either the packed blocks [n, L, 2, heads, bs, D], or `fill(first, count, out)` that packs
        blocks [first, first + count) into `out` (the destination slots themselves when they allow it,
        else a reused staging buffer), called run by run so packing overlaps the wire.

        `layers` (begin, end): a layer-wise put of those layers only ([n, end - begin, 2, heads, bs, D]):
        the node completes a block once every layer (and KV head) of it came, from puts of the same key
        to the same node; each of those puts is answered then.
        """
        head_end = self.layout.num_kv_heads if head_end is None else head_end
        lb, le = layers or (0, self.layout.num_layers)
        self.layout.check_heads(head_begin, head_end, lb, le)
        private = list(private) or [False] * len(keys)
        if isinstance(data, torch.Tensor):
            data = data.contiguous()
        if len(keys) > MAX_BLOCKS:  # more than one header holds: several transfers
            parts = []
            for first in range(0, len(keys), MAX_BLOCKS):
                end = min(first + MAX_BLOCKS, len(keys))
                part = data[first:end] if isinstance(data, torch.Tensor) else _offset(data, first)
                parts.append(
                    self.put_async(
                        request_id,
                        keys[first:end],
                        part,
                        private[first:end],
                        node_id,
                        head_begin,
                        head_end,
                        layers,
                    )
                )
            return gather(parts)
        if not keys:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result([])
            return done
        targets = [node_id] if isinstance(node_id, str) else list(node_id or self.pick_nodes())
        slices = (head_begin, head_end, lb, le)
        if len(targets) == 1:
            return self._put_copy(request_id, keys, data, private, targets[0], *slices)
        copies = []
        for target in dict.fromkeys(targets):
            try:
                copies.append(self._put_copy(request_id, keys, data, private, target, *slices))
            except PoolError as err:  # a copy fewer; the put fails only when no copy can be made
                log.warning("copy of %d blocks of %s on %s failed: %s", len(keys), request_id, target, err)
                copies.append(failed_future(err))
        return _merge_copies(copies)

    def _put_copy(self, request_id, keys, data, private, node_id, head_begin, head_end, lb, le):
        """One node's copy of a put (see `put_async`)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        node = self._node(node_id)
        named = self._reserve(node, len(keys))
        sent_at = time.monotonic()  # the node renews the lease when this put reaches it, after now
        done.add_done_callback(lambda f: f.exception() is None and self._renewed(node, sent_at))
        last = 0 if le == self.layout.num_layers else le
        put = Put(request_id, list(keys), data, private, named, head_begin, head_end, done, lb, last)
        shm = node.shm
        if shm is not None and len(named) == len(keys):
            self._put_shm(node, shm, put)
        else:
            node.link.put(put)
        return done

    def _reserve(self, node: _Node, n: int) -> list[tuple[int, int]]:
        """Up to `n` of this client's reserved (slot, generation) on `node`. Short of them, it reserves
        now; running low, it refills in the background, so a put rarely waits for a Reserve."""
        batch = max(1, min(self.reserve_blocks, node.num_slots // 16))  # holds at most 2 batches
        with node.reserve_lock:
            now = time.monotonic()
            if now >= node.reserved_until:  # the lease may lapse on the node: never write into them
                node.reserved = []
            if len(node.reserved) < n:
                self._add_reserved(node, self._reserve_call(node, max(n - len(node.reserved), batch)), now)
            taken, node.reserved = node.reserved[:n], node.reserved[n:]
            if len(node.reserved) < batch and not node.refilling:
                node.refilling = True
                self._control.submit(self._refill, node, batch)
            return taken

    def _reserve_call(self, node: _Node, count: int) -> pool_pb2.ReserveResponse:
        try:
            request = pool_pb2.ReserveRequest(peer_id=self.peer_id, count=count)
            return node.stub.Reserve(request, timeout=self.transfer_timeout_s)
        except grpc.RpcError as err:
            node.link.down_until = time.monotonic() + RETRY_S
            raise PoolError(f"reserving slots on pool node {node.node_id} failed: {err}") from err

    @staticmethod
    def _add_reserved(node: _Node, reply: pool_pb2.ReserveResponse, asked_at: float) -> None:
        """Merge a Reserve's slots in (lowest first: runs of slots stay contiguous); the call renewed
        the whole lease at the node."""
        node.reserved = sorted(node.reserved + list(zip(reply.slots, reply.generations, strict=True)))
        node.reserve_ttl_s = reply.ttl_s
        node.reserved_until = max(node.reserved_until, asked_at + reply.ttl_s / 2)

    def _refill(self, node: _Node, count: int) -> None:
        asked_at = time.monotonic()
        try:
            reply = self._reserve_call(node, count)
        except PoolError as err:  # the next put reserves for itself
            log.warning("%s", err)
            reply = None
        with node.reserve_lock:
            node.refilling = False
            if reply is not None:
                if time.monotonic() >= node.reserved_until:
                    node.reserved = []
                self._add_reserved(node, reply, asked_at)

    @staticmethod
    def _renewed(node: _Node, sent_at: float) -> None:
        """A put sent at `sent_at` was answered: the node renewed this client's reservations when it
        got it. Only what the node confirmed extends them (a Reserve reply, a put's answer), never a
        put that may not have reached it: past the node's lease, a same-host memcpy could land in a
        slot handed to someone else."""
        with node.reserve_lock:
            node.reserved_until = max(node.reserved_until, sent_at + node.reserve_ttl_s / 2)

    def _put_shm(self, node: _Node, shm: SharedSlab, put: Put) -> None:
        """Copy the blocks into their reserved slots of the node's slab, then commit them (async)."""
        slab, (hb, he) = shm.slab, (put.head_begin, put.head_end)
        lb, le = put.layer_begin, put.layer_end or self.layout.num_layers
        full = self.layout.whole(hb, he, lb, le)
        slots = [slot for slot, _ in put.named]
        spans = runs(slots)
        with node.shm_lock:
            if full and len(spans) > 1:  # scattered slots: pack once, then one scatter copy
                staged = put.data
                if not isinstance(staged, torch.Tensor):
                    staged = node.shm_staging.view(self.layout.slice_shape(len(slots), hb, he))
                    put.data(0, len(slots), staged)
                slab.index_copy_(0, torch.tensor(slots), staged)
                spans = []
            for pos, slot0, length in spans:
                dest = slab[slot0 : slot0 + length, lb:le, :, hb:he]
                if isinstance(put.data, torch.Tensor):
                    dest.copy_(put.data[pos : pos + length])
                elif full:  # the slots are contiguous blocks: pack straight into them
                    put.data(pos, length, dest)
                else:
                    staged = node.shm_staging.view(self.layout.slice_shape(length, hb, he, lb, le))
                    put.data(pos, length, staged)
                    dest.copy_(staged)
        node.link.put(put, commit=True)

    # -- gets ---------------------------------------------------------------------------------------
    def get(
        self,
        request_id: str,
        locations: Sequence[Location],
        head_begin: int = 0,
        head_end: int | None = None,
    ) -> torch.Tensor:
        """The leading still-valid blocks of `locations`, copied out: [n_served, L, 2, heads, bs, D]."""
        parts: list[torch.Tensor] = []
        n = self.get_into(
            request_id, locations, lambda _, data: parts.append(data.clone()), head_begin, head_end
        )
        if not parts:
            head_end = self.layout.num_kv_heads if head_end is None else head_end
            shape = self.layout.slice_shape(0, head_begin, head_end)
            return torch.empty(shape, dtype=self.layout.torch_dtype, device=self.device)
        return torch.cat(parts)[:n]  # a same-host read may have copied blocks it then found stale

    def get_into(
        self,
        request_id: str,
        locations: Sequence[Location],
        consume: Callable[[int, torch.Tensor], None],
        head_begin: int = 0,
        head_end: int | None = None,
    ) -> int:
        """Fetch the leading blocks of `locations` that are still valid; returns how many.

        `consume(first_index, data)` is called once per transfer (or per run of slots) with a view
        ([n, L, 2, heads, bs, D]) that is only valid during the call: copy it where it belongs. Only
        the first (returned) blocks are valid: a view of a block found stale after it was consumed
        may have been handed over. Consecutive blocks on one node move in one transfer; it stops at
        the first block a node no longer holds (evicted, or metadata that went stale), so the caller
        recomputes from there.
        """
        head_end = self.layout.num_kv_heads if head_end is None else head_end
        self.layout.check_heads(head_begin, head_end)
        locations, start, failed = list(locations), 0, set()
        while start < len(locations):
            end = start
            while (
                end < len(locations)
                and end - start < MAX_BLOCKS
                and locations[end].node_id == locations[start].node_id
            ):
                end += 1
            asked, node_id = end - start, locations[start].node_id
            try:
                node = self._node(node_id)
                run = self._restore(node, locations[start:end])
                shm = node.shm
                if not run:
                    served = 0
                elif shm is not None:
                    served = self._get_shm(node, shm, request_id, run, head_begin, head_end, start, consume)
                else:
                    served = node.link.get(request_id, run, head_begin, head_end, start, consume)
            except PoolError as err:
                if not any(r.node_id not in failed | {node_id} for r in locations[start].replicas):
                    raise
                log.warning("get from pool node %s failed (%s): reading its replicas", node_id, err)
                served = 0
            start += served
            if served < asked:  # the rest from other copies, if the next block has one
                failed.add(node_id)
                locations[start:] = _reroute(locations[start:], failed)
                if start == len(locations):
                    break
        return start

    def _restore(self, node: _Node, run: Sequence[Location]) -> Sequence[Location]:
        """`run` with its blocks in the node's disk tier loaded into its slab (`Restore`), up to the
        first it no longer holds; a failed call ends the run before its first disk block."""
        first = next((i for i, loc in enumerate(run) if loc.slot == DISK_SLOT), None)
        if first is None:
            return run
        request = pool_pb2.RestoreRequest(blocks=[to_proto(loc) for loc in run])
        try:
            reply = node.stub.Restore(request, timeout=self.transfer_timeout_s)
        except grpc.RpcError as err:
            log.warning("restoring %d blocks from %s's disk failed: %s", len(run) - first, node.node_id, err)
            return run[:first]
        return [from_proto(loc) for loc in reply.blocks][: len(run)]

    def pull_into_cache(
        self,
        request_id: str,
        locations: Sequence[Location],
        cache: torch.Tensor,
        block_ids: Sequence[int],
        head_begin: int = 0,
        head_end: int | None = None,
    ) -> int:
        """`get_into` straight into blocks `block_ids` of a paged cache [L, 2, heads, blocks, bs, D]
        (the cache holds KV heads [head_begin, head_end) of the layout); returns the blocks served."""

        def land(first: int, data: torch.Tensor) -> None:
            unpack_blocks(cache, block_ids[first : first + data.shape[0]], data)

        return self.get_into(request_id, locations, land, head_begin, head_end)

    def _get_shm(
        self, node: _Node, shm: SharedSlab, request_id, run, head_begin, head_end, offset, consume
    ) -> int:
        """Lock-free read from a same-host slab: check, copy, check the generations again."""
        n, private = shm.valid(run)
        if n < len(run):
            self.meta.unpublish([run[n]])  # compare-and-delete: only that exact stale entry
        slots = [loc.slot for loc in run[:n]]
        spans = runs(slots)
        if len(spans) > 1 and head_end - head_begin == self.layout.num_kv_heads:
            with node.shm_get_lock:  # scattered slots: gather them in one copy, consume once
                staged = node.shm_get_staging.view(self.layout.slice_shape(n, 0, head_end))
                torch.index_select(shm.slab, 0, torch.tensor(slots), out=staged)
                consume(offset, staged)
            spans = []
        for pos, slot0, length in spans:
            consume(offset + pos, shm.slab[slot0 : slot0 + length, :, :, head_begin:head_end])
        n = min(n, shm.valid(run[:n], complete=False)[0])  # a slot reused meanwhile: a miss from there
        read = [to_proto(loc) for loc, p in zip(run[:n], private, strict=False) if p]
        if read and head_end - head_begin == self.layout.num_kv_heads:  # the node frees them
            try:
                node.stub.Consumed(pool_pb2.ConsumedRequest(blocks=read), timeout=self.transfer_timeout_s)
            except grpc.RpcError as err:  # the node's private TTL frees them instead
                log.warning("freeing %d read private blocks on %s failed: %s", len(read), node.node_id, err)
        return n

    # -- control --------------------------------------------------------------------------------------
    def lookup_prefix(self, keys: Sequence[bytes]) -> list[Location]:
        """The pool's leading blocks of the chain, each the copy nearest this client (`near`)."""
        self.refresh(max_age_s=1.0)
        return self.meta.lookup_prefix(keys, prefer=self.near)

    def lookup(self, keys: Sequence[bytes]) -> list[Location | None]:
        """`MetadataStore.lookup`, each block the copy nearest this client."""
        self.refresh(max_age_s=1.0)
        return self.meta.lookup(keys, prefer=self.near)

    def nearest(self, locations: Sequence[Location]) -> list[Location]:
        """Locations another process looked up (the router), each block's copy nearest this client first,
        as `lookup` would pick them (memory copies before a disk copy). No Redis call: the nodes this
        client knows of are as of its last refresh."""
        out = []
        for loc in locations:
            copies = loc.copies()
            memory = sorted((c for c in copies if c.slot != DISK_SLOT), key=lambda c: self.near(c.node_id))
            first, *rest = memory + [c for c in copies if c.slot == DISK_SLOT]
            out.append(replace(first, replicas=tuple(rest)))
        return out

    def release(self, request_id: str) -> int:
        """Drop a request's private blocks and leases on every known node."""
        released = 0
        for node_id in self.refresh():
            try:
                node = self._node(node_id)
                released += node.stub.Release(
                    pool_pb2.ReleaseRequest(request_id=request_id), timeout=min(5.0, self.transfer_timeout_s)
                ).released
            except (grpc.RpcError, PoolError) as err:
                log.warning("release of %s on %s failed: %s", request_id, node_id, err)
        return released

    def stats(self) -> dict[str, pool_pb2.PoolStats]:
        out = {}
        for node_id in self.refresh():
            out[node_id] = self._node(node_id).stub.GetStats(pool_pb2.PoolStatsRequest(), timeout=5)
        return out

    def close(self) -> None:
        with self._lock:
            nodes, self.nodes = list(self.nodes.values()), {}
        self._control.shutdown(wait=True)
        for node in nodes:
            node.link.close()
            node.channel.close()


def _offset(fill: Callable[[int, int, torch.Tensor], None], shift: int):
    return lambda first, count, out: fill(shift + first, count, out)


def _reroute(rest: list[Location], failed: set[str]) -> list[Location]:
    """The leading blocks of `rest` that have a copy on a node not in `failed`, each moved to such a
    copy (the one on the same node as the block before it, if any; its other copies stay replicas);
    ends before the first that has none."""
    out, previous = [], ""
    for loc in rest:
        copies = [c for c in loc.copies() if c.node_id not in failed]
        if not copies:
            break
        best = next((c for c in copies if c.node_id == previous), copies[0])
        others = tuple(c for c in loc.copies() if c is not best and c.node_id != best.node_id)
        out.append(replace(best, replicas=others))
        previous = best.node_id
    return out


def failed_future(err: Exception) -> concurrent.futures.Future:
    """A future that failed with `err`."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(err)
    return future


def _merge_copies(copies: list[concurrent.futures.Future]) -> concurrent.futures.Future:
    """One future of the locations of a put stored as `copies` (one future per node): per block, the
    first stored copy, the others as its replicas; it fails only when every copy failed."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def check(_) -> None:
        if done.done() or not all(c.done() for c in copies):
            return
        results = [c.result() for c in copies if c.exception() is None]
        try:
            if not results:
                done.set_exception(copies[0].exception())
                return
            merged = []
            for found in zip(*results, strict=True):
                stored = [loc for loc in found if loc is not None]
                merged.append(replace(stored[0], replicas=tuple(stored[1:])) if stored else None)
            done.set_result(merged)
        except concurrent.futures.InvalidStateError:
            pass  # another copy's callback completed it first

    for c in copies:
        c.add_done_callback(check)
    return done


def gather(parts: list[concurrent.futures.Future]) -> concurrent.futures.Future:
    """One future of the concatenated results of `parts` (the first failure fails it)."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    if not parts:
        done.set_result([])

    def check(_) -> None:
        if done.done() or not all(p.done() for p in parts):
            return
        errors = [p.exception() for p in parts if p.exception() is not None]
        try:
            if errors:
                done.set_exception(errors[0])
            else:
                done.set_result([loc for p in parts for loc in p.result()])
        except concurrent.futures.InvalidStateError:
            pass  # another part's callback completed it first

    for p in parts:
        p.add_done_callback(check)
    return done


def wait_for_nodes(client: PoolClient, count: int, timeout_s: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = client.refresh()
        if len(nodes) >= count or time.monotonic() > deadline:
            return nodes
        time.sleep(0.1)
