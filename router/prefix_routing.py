"""KV-aware choice of the prefill worker: SGLang's cache-aware router and Dynamo's KV router, adapted to a
cluster whose KV pool already shares every full block among the prefill workers.

The router remembers, per prefill worker group, the block keys of the prompts it sent there: a
prediction of that worker's own prefix cache (`engine.block_manager`: full blocks keyed by the hash
chain, LRU over the free ones), bounded by its KV capacity (`total_blocks` of its registry record) and
evicted in the same order (a prompt's tail blocks before its head). A key names its whole prefix, so a
prompt's expected local hit on a worker is the run of its leading keys found in that worker's record.

A candidate (live, not draining, not suspect, not tried yet for this request) costs, in prompt tokens:
the tokens it must compute, plus the pool blocks it pulls at `pull_cost` a token (`same_host_pull_cost`
from a pool node on its own host), plus the tokens of the prefills it has in flight (its queue). So a
local hit beyond the pool's prefix saves a whole token of compute, a local hit the pool also holds saves
only the pull, and a pool hit, open to every worker, decides nothing except by locality. The cheapest
wins (fewest in flight, then round robin, among equals). When the in-flight counts are imbalanced beyond
both `balance_abs` and `balance_rel` (SGLang's thresholds), the least-loaded worker wins outright, so a
hot prefix cannot pile up on one worker.

The record is written when a prefill is sent (a burst sharing a prefix follows the first one there), the
keys of a prefill that failed are dropped from it, and a worker that left the registry, or came back at
another address (a new process, an empty cache), is forgotten. Mode `least-load` keeps the records and
the predictions (for the metrics) but picks as `router.failover.pick_excluding` does.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvferry.kvpool.metadata import Location
from kvferry.router.config import ROUTING_MODES
from kvferry.router.directory import Directory, Member
from kvferry.router.failover import pick_excluding

REASONS = ("prefix", "pool_locality", "load", "only_choice")
# the record bound of a worker whose registry record reports no `total_blocks` (prefill workers report it)
DEFAULT_CAPACITY_BLOCKS = 4096


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
    keys: tuple[bytes, ...]  # the prompt's full-block keys, recorded for the worker


@dataclass(frozen=True)
class _Estimate:
    member: Member
    local: int  # blocks
    pool: int  # blocks
    prefill_cost: float  # tokens computed + pulled (weighted), without the queue
    cost: float  # prefill_cost + the tokens in flight there


class CacheRecord:
    """The block keys sent to one worker group (a prediction of its prefix cache), least recently used
    first, at most `capacity`. Keys are hash-chained: a key found means its whole prefix was sent."""

    def __init__(self, addr: str, capacity: int):
        self.addr = addr
        self.capacity = max(1, capacity)
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the record holds."""
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n

    def add(self, keys: Sequence[bytes]) -> None:
        """Record (or refresh) a prompt's keys, its head most recent, as the worker's cache frees a
        request's blocks tail first; then evict the least recently used beyond the capacity."""
        for key in reversed(keys):
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def discard(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.keys.pop(key, None)


def host_of(addr: str) -> str:
    """The host of "host:port" ("[v6]:port" too)."""
    return addr.rsplit(":", 1)[0].strip("[]")


class PrefillRouting:
    """Chooses the prefill worker of each prompt (`choose`) and keeps the per-worker records."""

    def __init__(self, cfg: RoutingConfig, directory: Directory):
        if cfg.mode not in ROUTING_MODES:
            raise ValueError(f"routing mode {cfg.mode!r}: expected one of {', '.join(ROUTING_MODES)}")
        self.cfg = cfg
        self.directory = directory
        self.records: dict[str, CacheRecord] = {}  # worker group -> its record
        self._rr = itertools.count()

    def choose(
        self, keys: Sequence[bytes], pooled: Sequence[Location], num_tokens: int, tried: Collection[str]
    ) -> Choice | None:
        """The prefill worker for a prompt of `num_tokens` tokens whose full-block keys are `keys` and
        whose leading blocks the pool holds at `pooled`, among those not in `tried`; None when none is
        left. Its record takes the keys now (`failed` takes them back)."""
        self._retain()
        candidates = sorted(self.directory.available("prefill", tried), key=lambda m: m.member_id)
        if not candidates:
            return None
        block_size = self.directory.model.block_size
        usable = num_tokens // block_size  # every full block can hit: a full hit computes the last token
        estimates = [self._estimate(m, keys, pooled, usable, num_tokens) for m in candidates]
        if self.cfg.mode == "least-load":
            chosen = pick_excluding(self.directory, "prefill", set(tried))
            best = next((e for e in estimates if e.member is chosen), None)
            if best is None:
                return None
            reason = "load" if len(estimates) > 1 else "only_choice"
        else:
            best, reason = self._best(estimates)
        record = self._record(best.member)
        record.add(keys)
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
        for it (its expected local hit and the pool's taken off): what `choose` weighs, nothing recorded
        (SLO admission prices the prompt on each, router.slo)."""
        self._retain()
        block_size = self.directory.model.block_size
        usable = num_tokens // block_size
        return [
            (
                m,
                num_tokens
                - _hit_tokens(self._estimate(m, keys, pooled, usable, num_tokens), block_size, num_tokens),
            )
            for m in self.directory.available("prefill")
        ]

    def failed(self, choice: Choice) -> None:
        """The prefill sent to `choice.worker` failed: it may not hold the prompt's blocks."""
        record = self.records.get(_group(choice.worker))
        if record is not None:
            record.discard(choice.keys)

    def _best(self, estimates: list[_Estimate]) -> tuple[_Estimate, str]:
        if len(estimates) == 1:
            return estimates[0], "only_choice"
        turn = next(self._rr)
        order = {id(e): (i - turn) % len(estimates) for i, e in enumerate(estimates)}
        loads = [e.member.inflight for e in estimates]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.cfg.balance_abs and hi > self.cfg.balance_rel * lo:
            least = min(estimates, key=lambda e: (e.member.inflight, e.member.inflight_tokens, order[id(e)]))
            return least, "load"
        best = min(estimates, key=lambda e: (e.cost, e.member.inflight, order[id(e)]))
        cheapest = min(e.prefill_cost for e in estimates)
        if best.prefill_cost > cheapest or all(e.prefill_cost == cheapest for e in estimates):
            return best, "load"  # the queues outweighed the caches, or the caches are all alike
        if best.local > min(e.local for e in estimates):
            return best, "prefix"
        return best, "pool_locality"

    def _estimate(
        self, member: Member, keys: Sequence[bytes], pooled: Sequence[Location], usable: int, num_tokens: int
    ) -> _Estimate:
        record = self.records.get(_group(member))
        local = min(record.match(keys[:usable]) if record is not None else 0, usable)
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
        return _Estimate(member, local, pool, prefill_cost, prefill_cost + member.inflight_tokens)

    def _record(self, member: Member) -> CacheRecord:
        group = _group(member)
        record = self.records.get(group)
        capacity = int(member.beat.get("total_blocks") or 0) or DEFAULT_CAPACITY_BLOCKS
        if record is None:
            record = self.records[group] = CacheRecord(member.addr, capacity)
        record.capacity = capacity
        return record

    def _retain(self) -> None:
        """Forget the records of groups gone from the registry or back at another address (a new
        process: its cache starts empty)."""
        addrs = {_group(m): m.addr for m in self.directory.members["prefill"].values()}
        for group, record in list(self.records.items()):
            if addrs.get(group) != record.addr:
                del self.records[group]


def _hit_tokens(estimate: _Estimate, block_size: int, num_tokens: int) -> int:
    """The prompt tokens a worker takes from a cache (its own and the pool's), as the worker counts them:
    a full hit still computes the last token."""
    return min((estimate.local + estimate.pool) * block_size, num_tokens - 1)


def _group(member: Member) -> str:
    return member.group or member.member_id
