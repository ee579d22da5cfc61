"""The router's view of the cluster: live workers and pool nodes from the Redis registry.

Refreshed every `refresh_s`. A member whose registry record is gone for longer than `grace_s` (its
heartbeat TTL ran out: the process died or hangs) is dropped; a Redis outage keeps the last known set
(an outage must not stop serving), and the grace restarts when Redis is readable again (records come
back only with the next heartbeats, and a restarted Redis starts empty). A dropped member's channel
is closed once its last call ends, never under a stream in flight. A malformed registry record is
skipped (logged once per member), never a failed refresh. A worker whose record says it is draining
gets no new requests (it finishes the ones it has, then leaves). A worker that fails an RPC with
UNAVAILABLE is skipped until it beats again. Every worker must agree on the model fingerprint, block
size and max length; one that does not is refused (logged), never routed to.

Each prefill worker's backlog (the prompt tokens it still has to compute, per priority:
`kvferry.worker.backlog`, checked by `router.backlog`) is read at admission when the last read is older than
BACKLOG_POLL_S (50 ms: one read for every admission in that window, none while idle) from the hash
`kvf:{namespace}:prefill_backlog`, and at each refresh from its heartbeat record (`prefill_backlog`); the
newest record wins (`Member.backlog`, with the time it came, from which `router.slo` tells a stale one).
A malformed one is skipped (logged once per member).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import grpc
import redis

from kvferry.kvpool.metadata import PREFILL_BACKLOG_KEY, MetadataStore
from kvferry.router.backlog import BACKLOG_POLL_S, PublishedBacklog
from kvferry.rpc import aio_channel
from kvferry.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


@dataclass
class Member:
    role: str
    member_id: str
    addr: str
    channel: grpc.aio.Channel
    stub: object
    info: worker_pb2.WorkerInfo | None = None
    inflight: int = 0
    inflight_tokens: int = 0  # prompt tokens it is expected to compute for the calls in flight (routing)
    group: str = ""  # the worker group (an expert-parallel decode group has one member per rank)
    free_blocks: int = 0  # KV blocks free, as of the last heartbeat minus what was sent since
    draining: bool = False  # finishing what it has; gets nothing new (scale-down, shutdown)
    beat: dict = field(default_factory=dict)  # its last heartbeat record (load figures, for /metrics)
    backlog: PublishedBacklog | None = None  # a prefill worker's, the newest read (router.slo)
    backlog_at: float = 0.0  # time.monotonic() when `backlog` came
    last_seen: float = field(default_factory=time.monotonic)
    suspect_until: float = 0.0


@dataclass(frozen=True)
class _Record:
    """The fields of a worker's registry record that routing uses, checked."""

    addr: str
    group: str
    free_blocks: int
    draining: bool


@dataclass
class PoolMember:
    """A pool node as the router's directory sees it (the node itself: kvpool.node.PoolNode)."""

    addr: str
    last_seen: float
    beat: dict  # its last heartbeat record (slab slots, for /metrics)


