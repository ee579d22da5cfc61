"""KV-aware prefill routing (router.prefix_routing): the workers' caches as their KV events tell them (a
shared `KVIndex`, fed here as the reader thread feeds it), the short-lived marks of what this router
sent, the cost that weighs cached prefix against pulls and load, the balance guard, pool locality, the
tie-break every router agrees on, and the metrics of each choice."""

from __future__ import annotations

import time

import pytest

from kvferry.engine.block_hash import block_keys
from kvferry.kvpool.kv_events import CLEARED, REMOVED, STORED, KVEvent, KVIndex
from kvferry.kvpool.metadata import Location
from kvferry.router.directory import Directory, Member, PoolMember
from kvferry.router.metrics import RouterMetrics
from kvferry.router.prefix_routing import PrefillRouting, RoutingConfig, SentMarks, host_of
from kvferry.v1 import worker_pb2

BS = 4
FP = b"fingerprint"


def directory(*workers: tuple[str, str], total_blocks: int = 1000) -> Directory:
    """Prefill workers (id, host), each its own group, with `total_blocks` of KV."""
    d = Directory(meta=None)
    d.model = worker_pb2.WorkerInfo(block_size=BS)
    for member_id, host in workers:
        add(d, member_id, host, total_blocks)
    return d


def add(d: Directory, member_id: str, host: str, total_blocks: int | None = 1000) -> Member:
    beat = {} if total_blocks is None else {"total_blocks": total_blocks}
    member = Member("prefill", member_id, f"{host}:5000", None, None, group=member_id, beat=beat)
    d.members["prefill"][member_id] = member
    return member


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(n)]


def keys_of(ids: list[int]) -> list[bytes]:
    return block_keys(ids, BS, FP)


def pooled(keys: list[bytes], node: str = "pool-0") -> list[Location]:
    return [Location(k, node, i, 1) for i, k in enumerate(keys)]


def send(routing: PrefillRouting, ids: list[int], pool=(), tried=()):
    return routing.choose(keys_of(ids), list(pool), len(ids), set(tried))


def following(d: Directory) -> KVIndex:
    """An index following the directory's prefill workers, each at seq 0 of epoch "e" (as after an empty
    snapshot)."""
    index = KVIndex()
    index.retain({m.group: (m.member_id, m.addr) for m in d.members["prefill"].values()})
    for w in index.workers.values():
        w.epoch, w.exact = "e", True
    return index


def event(index: KVIndex, group: str, kind: str, keys=()) -> None:
    """The next KV event of `group`, as the reader thread applies it."""
    w = index.workers[group]
    assert index.apply(KVEvent(w.worker, group, w.epoch, w.seq + 1, kind, tuple(keys)), time.monotonic())


def test_sent_marks_expire_oldest_first():
    a, b = keys_of(prompt(1, 8)), keys_of(prompt(2, 8))
    marks = SentMarks("h:1", ttl_s=2.0)
    marks.mark(a, now=0.0)
    marks.mark(b, now=1.0)
    marks.mark(a[:1], now=1.5)  # sent again: a[0] lives on
    marks.expire(2.5)
    assert list(marks.until) == [*b, a[0]]
    marks.discard(b)
    marks.expire(10.0)
    assert marks.until == {}


def test_a_shared_prefix_goes_where_it_was_sent_and_the_hit_is_predicted():
    d = directory(("p0", "h0"), ("p1", "h1"))
    routing = PrefillRouting(RoutingConfig(), d)
    first = send(routing, prompt(1, 40))
    assert first.reason == "load" and first.local_tokens == 0 and first.compute_tokens == 40
    follow = prompt(1, 32) + prompt(9, 10)  # the first 8 blocks shared
    again = send(routing, follow)
    assert again.worker is first.worker and again.reason == "prefix"
    assert (again.local_tokens, again.pool_tokens, again.compute_tokens) == (32, 0, 10)
    # the pool holding the same blocks: a local hit still saves the pull, so it still goes there
    later = prompt(1, 36) + prompt(8, 5)
    choice = send(routing, later, pooled(keys_of(later)[:10]))
    assert choice.worker is first.worker and choice.reason == "prefix"
    assert (choice.local_tokens, choice.pool_tokens, choice.compute_tokens) == (36, 4, 1)


