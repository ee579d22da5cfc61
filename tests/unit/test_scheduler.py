"""Scheduler + BlockManager driven by fake model outputs: budget, chunked prefill, caps, preemption."""

from __future__ import annotations

import random

from kvferry.engine.block_hash import model_fingerprint
from kvferry.engine.block_manager import BlockManager
from kvferry.engine.request import Request, RequestStatus, SamplingParams
from kvferry.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig

BS = 4
FP = model_fingerprint("unit-test-model", "float32")


def make_req(rid: str, n: int, base: int, max_tokens: int = 3) -> Request:
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens))


class Driver:
    """Runs schedule -> fake model -> update, checking the caps on every step."""

    def __init__(self, num_blocks: int = 16, max_num_seqs: int = 256, budget: int = 2048, caching=True):
        self.bm = BlockManager(num_blocks, BS, FP, enable_caching=caching)
        self.cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
        self.sched = Scheduler(self.cfg, self.bm)
        self.admitted: list[str] = []  # request ids in the order they first ran
        self.finished: list[Request] = []
        self.on_batch = lambda batch: None  # called between schedule() and the fake model's update

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.sched.add(r)

    def step(self) -> ScheduledBatch:
        batch = self.sched.schedule()
        assert batch.num_tokens <= self.cfg.max_num_batched_tokens
        assert len(self.sched.running) <= self.cfg.max_num_seqs
        assert all(n > 0 for _, n in batch.work)
        assert len({id(r) for r, _ in batch.work}) == len(batch.work)
        for req, _ in batch.work:
            if req.request_id not in self.admitted:
                self.admitted.append(req.request_id)
        self.on_batch(batch)
        for req in self.sched.update(batch):
            assert req.num_computed_tokens == req.num_tokens
            req.output_token_ids.append(9000 + len(req.output_token_ids))
            if len(req.output_token_ids) >= req.params.max_tokens:
                self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
                self.finished.append(req)
        self.bm.check_invariants()
        for req in self.sched.running:
            assert len(req.block_ids) == self.bm.blocks_needed(req.num_computed_tokens)
        return batch

    def run(self, max_steps: int = 200) -> list[ScheduledBatch]:
        batches = []
        while self.sched.has_unfinished():
            batches.append(self.step())
            assert len(batches) < max_steps, "scheduler made no progress"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        return batches


def test_chunked_prefill_splits_long_prompt_into_budget_sized_chunks():
    d = Driver(budget=8)
    req = make_req("long", 20, base=0, max_tokens=2)
    d.add(req)
    b1 = d.step()
    assert b1.work == [(req, 8)] and req.num_computed_tokens == 8 and req.output_token_ids == []
    b2 = d.step()
    assert b2.work == [(req, 8)] and req.num_computed_tokens == 16 and req.output_token_ids == []
    b3 = d.step()
    assert b3.work == [(req, 4)] and len(req.output_token_ids) == 1
    assert d.step().work == [(req, 1)]
    assert req.status == RequestStatus.FINISHED_LENGTH and len(req.output_token_ids) == 2
    assert not d.sched.has_unfinished()


def test_budget_never_exceeded_and_fills_up_with_waiting_prompts():
    d = Driver(num_blocks=64, budget=10)
    reqs = [make_req(f"r{i}", n, base=100 * i, max_tokens=4) for i, n in enumerate([3, 17, 6, 11, 2, 9])]
    d.add(*reqs)
    batches = d.run()
    assert all(b.num_tokens <= 10 for b in batches)
    assert max(b.num_tokens for b in batches) == 10  # the budget is used, not just respected
    assert batches[0].work == [(reqs[0], 3), (reqs[1], 7)]  # second prompt chunked to the remaining 7
    assert all(r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 4 for r in reqs)
    total = sum(b.num_tokens for b in batches)
    assert total == sum(r.num_prompt_tokens + 3 for r in reqs)  # prompts + decodes, nothing recomputed


def test_running_decodes_are_scheduled_before_new_prompts():
    d = Driver(num_blocks=64, budget=6)
    a, b = make_req("a", 4, base=0, max_tokens=5), make_req("b", 20, base=100)
    d.add(a)
    d.step()
    d.add(b)
    batch = d.step()
    assert batch.work == [(a, 1), (b, 5)]


def test_max_num_seqs_caps_running():
    d = Driver(num_blocks=64, max_num_seqs=2)
    reqs = [make_req(f"r{i}", 5, base=10 * i) for i in range(5)]
    d.add(*reqs)
    first = d.step()
    assert [r for r, _ in first.work] == reqs[:2]
    assert d.sched.running == reqs[:2] and list(d.sched.waiting) == reqs[2:]
    d.run()  # Driver.step asserts len(running) <= 2 on every step
    assert all(len(r.output_token_ids) == 3 for r in reqs)