class Directory:
    def __init__(
        self,
        meta: MetadataStore,
        refresh_s: float = 0.5,
        grace_s: float = 5.0,
        colocated: bool = False,
        backlog_poll_s: float = BACKLOG_POLL_S,
    ):
        self.meta = meta
        self.backlog_poll_s = backlog_poll_s
        self._backlog_task: asyncio.Task | None = None  # the read of the backlogs in flight, if any
        self._backlogs_at = 0.0  # time.monotonic() of the last read
        self.colocated = colocated  # decode workers alone serve (no prefill workers, no pool)
        self.refresh_s = refresh_s
        self.grace_s = grace_s
        self.members: dict[str, dict[str, Member]] = {role: {} for role in ROLES}
        self.pool_nodes: dict[str, PoolMember] = {}
        self.model: worker_pb2.WorkerInfo | None = None
        self._rr = {role: itertools.count() for role in ROLES}
        self._task: asyncio.Task | None = None
        # per role (and "pool"): since when the registry has been readable, None while it is not
        self._readable_since: dict[str, float | None] = {}
        self._retired: list[Member] = []  # dropped while calls were in flight: closed when they end
        self._malformed: set[str] = set()  # "role:id" of records already logged as unusable
        self.planners: dict[str, dict] = {}  # the planners' registry records (deploy.planner), for /metrics

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        for task in (self._task, self._backlog_task):
            if task is not None:
                task.cancel()
        for role in ROLES:
            for m in self.members[role].values():
                await m.channel.close()
        for m in self._retired:
            await m.channel.close()
        self._retired = []

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("registry refresh failed")

    async def refresh(self) -> None:
        read = await self._read_all()
        for role in ROLES:
            records = read[role]
            if records is None:
                continue  # Redis unreachable: keep what we know
            current = self.members[role]
            now = time.monotonic()
            for member_id, raw in records.items():
                record = self._parse(role, member_id, raw)
                if record is None:
                    continue
                member = current.get(member_id)
                if member is None or member.addr != record.addr:
                    member = await self._add(role, member_id, record.addr)
                    if member is None:
                        continue
                member.last_seen = now
                member.group = record.group or member_id
                member.free_blocks = record.free_blocks
                member.draining = record.draining
                member.beat = raw
                if role == "prefill" and "prefill_backlog" in raw:
                    self._take_backlog(member, raw["prefill_backlog"])
            for member_id, member in list(current.items()):
                if self._lapsed(role, member.last_seen, now):
                    log.warning("%s worker %s stopped beating; no longer routed to", role, member_id)
                    del current[member_id]
                    await self._retire(member)
        await self._close_idle()
        if read["planner"] is not None:
            self.planners = read["planner"]
        nodes = read["pool"]
        if nodes is not None:
            now = time.monotonic()
            for node_id, info in nodes.items():
                addr = info.get("addr")
                if isinstance(addr, str) and addr:
                    self.pool_nodes[node_id] = PoolMember(addr, now, info)
                else:
                    self._malformed_once("pool", node_id, info, "no addr")
            for node_id, node in list(self.pool_nodes.items()):
                if self._lapsed("pool", node.last_seen, now):
                    del self.pool_nodes[node_id]

    async def fresh_backlogs(self) -> None:
        """Make the prefill backlogs at most `backlog_poll_s` old (admission asks, before it predicts):
        one read of the hash for every admission in that window, and none while no request comes (a
        router's CPU while idle is its fleet's cost, paid per second, not per request)."""
        if self.colocated or time.monotonic() - self._backlogs_at < self.backlog_poll_s:
            return
        if self._backlog_task is None or self._backlog_task.done():
            self._backlogs_at = time.monotonic()
            self._backlog_task = asyncio.create_task(self.read_backlogs())
        try:
            await asyncio.shield(self._backlog_task)
        except Exception:
            log.exception("reading the prefill backlogs failed")

    async def read_backlogs(self) -> None:
        """Read the prefill workers' backlog hash (off the loop) into their members; a Redis outage
        leaves what is known (it goes stale)."""
        key = f"{self.meta.prefix}{PREFILL_BACKLOG_KEY}"
        try:
            records = await asyncio.to_thread(self.meta.client.hgetall, key)
        except redis.RedisError:
            return  # (the registry refresh logs the outage)
        for member_id, value in records.items():
            member = self.members["prefill"].get(member_id.decode(errors="replace"))
            if member is not None:
                self._take_backlog(member, value)

    def _take_backlog(self, member: Member, raw) -> None:
        """Keep a backlog record (a JSON text, or already parsed) if it is newer than the member's."""
        try:
            record = PublishedBacklog.parse(json.loads(raw) if isinstance(raw, str | bytes) else raw)
        except (KeyError, TypeError, ValueError) as err:
            self._malformed_once("backlog", member.member_id, raw, f"{type(err).__name__}: {err}")
            return
        if record.newer_than(member.backlog):
            member.backlog, member.backlog_at = record, time.monotonic()

    async def _read_all(self) -> dict[str, dict[str, dict] | None]:
        """Each role's (and the pool's) registry records, read in one hop off the loop; None for one
        Redis could not read (then the grace of each of its members restarts at the next good read)."""
        roles = (*ROLES, "pool", "planner")
        read = await asyncio.to_thread(self.meta.members_of, roles)
        for role, records in read.items():
            if records is None:
                self._readable_since[role] = None
            elif self._readable_since.get(role) is None:
                self._readable_since[role] = time.monotonic()
        return read

    def _lapsed(self, role: str, last_seen: float, now: float) -> bool:
        """No record for `grace_s`, counted only over time the registry was readable: after an outage
        the members get a whole grace to beat again."""
        since = self._readable_since.get(role) or now
        return now - max(last_seen, since) > self.grace_s

    def _parse(self, role: str, member_id: str, raw: dict) -> _Record | None:
        try:
            addr = raw["addr"]
            if not isinstance(addr, str) or not addr:
                raise ValueError(f"addr {addr!r}")
            group = raw.get("group") or ""
            if not isinstance(group, str):
                raise ValueError(f"group {group!r}")
            record = _Record(addr, group, int(raw.get("free_blocks") or 0), bool(raw.get("draining", False)))
        except (KeyError, TypeError, ValueError) as err:
            self._malformed_once(role, member_id, raw, f"{type(err).__name__}: {err}")
            return None
        self._malformed.discard(f"{role}:{member_id}")
        return record

    def _malformed_once(self, role: str, member_id: str, raw: object, why: str) -> None:
        name = f"{role}:{member_id}"
        if name not in self._malformed:
            self._malformed.add(name)
            log.warning("skipping malformed registry record of %s %s (%s): %.200r", role, member_id, why, raw)

    async def _retire(self, member: Member) -> None:
        """Close a member's channel, or once its calls in flight end (it gets no new ones)."""
        if member.inflight > 0:
            self._retired.append(member)
        else:
            await member.channel.close()

    async def _close_idle(self) -> None:
        idle = [m for m in self._retired if m.inflight <= 0]
        self._retired = [m for m in self._retired if m.inflight > 0]
        for member in idle:
            await member.channel.close()

    async def _add(self, role: str, member_id: str, addr: str) -> Member | None:
        channel = aio_channel(addr)
        stub_cls = (
            worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        )
        stub = stub_cls(channel)
        try:
            info = await stub.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), timeout=5)
        except grpc.RpcError as err:
            log.warning("%s worker %s at %s did not answer: %s", role, member_id, addr, err)
            await channel.close()
            return None
        if self.model is None:
            self.model = info
        elif (info.fingerprint, info.block_size, info.max_model_len) != (
            self.model.fingerprint,
            self.model.block_size,
            self.model.max_model_len,
        ):
            log.error(
                "%s worker %s serves model %s (fingerprint %s, block %d, max len %d), the cluster serves "
                "%s (fingerprint %s, block %d, max len %d): refused",
                role,
                member_id,
                info.model,
                info.fingerprint,
                info.block_size,
                info.max_model_len,
                self.model.model,
                self.model.fingerprint,
                self.model.block_size,
                self.model.max_model_len,
            )
            await channel.close()
            return None
        member = Member(role, member_id, addr, channel, stub, info)
        old = self.members[role].pop(member_id, None)
        if old is not None:
            await self._retire(old)
        self.members[role][member_id] = member
        log.info("%s worker %s joined at %s", role, member_id, addr)
        return member

    def pick(self, role: str, blocks: int = 0) -> Member | None:
        """The least-loaded live group of a role (round-robin among equals), then its rank with the
        most free KV blocks (an expert-parallel decode group admits where the KV fits best; `blocks`,
        what the request will hold, is taken off that rank's count until its next heartbeat)."""
        live = self.available(role)
        if not live:
            return None
        groups: dict[str, list[Member]] = {}
        for m in live:
            groups.setdefault(m.group or m.member_id, []).append(m)
        load = {g: sum(m.inflight for m in ms) / len(ms) for g, ms in groups.items()}
        low = min(load.values())
        names = sorted(g for g, value in load.items() if value == low)
        ranks = groups[names[next(self._rr[role]) % len(names)]]
        member = max(sorted(ranks, key=lambda m: m.member_id), key=lambda m: (m.free_blocks, -m.inflight))
        member.free_blocks -= blocks
        return member

    def available(self, role: str, exclude: Collection[str] = ()) -> list[Member]:
        """The members of a role that may take a new call now: live, not draining, not suspect, and
        neither they nor their group in `exclude` (the ones a request already tried)."""
        now = time.monotonic()
        return [
            m
            for m in self.members[role].values()
            if m.suspect_until <= now
            and not m.draining
            and m.member_id not in exclude
            and not (m.group and m.group in exclude)
        ]

    def suspect(self, member: Member, seconds: float) -> None:
        member.suspect_until = time.monotonic() + seconds

    def count(self, role: str) -> int:
        """Members that take requests (a draining one does not)."""
        return sum(1 for m in self.members[role].values() if not m.draining)

    def kernels(self) -> list[str]:
        """The kernels the members run, one "role: backend" per distinct pair (WorkerInfo.kernels)."""
        found = {
            f"{role}: {m.info.kernels}"
            for role, ms in self.members.items()
            for m in ms.values()
            if m.info is not None and m.info.kernels
        }
        return sorted(found)

    @property
    def ready(self) -> bool:
        if self.colocated:
            return bool(self.count("decode"))
        return bool(self.count("prefill") and self.count("decode") and self.pool_nodes)
