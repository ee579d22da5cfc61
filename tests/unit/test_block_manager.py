"""BlockManager: allocation, ref counts, leak-freedom on every finish path, the local prefix cache."""

from __future__ import annotations

import pytest

from kvferry.engine.block_hash import model_fingerprint
from kvferry.engine.block_manager import BlockManager
from kvferry.engine.request import Request, RequestStatus, SamplingParams
from kvferry.engine.scheduler import Scheduler, SchedulerConfig

NUM_BLOCKS, BS = 8, 4
FP = model_fingerprint("unit-test-model", "float32")


def make_req(rid: str, n: int, base: int = 0, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens))


def make_bm(**kwargs) -> BlockManager:
    return BlockManager(NUM_BLOCKS, BS, FP, **kwargs)


def assert_clean(bm: BlockManager) -> None:
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def compute(bm: BlockManager, req: Request, n: int | None = None) -> None:
    """Pretend the model computed req's tokens (all of them by default) and commit the full blocks."""
    req.num_computed_tokens = req.num_tokens if n is None else n
    bm.commit(req)


def test_allocate_grow_and_free():
    bm = make_bm()
    a = make_req("a", 10)
    assert bm.allocate(a, 10)
    assert len(a.block_ids) == 3 == len(set(a.block_ids))
    assert bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in a.block_ids)
    a.num_computed_tokens = 10
    assert bm.allocate(a, 2)  # 12 tokens still fit in 3 blocks
    assert len(a.block_ids) == 3
    assert bm.allocate(a, 3)  # 13 tokens need a 4th
    assert len(a.block_ids) == 4 and bm.num_free_blocks == 4
    bm.check_invariants()
    bm.free(a)
    assert a.block_ids == []
    assert_clean(bm)


def test_allocate_fails_without_changing_anything():
    bm = make_bm()
    a = make_req("a", 24)
    assert bm.allocate(a, 24)  # 6 blocks
    b = make_req("b", 12, base=100)
    queue_before = list(bm.free_queue)
    refs_before = [blk.ref_count for blk in bm.blocks]
    assert not bm.allocate(b, 12)  # needs 3, 2 free
    assert b.block_ids == []
    assert list(bm.free_queue) == queue_before
    assert [blk.ref_count for blk in bm.blocks] == refs_before
    assert bm.allocate(b, 8)  # exactly the 2 left
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_allocate_counts_revived_cached_blocks_against_free_space():
    bm = make_bm()
    a = make_req("a", 9)
    bm.allocate(a, 9)
    blocks_a = list(a.block_ids)
    compute(bm, a)
    bm.free(a)  # its 2 full blocks stay cached, but free
    assert bm.allocate(make_req("filler", 16, base=500), 16)  # 4 older free blocks
    assert bm.num_free_blocks == 4
    a2 = make_req("a2", 9)
    hit = bm.cached_prefix(a2)
    assert hit == blocks_a[:2]
    queue_before = list(bm.free_queue)
    # 8 cached + 9 new tokens = 5 blocks: 2 revived + 3 new > 4 free
    assert not bm.allocate(a2, 9, hit)
    assert a2.block_ids == [] and list(bm.free_queue) == queue_before
    assert all(bm.blocks[b].ref_count == 0 for b in hit)
    bm.check_invariants()
    assert bm.allocate(a2, 8, hit)  # 2 revived + 2 new = 4
    assert a2.block_ids[:2] == hit and bm.num_free_blocks == 0
    bm.check_invariants()


def test_no_leak_after_normal_finish():
    bm = make_bm()
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    reqs = [make_req(f"r{i}", 6, base=10 * i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    while sched.has_unfinished():
        batch = sched.schedule()
        for r in sched.update(batch):
            r.output_token_ids.append(7)
            if len(r.output_token_ids) == r.params.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        bm.check_invariants()
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert_clean(bm)


def test_no_leak_after_preemption_then_abort():
    bm = make_bm()
    sched = Scheduler(SchedulerConfig(), bm)
    a, b = make_req("a", 10), make_req("b", 5, base=50)
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule())
    sched.running.remove(b)
    sched._preempt(b)
    assert b.status == RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert bm.num_free_blocks == NUM_BLOCKS - 3
    bm.check_invariants()
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished()
    assert_clean(bm)


@pytest.mark.parametrize("where", ["waiting", "running_mid_prefill", "running_decode"])
def test_no_leak_after_abort(where):
    bm = make_bm()
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8), bm)
    a, b = make_req("a", 20), make_req("b", 6, base=100)
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule())  # a: first 8-token chunk; b waits (max_num_seqs=1)
    assert a.status == RequestStatus.RUNNING and a.num_computed_tokens == 8
    assert b.status == RequestStatus.WAITING and list(sched.waiting) == [b]
    if where == "running_decode":
        sched.update(sched.schedule())
        sched.update(sched.schedule())
        a.output_token_ids.append(1)
        sched.update(sched.schedule())
        assert a.num_computed_tokens == 21
    target = b if where == "waiting" else a
    sched.finish(target, RequestStatus.FINISHED_ABORTED)
    assert target.status.finish_reason == "abort"
    assert target not in sched.running and target not in sched.waiting
    bm.check_invariants()
    other = a if target is b else b
    sched.finish(other, RequestStatus.FINISHED_ABORTED)
    assert_clean(bm)


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    bm = make_bm()
    a = make_req("a", 10)
    bm.allocate(a, 10)
    compute(bm, a)
    assert len(bm.cached) == 2  # only the 2 full blocks get keys
    b = Request("b", [*range(8), 77, 78, 79], SamplingParams())
    hit = bm.cached_prefix(b)
    assert hit == a.block_ids[:2]
    assert bm.allocate(b, 3, hit)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] not in a.block_ids
    assert [bm.blocks[i].ref_count for i in a.block_ids] == [2, 2, 1]
    bm.check_invariants()
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_ids] == [1, 1, 1]
    bm.free(b)
    assert_clean(bm)


