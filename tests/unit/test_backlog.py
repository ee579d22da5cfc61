"""A prefill worker's published backlog and the router's use of it (SLO admission with N routers): the
figures per priority, the publisher's throttle and keepalive on a real redis-server, the router reading
them, and the merge of the published figure with this router's own prefills not reflected yet."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from kvferry.engine.cost_model import StepCost
from kvferry.engine.request import Request, RequestStatus, SamplingParams
from kvferry.kvpool.metadata import MetadataStore
from kvferry.router import slo
from kvferry.router.backlog import PublishedBacklog, Work
from kvferry.router.config import RouterConfig
from kvferry.router.directory import Directory
from kvferry.worker import backlog as worker_backlog
from kvferry.worker.backlog import BacklogPublisher, BacklogTracker


def request(rid: str, tokens: int, priority: int = 0, computed: int = 0, status=RequestStatus.WAITING):
    req = Request(rid, [1] * tokens, SamplingParams(max_tokens=1), priority=priority)
    req.num_computed_tokens, req.status = computed, status
    return req


class Worker:
    """What the tracker reads off a worker: the calls it holds and its engine's step count."""

    def __init__(self, budget: int = 100):
        self.held: set[str] = set()
        self.steps = 0
        self.tracker = BacklogTracker(budget, self.held.__contains__, lambda: self.steps)

    def admit(self, req: Request, cached: int = 0) -> Request:
        self.tracker.admitted(req, cached)
        self.held.add(req.request_id)
        return req


def test_the_figures_are_the_tokens_left_to_compute_per_priority_queued_and_running():
    w = Worker(budget=100)
    w.admit(request("a", 250), cached=64)  # queued: the pool's 64 are pulled, 186 computed in 2 steps
    w.admit(request("b", 40, status=RequestStatus.PREEMPTED))
    w.admit(request("c", 300, computed=120, status=RequestStatus.RUNNING))  # 180 left, after 120
    w.admit(request("low", 30, priority=5))
    w.admit(request("done", 50, status=RequestStatus.FINISHED_STOPPED))
    w.admit(request("computed", 50, computed=50, status=RequestStatus.RUNNING))  # its KV write: none left
    record = w.tracker.snapshot()
    queued, running = record["p"]["0"]["q"], record["p"]["0"]["r"]
    a, b = (186, 64), (40, 0)  # (tokens, after)
    assert queued[:3] == [186 + 40, 2, 2 + 1]
    assert queued[3] == pytest.approx(sum(n * c + n * (n + 1) / 2 for n, c in (a, b)) / 1e3, abs=1e-3)
    assert running[:3] == [180, 1, 2] and running[3] == pytest.approx((180 * 120 + 180 * 181 / 2) / 1e3)
    assert record["p"]["5"] == {"q": [30, 1, 1, pytest.approx(0.465)], "r": [0, 0, 0, 0.0]}
    # every admitted id is published (a router's own prefill is matched against them)
    admitted = ["a", "b", "c", "low", "done", "computed"]
    assert set(record["ids"]) == {worker_backlog.request_digest(r) for r in admitted}
    assert slo.request_digest("a") == worker_backlog.request_digest("a")  # router and worker agree
    # the cost of the figures is what the router would price the same prompts at, one by one
    cost = StepCost(2.0, 0.05, 0.004)
    parsed = PublishedBacklog.parse(json.loads(json.dumps(record)))
    one_by_one = cost.prompt_ms(186, 100, 64) + cost.prompt_ms(40, 100) + cost.prompt_ms(180, 100, 120)
    assert slo.backlog_ms(parsed, cost, 0) == pytest.approx(one_by_one, rel=1e-3)


def test_requests_the_worker_no_longer_holds_leave_the_figures(monkeypatch):
    w = Worker()
    w.admit(request("a", 50))
    w.tracker.admitted(request("new", 20))  # admitted, its call not held yet: counted meanwhile
    assert w.tracker.snapshot()["p"]["0"]["q"][:2] == [70, 2]
    w.held.discard("a")  # cancelled before the engine took it: never finished there
    clock = time.monotonic() + worker_backlog.HOLD_GRACE_S + 0.5
    monkeypatch.setattr(worker_backlog.time, "monotonic", lambda: clock)
    assert w.tracker.snapshot()["p"] == {}
    assert w.tracker._held == {}
    clock += worker_backlog.RECENT_S
    assert w.tracker.snapshot()["ids"] == []  # admitted long ago: no longer published