def test_fcfs_admission_and_no_overtaking_when_head_does_not_fit():
    d = Driver(num_blocks=8, budget=64)
    a = make_req("a", 24, base=0, max_tokens=1)  # 6 blocks
    big = make_req("big", 12, base=100, max_tokens=1)  # 3 blocks: does not fit next to a
    small = make_req("small", 3, base=200, max_tokens=1)  # 1 block: would fit, must not overtake
    d.add(a, big, small)
    first = d.step()
    assert [r for r, _ in first.work] == [a]
    assert list(d.sched.waiting) == [big, small]
    d.run()
    assert d.admitted == ["a", "big", "small"]


def test_fcfs_order_over_many_requests():
    d = Driver(num_blocks=12, max_num_seqs=3, budget=16)
    reqs = [make_req(f"r{i}", 3 + (7 * i) % 9, base=50 * i) for i in range(8)]
    d.add(*reqs)
    d.run()
    assert d.admitted == [r.request_id for r in reqs]


def test_preempts_most_recently_admitted_and_it_resumes():
    d = Driver(num_blocks=6, max_num_seqs=3, budget=64)
    a = make_req("a", 7, base=100)  # 2 blocks, room for one more token
    b = make_req("b", 8, base=200)  # 2 full blocks: its first decode needs a 3rd
    c = make_req("c", 8, base=300)
    late = make_req("late", 4, base=400)
    d.add(a, b, c, late)
    first = d.step()
    assert [r for r, _ in first.work] == [a, b, c] and d.bm.num_free_blocks == 0
    assert list(d.sched.waiting) == [late]

    second = d.step()  # b needs a block: c, the last admitted, is preempted for it
    assert second.preempted == [c]
    assert second.work == [(a, 1), (b, 1)]
    assert c.status == RequestStatus.PREEMPTED and c.num_preemptions == 1
    assert c.block_ids == [] and c.num_computed_tokens == 0
    assert list(d.sched.waiting) == [c, late]  # back at the front
    assert d.sched.running == [a, b]
    assert len(c.output_token_ids) == 1  # its generated token is kept and recomputed

    third = d.step()  # a and b decode and finish; c (at the head) does not fit yet, late must wait
    assert third.work == [(a, 1), (b, 1)] and not third.preempted
    assert list(d.sched.waiting) == [c, late]
    fourth = d.step()  # c resumes first: its old blocks were reused, so 8 prompt + 1 output recomputed
    assert fourth.work == [(c, 9), (late, 4)]
    assert c.status == RequestStatus.RUNNING and c.num_cached_tokens == 0
    d.run()
    assert all(r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 3 for r in (a, b, c))
    assert late.status == RequestStatus.FINISHED_LENGTH
    assert c.num_preemptions == 1 and a.num_preemptions == b.num_preemptions == 0


def test_preempted_request_recomputes_prompt_and_outputs():
    d = Driver(num_blocks=6, max_num_seqs=3, budget=64, caching=False)
    a, b, c = make_req("a", 7, base=100), make_req("b", 8, base=200), make_req("c", 8, base=300)
    d.add(a, b, c)
    d.step()
    assert d.step().preempted == [c]
    while c.status == RequestStatus.PREEMPTED:
        batch = d.step()
    assert (c, 9) in batch.work  # 8 prompt tokens + its 1 output token, from scratch
    d.run()
    assert len(c.output_token_ids) == 3


def test_last_running_request_preempts_itself_when_nothing_else_can_go():
    d = Driver(num_blocks=4, budget=64)
    a, b = make_req("a", 7, base=0), make_req("b", 8, base=100)
    d.add(a, b)
    d.step()
    batch = d.step()
    assert batch.preempted == [b] and batch.work == [(a, 1)]
    assert b.status == RequestStatus.PREEMPTED and list(d.sched.waiting) == [b]
    d.run()
    assert len(a.output_token_ids) == 3 and len(b.output_token_ids) == 3


def test_preempted_request_resumes_from_its_still_cached_prefix():
    d = Driver(num_blocks=5, budget=64)
    a = make_req("a", 8, base=0, max_tokens=2)  # blocks 0-1, full: its first decode needs a 3rd block
    b = make_req("b", 11, base=100)  # 3 blocks, the last partial
    d.add(a, b)
    d.step()
    second = d.step()
    assert second.preempted == [b] and second.work == [(a, 1)]
    assert a.status == RequestStatus.FINISHED_LENGTH  # finished in that step, freeing its blocks
    third = d.step()  # b's two full prompt blocks survived (a took b's keyless tail block)
    assert third.work == [(b, 12 - 8)]
    assert b.num_computed_tokens == 12
    d.run()
    assert len(b.output_token_ids) == 3 and b.num_preemptions == 1