def test_a_full_hit_computes_only_the_last_token():
    d = directory(("p0", "h0"))
    routing = PrefillRouting(RoutingConfig(), d)
    ids = prompt(1, 16)  # exactly 4 blocks, all cached: the worker recomputes the last token only
    send(routing, ids)
    choice = send(routing, ids, pooled(keys_of(ids)))
    assert choice.reason == "only_choice"
    assert (choice.local_tokens, choice.pool_tokens, choice.compute_tokens) == (15, 0, 1)
    tail = send(routing, ids + prompt(2, 2), pooled(keys_of(ids)))  # 4 blocks cached + a 2-token tail
    assert (tail.local_tokens, tail.pool_tokens, tail.compute_tokens) == (16, 0, 2)


def test_load_outweighs_a_small_prefix_and_the_balance_guard_caps_a_hot_one():
    d = directory(("p0", "h0"), ("p1", "h1"))
    routing = PrefillRouting(RoutingConfig(balance_abs=4, balance_rel=1.5), d)
    hot, long = prompt(1, 80), prompt(2, 80)
    holder = send(routing, hot).worker
    other = next(m for m in d.members["prefill"].values() if m is not holder)
    send(routing, long, tried={other.member_id})
    holder.inflight, holder.inflight_tokens, other.inflight = 5, 10, 2  # 5 - 2 within balance_abs
    choice = send(routing, hot + prompt(5, 8))
    assert choice.worker is holder and choice.reason == "prefix"
    other.inflight = 0  # 5 - 0 > 4 and 5 > 1.5 x 0: imbalanced, the least loaded wins
    choice = send(routing, hot + prompt(6, 8))
    assert choice.worker is other and choice.reason == "load"
    holder.inflight, holder.inflight_tokens = 1, 200  # one long prefill queued there: 80 saved < 200
    choice = send(routing, long + prompt(7, 8))
    assert choice.worker is other and choice.reason == "load"


def test_pool_blocks_on_a_workers_host_make_it_cheaper():
    d = directory(("p0", "h0"), ("p1", "h1"))
    d.pool_nodes["node-b"] = PoolMember("h1:7000", 0.0, {})
    routing = PrefillRouting(RoutingConfig(), d)
    ids = prompt(3, 30)
    for _ in range(3):  # whichever turn the round robin is at
        choice = send(routing, ids, pooled(keys_of(ids)[:7], "node-b"))
        assert choice.worker.member_id == "p1" and choice.reason == "pool_locality"
        assert (choice.local_tokens, choice.pool_tokens) == (0, 28)
        routing.sent.clear()


def test_cold_prompts_spread_the_same_way_on_every_router_and_unavailable_workers_are_skipped():
    d = directory(("p0", "h"), ("p1", "h"), ("p2", "h"))
    one, two = PrefillRouting(RoutingConfig(), d), PrefillRouting(RoutingConfig(), d)
    cold = [prompt(i, 20) for i in range(12)]
    chosen = [send(one, ids).worker.member_id for ids in cold]
    assert [send(two, ids).worker.member_id for ids in cold] == chosen  # no per-router turn taking
    assert set(chosen) == {"p0", "p1", "p2"}  # distinct prefixes spread over the workers
    d.members["prefill"]["p1"].draining = True
    d.suspect(d.members["prefill"]["p2"], 60)
    only = send(one, prompt(1, 20))
    assert only.worker.member_id == "p0" and only.reason == "only_choice"
    assert send(one, prompt(1, 20), tried={"p0"}) is None