def test_the_figures_follow_a_real_engine_step_by_step(make_engine):
    engine = make_engine(max_num_batched_tokens=32, num_kv_blocks=64)
    tracker = BacklogTracker(32, lambda rid: True, lambda: engine.num_steps)
    for rid, ids, priority in (("a", range(1, 41), 0), ("b", range(100, 120), 1)):
        req = engine.make_request(None, SamplingParams(max_tokens=1), list(ids), rid, priority=priority)
        engine.submit(req)
        tracker.admitted(req)
    assert tracker.changed()
    record = tracker.snapshot()
    assert record["p"]["0"]["q"][:3] == [40, 1, 2] and record["p"]["1"]["q"][:3] == [20, 1, 1]
    engine.step()  # a's first chunk: 32 of its 40 tokens
    assert tracker.changed() and not tracker.changed()
    record = tracker.snapshot()
    assert record["p"]["0"]["r"][:2] == [8, 1] and record["p"]["0"]["q"][:2] == [0, 0]
    while engine.has_unfinished():
        engine.step()
    assert tracker.snapshot()["p"] == {}


def test_the_publisher_writes_on_change_at_most_every_interval_and_keeps_alive(redis_url):
    store = MetadataStore(redis_url, "pub")
    w = Worker()
    publisher = BacklogPublisher(store, "p1", w.tracker, interval_s=0.05, keepalive_s=0.3)
    assert publisher.publish()  # the first
    assert not publisher.publish()  # nothing changed
    w.admit(request("a", 100))
    assert publisher.publish()
    value = store.client.hget(f"{store.prefix}prefill_backlog", "p1")
    record = PublishedBacklog.parse(json.loads(value))
    assert record.levels[0][0] == Work(100, 1, 1, pytest.approx(5.05)) and record.boot == w.tracker.boot
    w.steps += 1  # a step that changed nothing: no write
    assert not publisher.publish()

    publisher.start()
    stop = time.monotonic() + 1.0
    while time.monotonic() < stop:  # the figure changes all the time: written at most every 50 ms
        w.steps += 1
        w.admit(request(f"r{w.steps}", 10))
        time.sleep(0.002)
    writes = publisher.writes
    assert 8 <= writes - 2 <= 1.0 / 0.05 + 2
    time.sleep(1.0)  # nothing changes: the keepalive alone (every 0.3 s)
    assert 2 <= publisher.writes - writes <= 5
    publisher.stop()
    assert store.client.hget(f"{store.prefix}prefill_backlog", "p1") is None


def test_the_directory_keeps_the_newest_record_and_skips_malformed_ones(redis_url):
    store = MetadataStore(redis_url, "dir")
    directory = Directory(store)
    member = SimpleNamespace(member_id="p1", backlog=None, backlog_at=0.0)
    directory.members["prefill"]["p1"] = member
    w = Worker()
    publisher = BacklogPublisher(store, "p1", w.tracker)
    w.admit(request("a", 100))
    older = w.tracker.snapshot()  # e.g. the heartbeat's, taken before the publisher's
    publisher.publish()
    asyncio.run(directory.read_backlogs())
    assert member.backlog.levels[0][0].tokens == 100 and member.backlog.seq == older["s"] + 1
    directory._take_backlog(member, older)  # the heartbeat's record is older: not taken
    assert member.backlog.seq == older["s"] + 1
    newer = w.tracker.snapshot()
    directory._take_backlog(member, newer)  # a newer one (the heartbeat's, the fast channel stuck)
    assert member.backlog.seq == newer["s"]
    for bad in (
        "{",
        {"b": "x", "s": 9e9, "t": 1, "p": {}},
        {**newer, "s": 10**6, "p": {"0": {"q": [1, -1, 0, 0]}}},
    ):
        directory._take_backlog(member, bad)
    assert member.backlog.seq == newer["s"]
    # another process under the same id (a restart): its record is the later one
    time.sleep(0.01)
    restarted = BacklogTracker(100, lambda rid: True, lambda: 0)
    directory._take_backlog(member, restarted.snapshot())
    assert member.backlog.boot == restarted.boot and member.backlog.levels == {}


