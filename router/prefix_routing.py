"""KV-aware choice of the prefill worker: SGLang's cache-aware router and Dynamo's KV router, adapted to a
cluster whose KV pool already shares every full block among the prefill workers, and to a fleet of
routers that must agree.

What each prefill worker group holds in its own prefix cache (`engine.block_manager`: full blocks keyed
by the hash chain) comes from the workers themselves: each publishes a KV event when a block becomes
findable there or stops being (`kvpool.kv_events`), and a reader thread (`KVEventReader`: every Redis
call off the event loop) keeps a `KVIndex` of them per group of the registry: from the group's snapshot
when it is first seen, after a gap in its sequence numbers, or after an outage, then from the stream. A
group gone from the registry, or back at another address (a new process), is forgotten and followed
anew. So every router sees the same caches, whichever router sent the prompts. A key names its whole
prefix: a prompt's expected local hit on a worker is the run of its leading keys found there.

Besides, a router marks the keys of each prompt it sends as held by the chosen group for `SENT_TTL_S`
(2 s): a burst sharing a prefix follows the first prompt there before the worker's events arrive. The
marks only bridge that delay (the events replace them, and they expire), so routers converge on the
workers' own reports; a failed prefill drops its marks.

A candidate (live, not draining, not suspect, not tried yet for this request) costs, in prompt tokens:
the tokens it must compute, plus the pool blocks it pulls at `pull_cost` a token (`same_host_pull_cost`
from a pool node on its own host), plus the tokens of the prefills this router has in flight there (its
queue). So a local hit beyond the pool's prefix saves a whole token of compute, a local hit the pool also
holds saves only the pull, and a pool hit, open to every worker, decides nothing except by locality. The
cheapest wins; among equals, the fewest in flight, then a rendezvous hash of the prompt's first block key
and the group (`tie_rank`): the same on every router, and spreading distinct prefixes over the workers.
When the in-flight counts are imbalanced beyond both `balance_abs` and `balance_rel` (SGLang's
thresholds), the least-loaded worker wins outright, so a hot prefix cannot pile up on one worker.

Mode `least-load` keeps the index and the predictions (for the metrics) but picks as
`router.failover.pick_excluding` does.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvferry.kvpool.kv_events import KVEventReader, KVIndex
from kvferry.kvpool.metadata import Location
from kvferry.router.config import ROUTING_MODES
from kvferry.router.directory import Directory, Member
from kvferry.router.failover import pick_excluding

REASONS = ("prefix", "pool_locality", "load", "only_choice")
SENT_TTL_S = 2.0  # how long a prompt's keys count as held where it was sent, before the worker says so


@dataclass(frozen=True)
class RoutingConfig:
    mode: str = "kv-aware"  # or "least-load": ignore the caches (the choice before KV-aware routing)
    pull_cost: float = 0.5  # a token's KV pulled from a pool node on another host, relative to computing it
    same_host_pull_cost: float = 0.2  # the same from a pool node on the worker's host
    balance_abs: int = 4  # imbalanced: most in flight - fewest > balance_abs ...
    balance_rel: float = 1.5  # ... and most > balance_rel x fewest: then least load wins


@dataclass(frozen=True)
class Choice:
    """A prefill worker chosen for a prompt, why, and what it is expected to find cached."""

    worker: Member
    reason: str  # one of REASONS
    local_tokens: int  # expected hit in the worker's own prefix cache
    pool_tokens: int  # expected pulled from the pool (the pool's prefix beyond the local hit)
    compute_tokens: int  # expected computed there: its load while the call is in flight
    keys: tuple[bytes, ...]  # the prompt's full-block keys, marked as sent to the worker


@dataclass(frozen=True)
class _Estimate:
    member: Member
    local: int  # blocks
    pool: int  # blocks
    prefill_cost: float  # tokens computed + pulled (weighted), without the queue
    cost: float  # prefill_cost + the tokens in flight there
    rank: int  # the tie-break (tie_rank)


class SentMarks:
    """The keys this router sent to one worker group lately, each until its expiry (oldest first)."""

    def __init__(self, addr: str, ttl_s: float = SENT_TTL_S):
        self.addr = addr
        self.ttl_s = ttl_s
        self.until: dict[bytes, float] = {}

    def mark(self, keys: Sequence[bytes], now: float) -> None:
        self.expire(now)
        for key in keys:
            self.until.pop(key, None)
            self.until[key] = now + self.ttl_s

    def discard(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.until.pop(key, None)

    def expire(self, now: float) -> None:
        while self.until:
            key, until = next(iter(self.until.items()))
            if until > now:
                return
            del self.until[key]


def host_of(addr: str) -> str:
    """The host of "host:port" ("[v6]:port" too)."""
    return addr.rsplit(":", 1)[0].strip("[]")


def tie_rank(tie: bytes, group: str) -> int:
    """Rendezvous hashing: among equally good groups, the one of lowest rank for the prompt's first key
    (`tie`) wins, on every router alike."""
    return int.from_bytes(hashlib.blake2b(tie + group.encode(), digest_size=8).digest(), "little")


class PrefillRouting:
    """Chooses the prefill worker of each prompt (`choose`). `index`: the workers' caches (none given:
    one fed by a `KVEventReader` on the directory's Redis, started here; `close` stops it)."""

    def __init__(self, cfg: RoutingConfig, directory: Directory, index: KVIndex | None = None):
        if cfg.mode not in ROUTING_MODES:
            raise ValueError(f"routing mode {cfg.mode!r}: expected one of {', '.join(ROUTING_MODES)}")
        self.cfg = cfg
        self.directory = directory
        self.index = KVIndex() if index is None else index
        self.reader: KVEventReader | None = None
        if index is None and directory.meta is not None:
            self.reader = KVEventReader(directory.meta, self.index, "prefill")
            self.reader.start()
        self.sent: dict[str, SentMarks] = {}  # worker group -> the keys sent there lately
        self.sent_ttl_s = SENT_TTL_S

    def close(self) -> None:
        if self.reader is not None:
            self.reader.stop()

    def choose(
        self, keys: Sequence[bytes], pooled: Sequence[Location], num_tokens: int, tried: Collection[str]
    ) -> Choice | None:
        """The prefill worker for a prompt of `num_tokens` tokens whose full-block keys are `keys` and
        whose leading blocks the pool holds at `pooled`, among those not in `tried`; None when none is
        left. The keys are marked as sent there (`failed` takes them back)."""
        self._retain()
        candidates = sorted(self.directory.available("prefill", tried), key=lambda m: m.member_id)
        if not candidates:
            return None
        block_size = self.directory.model.block_size
        usable = num_tokens // block_size  # every full block can hit: a full hit computes the last token
        tie = keys[0] if keys else num_tokens.to_bytes(8, "little")
        now = time.monotonic()
        estimates = [self._estimate(m, keys, pooled, usable, num_tokens, tie, now) for m in candidates]
        if self.cfg.mode == "least-load":
            chosen = pick_excluding(self.directory, "prefill", set(tried))
            best = next((e for e in estimates if e.member is chosen), None)
            if best is None:
                return None
            reason = "load" if len(estimates) > 1 else "only_choice"
        else:
            best, reason = self._best(estimates)
        self._marks(best.member).mark(keys, now)
        hit = _hit_tokens(best, block_size, num_tokens)
        local = min(best.local * block_size, hit)
        return Choice(
            worker=best.member,
            reason=reason,
            local_tokens=local,
            pool_tokens=hit - local,
            compute_tokens=num_tokens - hit,
            keys=tuple(keys),
        )

    def preview(
        self, keys: Sequence[bytes], pooled: Sequence[Location], num_tokens: int
    ) -> list[tuple[Member, int]]:
        """Every prefill worker that may take the prompt now, with the tokens it is expected to compute
        for it (its expected local hit and the pool's taken off): what `choose` weighs, nothing marked
        (SLO admission prices the prompt on each, router.slo)."""
        self._retain()
        block_size = self.directory.model.block_size
        usable = num_tokens // block_size
        now = time.monotonic()
        out = []
        for m in self.directory.available("prefill"):
            estimate = self._estimate(m, keys, pooled, usable, num_tokens, b"", now)
            out.append((m, num_tokens - _hit_tokens(estimate, block_size, num_tokens)))
        return out

    def failed(self, choice: Choice) -> None:
        """The prefill sent to `choice.worker` failed: it may not hold the prompt's blocks."""
        marks = self.sent.get(_group(choice.worker))
        if marks is not None:
            marks.discard(choice.keys)

    def _best(self, estimates: list[_Estimate]) -> tuple[_Estimate, str]:
        if len(estimates) == 1:
            return estimates[0], "only_choice"
        loads = [e.member.inflight for e in estimates]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.cfg.balance_abs and hi > self.cfg.balance_rel * lo:
            least = min(estimates, key=lambda e: (e.member.inflight, e.member.inflight_tokens, e.rank))
            return least, "load"
        best = min(estimates, key=lambda e: (e.cost, e.member.inflight, e.rank))
        cheapest = min(e.prefill_cost for e in estimates)
        if best.prefill_cost > cheapest or all(e.prefill_cost == cheapest for e in estimates):
            return best, "load"  # the queues outweighed the caches, or the caches are all alike
        if best.local > min(e.local for e in estimates):
            return best, "prefix"
        return best, "pool_locality"

    def _estimate(
        self,
        member: Member,
        keys: Sequence[bytes],
        pooled: Sequence[Location],
        usable: int,
        num_tokens: int,
        tie: bytes,
        now: float,
    ) -> _Estimate:
        group = _group(member)
        local = self._local(group, keys[:usable], now)
        pool = max(0, min(len(pooled), usable) - local)
        host = host_of(member.addr)
        nodes = self.directory.pool_nodes
        near = sum(
            1
            for loc in pooled[local : local + pool]
            if loc.node_id in nodes and host_of(nodes[loc.node_id].addr) == host
        )
        block_size = self.directory.model.block_size
        pulled = (near * self.cfg.same_host_pull_cost + (pool - near) * self.cfg.pull_cost) * block_size
        prefill_cost = max(1, num_tokens - (local + pool) * block_size) + pulled
        cost = prefill_cost + member.inflight_tokens
        return _Estimate(member, local, pool, prefill_cost, cost, tie_rank(tie, group))

    def _local(self, group: str, keys: Sequence[bytes], now: float) -> int:
        """How many leading `keys` the group holds: by its events, or sent there within SENT_TTL_S."""
        marks = self.sent.get(group)
        sent = marks.until if marks is not None else {}
        n = 0
        with self.index.lock:
            held = self.index.holds(group)
            for key in keys:
                if key not in held and sent.get(key, 0.0) <= now:
                    break
                n += 1
        return n

    def _marks(self, member: Member) -> SentMarks:
        group = _group(member)
        marks = self.sent.get(group)
        if marks is None:
            marks = self.sent[group] = SentMarks(member.addr, self.sent_ttl_s)
        return marks

    def _retain(self) -> None:
        """Forget the marks of groups gone from the registry or back at another address (a new process:
        its cache starts empty). The index follows the registry on its own (`KVEventReader`)."""
        addrs = {_group(m): m.addr for m in self.directory.members["prefill"].values()}
        for group, marks in list(self.sent.items()):
            if addrs.get(group) != marks.addr:
                del self.sent[group]


def _hit_tokens(estimate: _Estimate, block_size: int, num_tokens: int) -> int:
    """The prompt tokens a worker takes from a cache (its own and the pool's), as the worker counts them:
    a full hit still computes the last token."""
    return min((estimate.local + estimate.pool) * block_size, num_tokens - 1)


def _group(member: Member) -> str:
    return member.group or member.member_id