def test_random_workload_keeps_kv_consistent_and_leaks_nothing():
    """Simulated KV contents: every computed position of a running request holds that request's token."""
    rng = random.Random(0)
    d = Driver(num_blocks=10, max_num_seqs=4, budget=12)
    kv = {b: [None] * BS for b in range(10)}
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(2)]
    reqs = []
    for i in range(30):
        tail = [rng.randrange(50) for _ in range(rng.randint(0, 5))]
        prompt = rng.choice(prefixes)[: rng.randint(3, 12)] + tail
        reqs.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 6))))
    d.add(*reqs)

    full_hits = []

    def write_kv(batch: ScheduledBatch) -> None:
        """What the model runner writes: a position in a block taken from the prefix cache (a full
        hit's last token) goes to the sink, so here it must already hold that token."""
        for req, n in batch.work:
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                slot = req.block_ids[pos // BS], pos % BS
                if pos < req.num_committed_blocks * BS:
                    assert (
                        n == 1
                        and pos == req.num_tokens - 1
                        and kv[slot[0]][slot[1]] == req.all_token_ids[pos]
                    )
                    full_hits.append(req)
                else:
                    kv[slot[0]][slot[1]] = req.all_token_ids[pos]

    d.on_batch = write_kv
    for _ in range(1000):
        if not d.sched.has_unfinished():
            break
        d.step()
        for req in d.sched.running:
            for pos in range(req.num_computed_tokens):
                assert kv[req.block_ids[pos // BS]][pos % BS] == req.all_token_ids[pos], req.request_id
        if d.sched.running and rng.random() < 0.05:
            d.sched.finish(rng.choice(d.sched.running), RequestStatus.FINISHED_ABORTED)
    assert not d.sched.has_unfinished() and all(r.is_finished for r in reqs)
    assert d.bm.num_free_blocks == d.bm.num_blocks
    assert any(r.num_preemptions for r in reqs) and d.bm.hits > 0 and full_hits  # every path was exercised


def test_full_prefix_hit_computes_only_the_last_token_inside_the_cached_blocks():
    d = Driver(num_blocks=8)
    a = make_req("a", 8, base=0, max_tokens=1)
    d.add(a)
    d.run()
    cached = [d.bm.cached[key] for key in a.block_keys[:2]]
    again = make_req("again", 8, base=0, max_tokens=2)  # every token cached: 2 full blocks
    d.add(again)
    first = d.step()
    assert first.work == [(again, 1)] and again.output_token_ids == [9000]
    assert again.num_cached_tokens == 7 and again.num_committed_blocks == 2
    assert again.block_ids == cached  # no block of its own for the prompt: the last token writes none
    d.step()  # its first decode (position 8) takes a fresh block
    assert again.is_finished and len(again.output_token_ids) == 2
    assert d.bm.hits == 7


def test_prompt_with_a_partial_tail_computes_the_tail_after_all_full_blocks():
    d = Driver(num_blocks=8)
    d.add(make_req("a", 8, base=0, max_tokens=1))
    d.run()
    one, three = make_req("one", 9, base=0), make_req("three", 11, base=0)
    d.add(one, three)
    batch = d.step()
    assert batch.work == [(one, 1), (three, 3)]
    assert one.num_cached_tokens == three.num_cached_tokens == 8
    assert one.block_ids[:2] == three.block_ids[:2] and one.block_ids[2] != three.block_ids[2]
    d.run()


# -- priorities (lower value first; a strictly lower priority may be preempted) -------------------------
def make_prio(rid: str, n: int, base: int, priority: int, max_tokens: int = 3) -> Request:
    req = make_req(rid, n, base, max_tokens)
    req.priority = priority
    return req


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    d = Driver(num_blocks=64, max_num_seqs=1)
    low, mid_a, high, mid_b = (
        make_prio("low", 4, 0, 5),
        make_prio("mid_a", 4, 100, 1),
        make_prio("high", 4, 200, -2),
        make_prio("mid_b", 4, 300, 1),
    )
    d.add(low, mid_a, high, mid_b)
    assert list(d.sched.waiting) == [high, mid_a, mid_b, low]
    d.run()
    assert d.admitted == ["high", "mid_a", "mid_b", "low"]


def test_higher_priority_arrival_preempts_a_lower_one_for_a_seat():
    d = Driver(num_blocks=64, max_num_seqs=2)
    a, b = make_prio("a", 4, 0, 1, max_tokens=6), make_prio("b", 4, 100, 1, max_tokens=6)
    d.add(a, b)
    d.step()
    urgent = make_prio("urgent", 4, 200, 0, max_tokens=2)
    d.add(urgent)
    batch = d.step()  # b (the later of the two at priority 1) gives its seat: it was in this step's batch
    assert batch.preempted == [b] and [r for r, _ in batch.work] == [a, urgent]
    assert (urgent, 4) in batch.work and b.status == RequestStatus.PREEMPTED and b.block_ids == []
    assert d.sched.num_priority_preemptions == 1 and list(d.sched.waiting) == [b]
    d.run()
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in (a, b, urgent))
    assert urgent.is_finished and b.num_preemptions == 1 and a.num_preemptions == 0


def test_higher_priority_arrival_preempts_for_kv_blocks_and_the_victim_recomputes():
    d = Driver(num_blocks=4, budget=64, caching=False)
    low = make_prio("low", 12, 0, 3, max_tokens=3)  # 3 blocks of 4
    d.add(low)
    d.step()
    high = make_prio("high", 8, 100, 0, max_tokens=2)  # 2 blocks: only one is free
    d.add(high)
    batch = d.step()
    assert batch.preempted == [low] and batch.work == [(high, 8)]
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert len(low.output_token_ids) == 1  # its token is kept and recomputed with the prompt
    d.run()
    assert len(high.output_token_ids) == 2 and len(low.output_token_ids) == 3
    assert d.sched.num_priority_preemptions == 1


def test_equal_priorities_never_preempt_each_other_for_admission():
    d = Driver(num_blocks=4, budget=64)
    first = make_prio("first", 12, 0, 0, max_tokens=2)
    d.add(first)
    d.step()
    second = make_prio("second", 8, 100, 0, max_tokens=2)
    d.add(second)
    batch = d.step()
    assert not batch.preempted and batch.work == [(first, 1)]
    assert list(d.sched.waiting) == [second]
    d.run()
    assert d.sched.num_priority_preemptions == 0 and d.admitted == ["first", "second"]


def test_out_of_blocks_the_lowest_priority_running_request_is_preempted_first():
    d = Driver(num_blocks=6, max_num_seqs=3, budget=64)
    a = make_prio("a", 7, 100, 2)  # 2 blocks, room for one more token
    b = make_prio("b", 8, 200, 0)  # 2 full blocks: its first decode needs a 3rd
    c = make_prio("c", 8, 300, 1)
    d.add(a, b, c)
    first = d.step()
    assert [r for r, _ in first.work] == [b, c, a] and d.bm.num_free_blocks == 0
    second = d.step()  # b needs a block: a, the lowest priority, goes (not c, the last admitted)
    assert second.preempted == [a] and second.work == [(b, 1), (c, 1)]
    d.run()
    assert all(len(r.output_token_ids) == 3 for r in (a, b, c))


def test_a_preempted_request_keeps_its_place_among_its_priority():
    d = Driver(num_blocks=64, max_num_seqs=1)
    old = make_prio("old", 4, 0, 1, max_tokens=4)
    d.add(old)
    d.step()
    newer = make_prio("newer", 4, 100, 1, max_tokens=1)
    d.add(newer)
    vip = make_prio("vip", 4, 200, 0, max_tokens=1)
    d.add(vip)
    d.step()  # vip takes old's seat; old (arrived before newer) waits ahead of newer
    assert old.status == RequestStatus.PREEMPTED and list(d.sched.waiting) == [old, newer]
    d.run()
    assert d.admitted == ["old", "vip", "newer"] and len(old.output_token_ids) == 4


def test_random_prioritised_workload_finishes_everything_and_leaks_nothing():
    rng = random.Random(1)
    d = Driver(num_blocks=10, max_num_seqs=3, budget=12)
    reqs = []
    for _ in range(300):
        if len(reqs) < 40 and rng.random() < 0.6:
            n, priority, max_tokens = rng.randint(1, 14), rng.randint(-2, 2), rng.randint(1, 8)
            req = make_prio(f"r{len(reqs)}", n, 100 * len(reqs), priority, max_tokens)
            reqs.append(req)
            d.add(req)
        if d.sched.has_unfinished():
            d.step()
            order = [Scheduler.order(r) for r in d.sched.waiting]
            assert order == sorted(order)
    d.run(max_steps=1000)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    assert d.sched.num_priority_preemptions > 0