def predictor() -> slo.SloPredictor:
    """A router's SLO predictor alone (priced with COST, a prefill worker's known cost)."""
    return slo.SloPredictor(RouterConfig(), directory=None, routing=None, metrics=None)


COST = StepCost(fixed_ms=1.0, per_token_ms=0.1, per_kpair_ms=0.0)


def published(levels: dict, ids=(), age_s: float = 0.0) -> SimpleNamespace:
    backlog = PublishedBacklog("boot", 1, time.time(), levels, frozenset(slo.request_digest(i) for i in ids))
    return SimpleNamespace(member_id="w", backlog=backlog, backlog_at=time.monotonic() - age_s)


def test_the_router_adds_its_own_prefills_the_record_does_not_show_yet(monkeypatch):
    router = predictor()
    # the worker: 1000 tokens queued at priority 0 in 2 steps (102 ms), 100 running at priority 3 (11 ms)
    levels = {0: (Work(1000, 2, 2, 0.0), Work()), 3: (Work(100, 1, 0, 0.0), Work(100, 1, 1, 0.0))}
    router.prefill_queues.add("w", "mine", priority=0, cost_ms=50.0)
    router.prefill_queues.add("w", "lower", priority=4, cost_ms=500.0)
    fresh = published(levels)
    # the record does not show "mine" yet (a burst between two records): it counts on top
    assert router.prefill_wait_ms(fresh, COST, 0) == pytest.approx(102 + 11 + 50)
    # "lower" is not running there yet: it does not count; a lower level's queued work neither
    assert router.prefill_wait_ms(fresh, COST, 3) == pytest.approx(102 + 10 + 11 + 50)
    # the record shows it (its id among those admitted): counted once, in the figures
    assert router.prefill_wait_ms(published(levels, ids=["mine"]), COST, 0) == pytest.approx(113)
    # sent longer ago than the window: it has reached the worker, whose figures hold it while it computes
    later = time.monotonic() + slo.LOCAL_WINDOW_S + 0.1
    monkeypatch.setattr(slo.time, "monotonic", lambda: later)
    assert router.prefill_wait_ms(published(levels), COST, 0) == pytest.approx(113)
    monkeypatch.undo()
    # answered: gone from the router's own
    router.prefill_ended(SimpleNamespace(request_id="mine"), fresh)
    assert router.prefill_wait_ms(fresh, COST, 0) == pytest.approx(113)


def test_a_stale_or_missing_record_falls_back_to_this_routers_own_prefills():
    router = predictor()
    router.prefill_queues.add("w", "mine", priority=0, cost_ms=50.0)
    router.prefill_queues.add("w", "lower", priority=4, cost_ms=500.0)
    levels = {0: (Work(1000, 2, 2, 0.0), Work())}
    stale = published(levels, age_s=slo.BACKLOG_STALE_S + 1)
    assert router.prefill_wait_ms(stale, COST, 0) == pytest.approx(50 + 500)  # as one router alone sees it
    none = SimpleNamespace(member_id="w", backlog=None, backlog_at=0.0)
    assert router.prefill_wait_ms(none, COST, 0) == pytest.approx(550)
    assert router.prefill_wait_ms(published(levels, age_s=1.0), COST, 0) == pytest.approx(102 + 50)


def test_two_routers_see_the_same_backlog(redis_url):
    """Each router sent half of the worker's prefills; with the published record both price all of them
    (each without its own prefill twice), where alone each would see half."""
    store = MetadataStore(redis_url, "two")
    w = Worker(budget=1000)
    routers = [predictor(), predictor()]
    for i in range(6):
        rid = f"r{i}"
        routers[i % 2].prefill_queues.add("p1", rid, priority=0, cost_ms=COST.prompt_ms(200, 1000))
        w.admit(request(rid, 200))
    BacklogPublisher(store, "p1", w.tracker).publish()
    views = []
    for router in routers:
        directory = Directory(store)
        member = SimpleNamespace(member_id="p1", backlog=None, backlog_at=0.0)
        directory.members["prefill"]["p1"] = member
        asyncio.run(directory.read_backlogs())
        views.append(router.prefill_wait_ms(member, COST, 0))
        assert router.prefill_queues.wait_ms("p1", 0) == pytest.approx(3 * COST.prompt_ms(200, 1000))
    assert views[0] == pytest.approx(views[1]) == pytest.approx(6 * COST.prompt_ms(200, 1000))