@pytest.mark.parametrize(("n", "expected_hit"), [(8, 2), (9, 2), (7, 1), (4, 1), (3, 0), (12, 3)])
def test_cached_prefix_covers_every_cached_full_block(n, expected_hit):
    """A prompt whose every token is cached (n a multiple of the block size) hits all its blocks: the
    scheduler, not the block manager, decides to compute its last token again."""
    bm = make_bm()
    a = make_req("a", 12)
    bm.allocate(a, 12)
    compute(bm, a)
    b = make_req("b", n)
    hit = bm.cached_prefix(b)
    assert hit == a.block_ids[:expected_hit]
    assert len(hit) == n // BS


def test_freed_cached_blocks_revive_until_lru_eviction():
    bm = make_bm()
    a = make_req("a", 12)
    bm.allocate(a, 12)
    blocks_a = list(a.block_ids)
    compute(bm, a)
    bm.free(a)
    assert_clean(bm)
    assert len(bm.cached) == 3
    # the 5 never-used blocks are older in the LRU queue than a's: taking them evicts nothing
    c = make_req("c", 20, base=1000)
    assert bm.allocate(c, 20)
    assert not set(c.block_ids) & set(blocks_a)
    assert bm.cached_prefix(make_req("a2", 13)) == blocks_a
    # a's blocks were queued tail first, so the tail is evicted first, then block 1, then block 0
    d = make_req("d", 1, base=2000)
    assert bm.allocate(d, 1)
    assert d.block_ids == [blocks_a[2]]
    assert bm.cached_prefix(make_req("a3", 13)) == blocks_a[:2]
    e = make_req("e", 1, base=3000)
    assert bm.allocate(e, 1)
    assert e.block_ids == [blocks_a[1]]
    assert len(bm.cached) == 1
    bm.free(c)
    a4 = make_req("a4", 13)
    hit = bm.cached_prefix(a4)
    assert hit == blocks_a[:1]
    assert bm.allocate(a4, 9, hit)
    assert a4.block_ids[0] == blocks_a[0] and bm.blocks[blocks_a[0]].ref_count == 1
    bm.check_invariants()
    for r in (d, e, a4):
        bm.free(r)
    assert_clean(bm)


def test_revived_blocks_leave_the_free_queue():
    bm = make_bm()
    a = make_req("a", 8)
    bm.allocate(a, 8)
    blocks_a = list(a.block_ids)
    compute(bm, a)
    bm.free(a)
    b = make_req("b", 9)
    hit = bm.cached_prefix(b)
    assert hit == blocks_a
    assert bm.allocate(b, 1, hit)
    assert all(bm.blocks[i].ref_count == 1 and i not in bm.free_queue for i in hit)
    assert bm.num_free_blocks == NUM_BLOCKS - 3
    bm.check_invariants()


def test_different_fingerprint_gives_no_hit():
    bm = make_bm()
    a = make_req("a", 12)
    bm.allocate(a, 12)
    compute(bm, a)
    bm.fingerprint = model_fingerprint("unit-test-model", "bfloat16")
    assert bm.cached_prefix(make_req("b", 12)) == []
    bm.fingerprint = FP
    assert len(bm.cached_prefix(make_req("c", 12))) == 3


def test_caching_disabled_never_hits():
    bm = make_bm(enable_caching=False)
    a = make_req("a", 12)
    bm.allocate(a, 12)
    compute(bm, a)
    assert bm.cached == {}
    assert bm.cached_prefix(make_req("b", 12)) == []
