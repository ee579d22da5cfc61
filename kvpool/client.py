"""The pool client used by workers (put / get blocks) and the router (prefix lookup).

One `PoolClient` per process. It finds nodes in the Redis registry (caching what it learned, so a
Redis outage does not lose the addresses of nodes it already talks to), connects a pair group to each
node the first time it needs it, and runs at most one transfer at a time per node (transfers on one
pair group are ordered by a lock and told apart by tags).

No caller waits on a node longer than `transfer_timeout_s` (connecting, the pair group's sends and
receives, the RPCs, the wait for its turn): a node that died or hangs turns a get into a miss (the
caller recomputes) and a put into blocks not stored, and the pair group is dropped, to be made again
on the next use (a node that refused a connection is not tried again for `RETRY_S`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist

from kvferry.kvpool.metadata import Location, MetadataStore
from kvferry.kvpool.node import NODE_ROLE
from kvferry.kvpool.transfer import (
    CHUNK_BYTES,
    BlockLayout,
    Staging,
    chunk_plan,
    make_pair_group,
    next_tag,
    recv,
    recv_stream,
    send_stream,
    unpack_blocks,
)
from kvferry.rpc import channel as rpc_channel
from kvferry.v1 import pool_pb2, pool_pb2_grpc

log = logging.getLogger(__name__)

RETRY_S = 2.0  # after a failed connect, a node is not tried again for this long


class PoolError(RuntimeError):
    """A pool node could not be reached or refused a transfer."""


@dataclass
class _Node:
    node_id: str
    addr: str
    store_addr: str
    device: str
    layout: BlockLayout
    channel: grpc.Channel
    stub: pool_pb2_grpc.KVPoolStub
    staging: Staging
    group: dist.ProcessGroup | None = None
    group_name: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_tag: int = 1
    # the data plane: one thread per node runs the transfers in tag order (the order the node expects),
    # so a caller can issue the next transfer's RPC while earlier ones are still on the wire
    jobs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    worker: threading.Thread | None = None
    down_until: float = 0.0  # a connect failed: fail fast until then


def to_proto(loc: Location) -> pool_pb2.BlockLocation:
    return pool_pb2.BlockLocation(key=loc.key, node_id=loc.node_id, slot=loc.slot, generation=loc.generation)


def from_proto(loc: pool_pb2.BlockLocation) -> Location:
    return Location(loc.key, loc.node_id, loc.slot, loc.generation)


class PoolClient:
    def __init__(
        self,
        meta: MetadataStore,
        layout: BlockLayout,
        peer_id: str = "",
        host: str = "127.0.0.1",
        device: str = "cpu",
        transfer_timeout_s: float = 10.0,
    ):
        self.meta = meta
        self.layout = layout
        self.peer_id = peer_id or f"peer-{uuid.uuid4().hex[:8]}"
        self.host = host
        self.device = torch.device(device)
        self.transfer_timeout_s = transfer_timeout_s
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
            members = self.meta.members(NODE_ROLE)
            if members is not None:
                with self._lock:
                    self._known, self._known_at = members, now
        return dict(self._known)

    def pick_node(self) -> str:
        nodes = self.refresh(max_age_s=1.0)
        if not nodes:
            raise PoolError("no KV pool node is registered")
        return max(nodes, key=lambda n: (nodes[n].get("free_slots", 0), n))

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
        node = _Node(
            node_id,
            info["addr"],
            info["store"],
            info["device"],
            layout,
            channel,
            pool_pb2_grpc.KVPoolStub(channel),
            Staging(self.layout.torch_dtype, self.device),
        )
        with self._lock:
            node = self.nodes.setdefault(node_id, node)
        return node

    @contextlib.contextmanager
    def _locked(self, node: _Node):
        """Hold `node.lock`, waiting no longer than the transfer timeout (another caller may be stuck
        connecting to a node that hangs)."""
        if not node.lock.acquire(timeout=self.transfer_timeout_s):
            raise PoolError(f"pool node {node.node_id} is busy past {self.transfer_timeout_s}s (hung?)")
        try:
            yield
        finally:
            node.lock.release()

    def _connect(self, node: _Node) -> dist.ProcessGroup:
        """The pair group with `node` (caller holds node.lock); made on first use."""
        if node.group is not None:
            return node.group
        if time.monotonic() < node.down_until:
            raise PoolError(f"pool node {node.node_id} refused a connection less than {RETRY_S}s ago")
        backend = "nccl" if self.device.type == "cuda" and node.device == "cuda" else "gloo"
        name = f"{self.peer_id}/{uuid.uuid4().hex[:8]}"
        timeout = self.transfer_timeout_s
        deadline = time.monotonic() + timeout
        reply = None
        try:
            host, port = node.store_addr.rsplit(":", 1)
            # a dead node refuses at once, but TCPStore would retry until its timeout (and past it)
            socket.create_connection((host, int(port)), timeout=min(timeout, 2.0)).close()
            joined = self._join(host, int(port), name, backend)
            reply = node.stub.Connect.future(
                pool_pb2.ConnectRequest(peer_id=self.peer_id, group_name=name, backend=backend),
                timeout=timeout,
            )
            group = joined.result(timeout=max(0.0, deadline - time.monotonic()))
            reply.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as err:  # store unreachable, peer never joined, RPC failed: the node is down
            if reply is not None:
                reply.cancel()
            node.down_until = time.monotonic() + RETRY_S
            if isinstance(err, concurrent.futures.TimeoutError):
                err = TimeoutError(f"no pair group after {timeout}s")
            raise PoolError(f"cannot connect to pool node {node.node_id}: {err}") from err
        node.group, node.group_name, node.next_tag = group, name, 1
        return group

    def _join(self, host: str, port: int, name: str, backend: str) -> concurrent.futures.Future:
        """Join pair group `name` through the node's store, on a thread of its own: a TCPStore client
        whose server hangs (accepts, never answers) waits past any timeout, so the caller waits on the
        future (bounded) and a join that finishes after the caller gave up is dropped."""
        joined: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            timeout = self.transfer_timeout_s
            try:
                store = dist.TCPStore(host, port, is_master=False, timeout=_td(timeout))
                joined.set_result(make_pair_group(store, name, 1, backend, self.host, timeout))
            except Exception as err:
                joined.set_exception(err)

        threading.Thread(target=run, name=f"kv-join-{name}", daemon=True).start()
        return joined

    def _fail(self, node: _Node, err: Exception, what: str, group=None) -> PoolError:
        """Forget the pair group a transfer failed on (caller holds node.lock), unless it was already
        replaced: a late failure of an old group must not tear down a healthy new one."""
        if group is None or node.group is group:
            node.group, node.group_name, node.next_tag = None, "", 1
        return PoolError(f"{what} on pool node {node.node_id} failed: {err}")

    # -- data -----------------------------------------------------------------------------------------
    def put(self, *args, **kwargs) -> list[Location | None]:
        """`put_async(...).result()`."""
        return self.put_async(*args, **kwargs).result()

    def put_async(
        self,
        request_id: str,
        keys: Sequence[bytes],
        data: torch.Tensor | Callable[[int, int, torch.Tensor], None],
        private: Sequence[bool] = (),
        node_id: str | None = None,
        head_begin: int = 0,
        head_end: int | None = None,
    ) -> concurrent.futures.Future:
        """Store blocks under `keys`; a future of the location of each (None = not stored: pool full).

        Returns once the data is sent: the node's reply (the locations) completes the future later,
        so the next transfer to the node can start meanwhile (the node runs a peer's transfers in tag
        order, so they cannot cross).

        `data` is either the packed blocks [n, L, 2, heads, bs, D], or `fill(first, count, out)` that packs
        blocks [first, first + count) into `out` (a reused staging buffer), called chunk by chunk so
        packing overlaps the wire.
        """
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not keys:
            done.set_result([])
            return done
        head_end = self.layout.num_kv_heads if head_end is None else head_end
        self.layout.check_heads(head_begin, head_end)
        node = self._node(node_id or self.pick_node())
        private = list(private) or [False] * len(keys)
        blocks = [pool_pb2.PutBlock(key=k, private=p) for k, p in zip(keys, private, strict=True)]
        chunk_blocks = self._chunk_blocks(head_begin, head_end)
        plan = chunk_plan(len(keys), chunk_blocks)

        def chunk(i: int, first: int, count: int) -> torch.Tensor:
            if isinstance(data, torch.Tensor):
                return data[first : first + count]
            out = node.staging.view(self.layout.slice_shape(count, head_begin, head_end), i)
            data(first, count, out)
            return out

        with self._locked(node):
            group = self._connect(node)
            tag = self._tags(node, len(plan))
            if isinstance(data, torch.Tensor):
                data = data.contiguous()
            request = pool_pb2.PutRequest(
                group_name=node.group_name,
                peer_id=self.peer_id,
                tag=tag,
                request_id=request_id,
                blocks=blocks,
                head_begin=head_begin,
                head_end=head_end,
                chunk_blocks=chunk_blocks,
            )
            reply = node.stub.Put.future(request, timeout=self.transfer_timeout_s)
            sent = self._submit(node, group, lambda: send_stream(group, 0, tag + 1, plan, chunk))

        def after_send(job) -> None:
            err = job.exception()
            if err is None:
                reply.add_done_callback(finish)
                return
            reply.cancel()
            with node.lock:
                done.set_exception(self._fail(node, err, f"put of {len(keys)} blocks", group))

        def finish(call) -> None:
            try:
                result = call.result()
            except grpc.RpcError as err:
                with node.lock:
                    failure = self._fail(node, err, f"put of {len(keys)} blocks", group)
                done.set_exception(failure)
                return
            done.set_result([from_proto(loc) if loc.generation else None for loc in result.locations])

        sent.add_done_callback(after_send)
        return done

    def _submit(self, node: _Node, group, job: Callable[[], object]) -> concurrent.futures.Future:
        """Queue a transfer on `group` on the node's data-plane thread (caller holds node.lock). A
        transfer whose pair group was dropped before its turn fails at once: its tags are gone."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> object:
            if node.group is not group:
                raise PoolError(f"the pair group with pool node {node.node_id} was dropped")
            return job()

        node.jobs.put((run, future))
        if node.worker is None:
            node.worker = threading.Thread(
                target=_run_jobs, args=(node.jobs,), name=f"kv-{node.node_id}", daemon=True
            )
            node.worker.start()
        return future

    def _chunk_blocks(self, head_begin: int, head_end: int) -> int:
        per_block = self.layout.block_bytes * (head_end - head_begin) // self.layout.num_kv_heads
        return max(1, CHUNK_BYTES // per_block)

    @staticmethod
    def _tags(node: _Node, messages: int) -> int:
        """A base tag with room for the header and `messages` data messages after it."""
        base = node.next_tag
        node.next_tag = next_tag(base, messages)
        return base

    def get(
        self,
        request_id: str,
        locations: Sequence[Location],
        head_begin: int = 0,
        head_end: int | None = None,
    ) -> torch.Tensor:
        """The leading still-valid blocks of `locations`, copied out: [n_served, L, 2, heads, bs, D]."""
        parts: list[torch.Tensor] = []
        self.get_into(request_id, locations, lambda _, data: parts.append(data.clone()), head_begin, head_end)
        if not parts:
            head_end = self.layout.num_kv_heads if head_end is None else head_end
            shape = self.layout.slice_shape(0, head_begin, head_end)
            return torch.empty(shape, dtype=self.layout.torch_dtype, device=self.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def get_into(
        self,
        request_id: str,
        locations: Sequence[Location],
        consume: Callable[[int, torch.Tensor], None],
        head_begin: int = 0,
        head_end: int | None = None,
    ) -> int:
        """Fetch the leading blocks of `locations` that are still valid; returns how many.

        `consume(first_index, data)` is called once per transfer with a view of a reused receive
        buffer ([n, L, 2, heads, bs, D]) that is only valid during the call: copy it where it belongs.
        Consecutive blocks on one node move in one transfer; it stops at the first block a node no
        longer holds (evicted, or metadata that went stale), so the caller recomputes from there.
        """
        head_end = self.layout.num_kv_heads if head_end is None else head_end
        self.layout.check_heads(head_begin, head_end)
        start = 0
        while start < len(locations):
            end = start
            while end < len(locations) and locations[end].node_id == locations[start].node_id:
                end += 1
            served = self._get_run(request_id, locations[start:end], head_begin, head_end, start, consume)
            start += served
            if served < end - (start - served):
                break
        return start

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

    def _get_run(self, request_id, run, head_begin, head_end, offset, consume) -> int:
        node = self._node(run[0].node_id)
        chunk_blocks = self._chunk_blocks(head_begin, head_end)
        # a receive that outlives the caller's wait must not land data in blocks the caller has given up
        landing = threading.Lock()
        abandoned = False
        with self._locked(node):
            group = self._connect(node)
            tag = self._tags(node, len(chunk_plan(len(run), chunk_blocks)))
            request = pool_pb2.GetRequest(
                group_name=node.group_name,
                peer_id=self.peer_id,
                tag=tag,
                request_id=request_id,
                blocks=[to_proto(x) for x in run],
                head_begin=head_begin,
                head_end=head_end,
                chunk_blocks=chunk_blocks,
            )
            reply = node.stub.Get.future(request, timeout=self.transfer_timeout_s)

            def receive() -> int:
                header = torch.zeros(1, dtype=torch.int64, device=self.device)
                recv(group, header, 0, tag)
                n = int(header.item())

                def dest(i: int, first: int, count: int) -> torch.Tensor:
                    return node.staging.view(self.layout.slice_shape(count, head_begin, head_end), i)

                def land(i: int, first: int, count: int, data: torch.Tensor) -> None:
                    with landing:
                        if abandoned:
                            raise PoolError("the caller stopped waiting")
                        consume(offset + first, data)

                recv_stream(group, 0, tag + 1, chunk_plan(n, chunk_blocks), dest, land)
                return n

            received = self._submit(node, group, receive)
        try:
            n = received.result(timeout=self.transfer_timeout_s)
        except Exception as err:  # the transfer failed, or timed out (the node died or hangs)
            with landing:
                abandoned = True
            reply.cancel()
            if isinstance(err, concurrent.futures.TimeoutError):
                err = TimeoutError(f"no data after {self.transfer_timeout_s}s")
            with self._locked(node):
                raise self._fail(node, err, f"get of {len(run)} blocks", group) from err
        # the data is here; the reply only confirms it, so nobody waits for it
        reply.add_done_callback(
            lambda call: call.exception() and log.warning("get reply: %s", call.exception())
        )
        return n

    # -- control --------------------------------------------------------------------------------------
    def lookup_prefix(self, keys: Sequence[bytes]) -> list[Location]:
        return self.meta.lookup_prefix(keys)

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
        for node in nodes:
            node.jobs.put((None, None))
            node.channel.close()


def _run_jobs(jobs: queue.SimpleQueue) -> None:
    while True:
        job, future = jobs.get()
        if job is None:
            return
        try:
            future.set_result(job())
        except Exception as err:
            future.set_exception(err)


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def wait_for_nodes(client: PoolClient, count: int, timeout_s: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = client.refresh()
        if len(nodes) >= count or time.monotonic() > deadline:
            return nodes
        time.sleep(0.1)