def test_every_router_follows_the_workers_events_not_its_own_sends():
    d = directory(("p0", "h0"), ("p1", "h1"))
    index = following(d)
    first, late = PrefillRouting(RoutingConfig(), d, index), PrefillRouting(RoutingConfig(), d, index)
    ids = prompt(1, 40)
    placed = send(first, ids)
    other = "p1" if placed.worker.member_id == "p0" else "p0"
    event(index, other, STORED, keys_of(ids))  # say the other one computed it (sent by a third router)
    first.sent_ttl_s = late.sent_ttl_s = 0.0  # the first router's own mark has expired
    first.sent.clear()
    follow = ids + prompt(9, 6)
    for routing in (first, late):
        choice = send(routing, follow)
        assert choice.worker.member_id == other and choice.reason == "prefix" and choice.local_tokens == 40
    event(index, other, REMOVED, keys_of(ids)[5:])  # evicted there: only the head is left
    assert send(late, follow).local_tokens == 20
    event(index, other, CLEARED)
    assert send(late, follow).local_tokens == 0


def test_a_burst_follows_the_first_prompt_until_the_events_arrive():
    d = directory(("p0", "h0"), ("p1", "h1"))
    routing = PrefillRouting(RoutingConfig(), d, following(d))
    hot = prompt(3, 40)
    first = send(routing, hot + prompt(4, 8))
    assert send(routing, hot + prompt(5, 8)).worker is first.worker  # the mark: no event yet
    routing.sent[first.worker.member_id].expire(time.monotonic() + routing.sent_ttl_s)
    assert send(routing, hot + prompt(6, 8)).local_tokens == 0  # expired, and the worker never said so


def test_forgets_the_marks_of_failed_prefills_and_of_workers_that_leave_or_come_back_elsewhere():
    d = directory(("p0", "h0"), ("p1", "h1"))
    routing = PrefillRouting(RoutingConfig(), d, following(d))
    ids = prompt(1, 40)
    first = send(routing, ids)
    name = first.worker.member_id
    other = "p0" if name == "p1" else "p1"
    routing.failed(first)
    assert routing.sent[name].until == {}
    assert send(routing, ids, tried={other}).local_tokens == 0  # marked again
    assert send(routing, ids, tried={other}).local_tokens == 39
    del d.members["prefill"][name]
    send(routing, ids)
    assert name not in routing.sent
    routing.sent[name] = SentMarks("h0:1")
    routing.sent[name].mark(keys_of(ids), time.monotonic())
    add(d, name, "h9")  # back, at another address: a new process with an empty cache
    choice = send(routing, ids, tried={other})
    assert choice.local_tokens == 0 and routing.sent[name].addr == "h9:5000"


def test_least_load_mode_ignores_the_caches_but_still_predicts():
    d = directory(("p0", "h0"), ("p1", "h1"))
    routing = PrefillRouting(RoutingConfig(mode="least-load"), d)
    ids = prompt(1, 40)
    first = send(routing, ids)
    first.worker.inflight = 1
    second = send(routing, ids)
    assert second.worker is not first.worker and second.reason == "load" and second.local_tokens == 0
    first.worker.inflight, second.worker.inflight = 0, 1
    third = send(routing, ids)
    assert third.worker is first.worker and third.local_tokens == 39  # a full hit: all but the last token
    with pytest.raises(ValueError, match="routing mode"):
        PrefillRouting(RoutingConfig(mode="random"), d)


def test_host_of():
    assert host_of("10.0.0.1:5000") == "10.0.0.1"
    assert host_of("[::1]:5000") == "::1"


def test_metrics_count_decisions_and_compare_predicted_with_actual_hits():
    d = directory(("p0", "h0"), ("p1", "h1"))
    routing = PrefillRouting(RoutingConfig(), d)
    metrics = RouterMetrics("m", d)
    ids = prompt(1, 40)
    send(routing, ids)
    choice = send(routing, ids, pooled(keys_of(ids)[:2]))
    metrics.routed(choice)
    metrics.prefilled(choice, (39, 0))
    text = metrics.exposition().decode()
    assert 'kvferry:routing_decisions_total{model_name="m",reason="prefix"} 1.0' in text
    assert 'kvferry:routing_decisions_total{model_name="m",reason="pool_locality"} 0.0' in text
    assert 'kvferry:routing_predicted_hit_tokens_sum{model_name="m",source="local"} 39.0' in text
    assert 'kvferry:routing_actual_hit_tokens_sum{model_name="m",source="local"} 39.0' in text
    assert 'kvferry:routing_actual_hit_tokens_sum{model_name="m",source="pool"} 0.0' in text
