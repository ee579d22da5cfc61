"""kvferry.kvpool.slots: a pool node's slot bookkeeping, driven directly (no processes, no network)."""

from __future__ import annotations

import random

import pytest

from kvferry.kvpool.metadata import Location
from kvferry.kvpool.slots import PutPlan, SlotState, SlotTable

HEADS = 4
NODE = "n0"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_slots: int = 4, clock: Clock | None = None) -> SlotTable:
    return SlotTable(
        num_slots, HEADS, NODE, private_ttl_s=100.0, assemble_timeout_s=10.0, clock=clock or Clock()
    )


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def put(
    table: SlotTable, request_id: str, keys: list[bytes], private: list[bool] | None = None
) -> tuple[PutPlan, list[Location]]:
    """A whole (every KV head) put whose bytes all landed."""
    plan = table.begin_write(request_id, keys, private)
    publish, _ = table.finish_write(plan)
    table.check()
    return plan, publish


def get(table: SlotTable, request_id: str, locations: list[Location], whole: bool = True) -> list[int]:
    leased, stale = table.lease(request_id, locations)
    assert stale is None
    table.end_lease(request_id, leased, whole)
    table.check()
    return leased


def test_allocate_until_full_then_evict_least_recently_used():
    table = make(3)
    _, published = put(table, "r", [key(0), key(1), key(2)])
    assert [loc.slot for loc in published] == [0, 1, 2]
    assert all(loc.generation == 1 for loc in published)
    assert table.available() == 3 and len(table.free) == 0
    get(table, "reader", [published[0]])  # slot 0 becomes the most recently used: slot 1 goes first
    plan, new = put(table, "r", [key(3)])
    assert plan.evicted == [published[1]]
    assert new == [Location(key(3), NODE, 1, 2)]  # the reused slot's generation rose
    assert table.existing(key(1)) is None and table.existing(key(3)).index == 1
    assert table.stats()["evictions"] == 1
    plan, _ = put(table, "r", [key(4)])
    assert plan.evicted == [published[2]]


def test_leased_and_written_slots_are_never_evicted():
    table = make(3)
    _, (a, b, c) = put(table, "r", [key(0), key(1), key(2)])
    leased, _ = table.lease("reader", [a])  # slot 0 is being read
    writing = table.begin_write("w", [key(3)])
    assert writing.evicted == [b]  # the oldest is leased: the next one goes
    plan = table.begin_write("w2", [key(4), key(5)])
    assert plan.evicted == [c]  # slot 0 is leased, slot 1 being written
    assert plan.slots == [c.slot, None]  # and then nothing is left to evict
    assert table.locations_for(plan) == [None, None]
    table.check()
    table.end_lease("reader", leased, True)
    table.finish_write(writing)
    table.finish_write(plan)
    table.check()
    assert list(table.lru) == [a.slot, b.slot, c.slot]  # all evictable again, the read one first
    assert table.stats()["evictions"] == 2


def test_tp_put_completes_only_when_every_head_slice_arrived():
    table = make()
    rank0 = table.begin_write("tp", [key(0)])
    rank1 = table.begin_write("tp", [key(0)])
    assert rank0.slots == rank1.slots  # the second slice joins the first one's slot
    assert table.slots[rank0.slots[0]].writers == 2
    publish, assembled = table.finish_write(rank0, 0, 2)
    assert publish == [] and not assembled
    assert table.pending(rank0) and table.locations_for(rank0) == [None]
    table.check()
    publish, assembled = table.finish_write(rank1, 2, 4)
    assert assembled and publish == [Location(key(0), NODE, rank0.slots[0], 1)]
    assert not table.pending(rank0) and not table.pending(rank1)
    assert table.locations_for(rank0) == table.locations_for(rank1) == publish
    assert table.slots[rank0.slots[0]].state == SlotState.PUBLISHED
    table.check()


def test_the_same_head_slice_twice_does_not_complete_a_block():
    table = make()
    plan = table.begin_write("tp", [key(0)])
    table.finish_write(plan, 0, 2)
    again = table.begin_write("tp", [key(0)])
    _, assembled = table.finish_write(again, 0, 2)
    assert not assembled and table.pending(again)


def test_private_block_is_freed_after_a_whole_read_not_a_head_slice_read():
    table = make()
    plan, publish = put(table, "req", [key(0)], [True])
    assert publish == []  # never published
    (loc,) = table.locations_for(plan)
    assert loc is not None and table.slots[loc.slot].state == SlotState.PRIVATE
    assert table.existing(key(0)) is None  # private keys are indexed only while being written
    leased, _ = table.lease("req", [loc])
    assert table.end_lease("req", leased, whole=False) == 0
    assert table.slots[loc.slot].state == SlotState.PRIVATE
    assert table.stats()["private_blocks"] == 1
    leased, _ = table.lease("req", [loc])
    assert table.end_lease("req", leased, whole=True) == 1
    assert table.slots[loc.slot].state == SlotState.FREE and table.stats()["private_blocks"] == 0
    assert table.lease("req", [loc]) == ([], loc)  # gone: stale now
    table.check()


def test_private_block_is_not_freed_while_another_read_holds_it():
    table = make()
    plan, _ = put(table, "req", [key(0)], [True])
    (loc,) = table.locations_for(plan)
    first, _ = table.lease("a", [loc])
    second, _ = table.lease("b", [loc])
    assert table.end_lease("a", first, True) == 0
    assert table.end_lease("b", second, True) == 1
    table.check()


def test_release_frees_only_that_requests_unpinned_private_and_unfinished_blocks():
    table = make(8)
    mine, _ = put(table, "mine", [key(0), key(1)], [True, True])
    (read_loc, _) = table.locations_for(mine)
    unfinished = table.begin_write("mine", [key(2)], [True])
    table.finish_write(unfinished, 0, 2)  # waits for the other slices
    in_flight = table.begin_write("mine", [key(3)], [True])  # its bytes are still landing
    shared, _ = put(table, "mine", [key(4)])
    theirs, _ = put(table, "theirs", [key(5)], [True])
    leased, _ = table.lease("mine", [read_loc])
    table.check()
    assert table.release("mine") == 2  # key 1's block and the unfinished key 2
    assert table.slots[read_loc.slot].state == SlotState.PRIVATE  # leased: kept
    assert table.slots[mine.slots[1]].state == SlotState.FREE
    assert table.slots[unfinished.slots[0]].state == SlotState.FREE
    assert table.slots[in_flight.slots[0]].state == SlotState.WRITING  # being written: kept
    assert table.slots[shared.slots[0]].state == SlotState.PUBLISHED
    assert table.slots[theirs.slots[0]].state == SlotState.PRIVATE
    assert table.existing(key(2)) is None
    table.check()
    # the blocks in use when the request was released go as soon as nobody uses them (a release that
    # overtook the request's own put leaves nothing behind)
    assert table.end_lease("mine", leased, whole=False) == 1
    assert table.slots[read_loc.slot].state == SlotState.FREE
    table.finish_write(in_flight)
    assert table.slots[in_flight.slots[0]].state == SlotState.FREE
    assert table.locations_for(in_flight) == [None]
    assert table.release("mine") == 0 and "mine" not in table.by_request
    assert table.slots[theirs.slots[0]].state == SlotState.PRIVATE
    table.check()


def test_expiry_frees_private_blocks_after_their_ttl_and_unassembled_blocks_after_the_timeout():
    clock = Clock()
    table = make(8, clock)
    tail, _ = put(table, "req", [key(0)], [True])
    clock.now = 50.0
    partial = table.begin_write("tp", [key(1)])
    clock.now = 55.0
    table.finish_write(partial, 0, 2)  # the other slices' deadline: 55 + 10
    shared, _ = put(table, "r", [key(2)])
    clock.now = 65.0
    assert table.expire() == 0  # a deadline is only passed strictly after it
    clock.now = 65.5
    assert table.expire() == 1
    assert table.slots[partial.slots[0]].state == SlotState.FREE and not table.pending(partial)
    assert table.existing(key(1)) is None
    clock.now = 100.5
    leased, _ = table.lease("req", table.locations_for(tail))  # due, but being read
    assert table.expire() == 0
    table.end_lease("req", leased, whole=False)
    table.check()
    assert table.expire() == 1
    assert table.slots[tail.slots[0]].state == SlotState.FREE
    clock.now = 1000.0
    assert table.expire() == 0
    assert table.slots[shared.slots[0]].state == SlotState.PUBLISHED  # published blocks never expire
    table.check()


def test_an_unassembled_block_expires_from_its_last_writer_not_its_first():
    clock = Clock()
    table = make(clock=clock)
    rank0 = table.begin_write("tp", [key(0)])
    table.finish_write(rank0, 0, 1)
    clock.now = 8.0
    rank1 = table.begin_write("tp", [key(0)])
    clock.now = 12.0
    assert table.expire() == 0  # rank 0's deadline passed, but rank 1 is still writing
    table.finish_write(rank1, 1, 2)
    clock.now = 21.0
    assert table.expire() == 0
    clock.now = 22.5
    assert table.expire() == 1
    table.check()


def test_stale_get_stops_at_the_first_stale_block_and_reports_it():
    table = make(4)
    _, locs = put(table, "r", [key(0), key(1), key(2)])
    wrong_gen = Location(key(1), NODE, locs[1].slot, locs[1].generation + 1)
    leased, stale = table.lease("g", [locs[0], wrong_gen, locs[2]])
    assert leased == [locs[0].slot] and stale == wrong_gen
    table.end_lease("g", leased, True)
    wrong_key = Location(key(9), NODE, locs[1].slot, locs[1].generation)
    assert table.lease("g", [wrong_key, locs[0]]) == ([], wrong_key)
    unfinished = table.begin_write("w", [key(3)])  # WRITING: not readable yet
    writing = Location(key(3), NODE, unfinished.slots[0], unfinished.generations[0])
    assert table.lease("g", [writing]) == ([], writing)
    elsewhere = Location(key(0), "other-node", locs[1].slot, 7)
    assert table.lease("g", [elsewhere]) == ([], None)  # not ours to unpublish
    assert table.lease("g", [Location(key(0), NODE, 99, 1)]) == ([], None)  # no such slot
    assert table.stats()["stale_gets"] == 5
    assert table.slots[locs[0].slot].leases == 0 and locs[0].slot in table.lru
    table.check()


def test_republish_lists_only_published_blocks():
    table = make(6)
    _, published = put(table, "r", [key(0), key(1)])
    put(table, "req", [key(2)], [True])
    partial = table.begin_write("tp", [key(3)])
    table.finish_write(partial, 0, 2)
    table.begin_write("w", [key(4)])
    leased, _ = table.lease("reader", [published[1]])
    assert sorted(table.published_locations(), key=lambda loc: loc.slot) == published
    table.end_lease("reader", leased, True)
    assert table.stats()["published"] == 2 and table.stats()["writing"] == 2


def test_index_of_a_key_points_to_its_newest_copy():
    table = make(4)
    _, (old,) = put(table, "r", [key(0)])
    # a private block under the same key gets its own slot: indexed while written, not after
    private, _ = put(table, "req", [key(0)], [True])
    assert private.slots[0] != old.slot and table.existing(key(0)) is None
    _, (new,) = put(table, "r", [key(0)])  # so a shared put makes a second copy
    assert new.slot not in (old.slot, private.slots[0])
    assert table.existing(key(0)).index == new.slot
    put(table, "r", [key(1)])
    plan, _ = put(table, "r", [key(2)])  # evicts the oldest: the first copy of key 0
    assert plan.evicted == [old]
    assert table.existing(key(0)).index == new.slot  # the newer copy keeps its entry
    table.check()


def test_an_evicted_key_written_again_is_indexed_at_its_new_slot():
    table = make(1)
    _, (first,) = put(table, "r", [key(0)])
    put(table, "r", [key(1)])
    plan, (again,) = put(table, "r", [key(0)])
    assert plan.evicted == [Location(key(1), NODE, 0, 2)]
    assert again == Location(key(0), NODE, 0, 3) and table.existing(key(0)).generation == 3
    assert table.lease("g", [first])[1] == first  # the old location is stale


def test_put_of_a_published_key_writes_nothing_and_republishes_it():
    table = make(4)
    _, (loc,) = put(table, "r", [key(0)])
    before = table.stats()
    plan = table.begin_write("r2", [key(0), key(1)])
    assert plan.slots[0] is None and plan.republish == [loc] and plan.rows == [1]
    assert table.slots[loc.slot].writers == 0
    publish, _ = table.finish_write(plan)
    assert publish == [Location(key(1), NODE, plan.slots[1], 1), loc]
    assert table.locations_for(plan)[0] == loc
    assert table.stats()["blocks_in"] == before["blocks_in"] + 1
    assert table.slots[loc.slot].generation == 1
    table.check()


def test_a_private_put_never_joins_another_requests_block():
    table = make()
    mine = table.begin_write("mine", [key(0)], [True])
    slice2 = table.begin_write("mine", [key(0)], [True])  # its own other slice joins it
    assert slice2.slots == mine.slots
    theirs = table.begin_write("theirs", [key(0)], [True])
    assert theirs.slots[0] not in (None, mine.slots[0])
    assert table.slots[mine.slots[0]].writers == 2 and table.slots[theirs.slots[0]].writers == 1
    table.check()


def test_abort_frees_unfinished_slots_and_keeps_published_ones_evictable():
    table = make()
    _, (loc,) = put(table, "r", [key(0)])
    plan = table.begin_write("w", [key(1), key(2)])
    joined = table.begin_write("w2", [key(1)])
    assert table.abort_write(plan) == 1  # key 2's slot; key 1 still has a writer
    assert table.existing(key(2)) is None and table.existing(key(1)) is not None
    assert table.abort_write(joined) == 1
    assert table.existing(key(1)) is None and not table.pending(plan)
    assert table.locations_for(plan) == [None, None]
    assert table.available() == 4 and loc.slot in table.lru
    table.check()
    rank0 = table.begin_write("tp", [key(5)])
    rank1 = table.begin_write("tp", [key(5)])
    table.finish_write(rank1)  # complete, but rank 0's bytes are still landing: not evictable yet
    slot = rank1.slots[0]
    assert table.slots[slot].state == SlotState.PUBLISHED and slot not in table.lru
    assert table.abort_write(rank0) == 0
    assert table.slots[slot].state == SlotState.PUBLISHED and slot in table.lru
    table.check()


@pytest.mark.parametrize("seed", range(8))
def test_random_operations_keep_the_indexes_equal_to_a_scan(seed):
    """Release and expiry use the per-request index and the expiry heap: they must free exactly what
    the scan of every slot (the node's former implementation) would."""
    rng = random.Random(seed)
    clock = Clock()
    table = SlotTable(6, 2, NODE, private_ttl_s=20.0, assemble_timeout_s=5.0, clock=clock)
    requests = ["a", "b", "c"]
    writes: list[tuple[PutPlan, tuple[int, int]]] = []
    reads: list[tuple[str, list[int]]] = []
    seen: list[Location] = []
    for _ in range(400):
        op = rng.randrange(7)
        if op == 0:
            keys = [key(rng.randrange(8)) for _ in range(rng.randint(1, 3))]
            private = [rng.random() < 0.4 for _ in keys]
            plan = table.begin_write(rng.choice(requests), keys, private)
            writes.append((plan, rng.choice([(0, 1), (1, 2), (0, 2)])))
        elif op == 1 and writes:
            plan, (begin, end) = writes.pop(rng.randrange(len(writes)))
            table.finish_write(plan, begin, end)
            seen += [loc for loc in table.locations_for(plan) if loc is not None]
        elif op == 2 and writes:
            table.abort_write(writes.pop(rng.randrange(len(writes)))[0])
        elif op == 3 and seen:
            request_id = rng.choice(requests)
            leased, _ = table.lease(request_id, rng.sample(seen, min(len(seen), 2)))
            reads.append((request_id, leased))
        elif op == 4 and reads:
            request_id, leased = reads.pop(rng.randrange(len(reads)))
            table.end_lease(request_id, leased, rng.random() < 0.5)
        elif op == 5:
            request_id = rng.choice(requests)
            expected = {
                s.index
                for s in table.slots
                if s.state in (SlotState.PRIVATE, SlotState.WRITING)
                and s.request_id == request_id
                and s.leases == s.writers == 0
            }
            assert table.release(request_id) == len(expected)
            assert all(table.slots[i].state == SlotState.FREE for i in expected)
        else:
            clock.now += rng.uniform(0, 8)
            expected = {
                s.index
                for s in table.slots
                if (s.request_id or s.state == SlotState.WRITING)
                and s.state in (SlotState.PRIVATE, SlotState.WRITING)
                and s.leases == s.writers == 0
                and s.expires < clock.now
            }
            assert table.expire() == len(expected)
            assert all(table.slots[i].state == SlotState.FREE for i in expected)
        table.check()
    for plan, _ in writes:
        table.abort_write(plan)
    for request_id, leased in reads:
        table.end_lease(request_id, leased, True)
    clock.now += 100
    table.expire()
    for request_id in requests:
        table.release(request_id)
    table.check()
    assert table.stats()["leases"] == {} and not table.by_request
    assert len(table.free) + table.stats()["published"] == 6


# -- reservations: a client sets slots aside, then names them in its puts ---------------------------------
def reserving(num_slots: int = 6, clock: Clock | None = None) -> SlotTable:
    return SlotTable(
        num_slots,
        HEADS,
        NODE,
        private_ttl_s=100.0,
        assemble_timeout_s=10.0,
        reserve_ttl_s=30.0,
        clock=clock or Clock(),
    )


def test_a_put_takes_the_slots_its_client_reserved():
    table = reserving()
    slots, evicted = table.reserve("c1", 3)
    assert [s for s, _ in slots] == [0, 1, 2] and evicted == []
    assert all(table.slots[s].state == SlotState.RESERVED for s, _ in slots)
    assert table.available() == 3  # reserved slots are nobody else's to take
    table.check()
    plan = table.begin_write("r", [key(1), key(2)], owner="c1", named=slots[:2], allocate=False)
    assert plan.slots == [0, 1] and plan.sources == [0, 1]
    publish, _ = table.finish_write(plan)
    assert [loc.slot for loc in publish] == [0, 1]
    assert table.slots[2].state == SlotState.RESERVED  # not named: still c1's
    table.check()


def test_a_named_slot_that_is_not_the_owners_reservation_is_never_written():
    table = reserving()
    slots, _ = table.reserve("c1", 2)
    stale = (slots[0][0], slots[0][1] + 1)  # a generation it never had
    plan = table.begin_write("r", [key(1), key(2)], owner="c2", named=slots, allocate=False)
    assert plan.slots == [None, None]  # another client's reservation: not stored
    plan = table.begin_write("r", [key(1)], owner="c1", named=[stale], allocate=False)
    assert plan.slots == [None]
    table.abort_write(plan)
    plan = table.begin_write("r", [key(1)], owner="c1", named=[stale])  # over the pair group: allocated
    assert plan.slots[0] not in (s for s, _ in slots)
    table.finish_write(plan)
    assert all(table.slots[s].state == SlotState.RESERVED for s, _ in slots)
    table.check()


def test_named_slots_a_put_does_not_need_go_back_when_it_is_done():
    table = reserving()
    (done,) = put(table, "r0", [key(1)])[1]  # key 1 is complete here already
    slots, _ = table.reserve("c1", 2)
    plan = table.begin_write("r", [key(1), key(2)], owner="c1", named=slots)
    assert plan.slots == [None, slots[1][0]] and plan.spare == [slots[0]]
    assert table.finish_write(plan)[0][-1] == done  # answered with the copy it already has
    assert table.slots[slots[0][0]].state == SlotState.FREE
    table.check()


def test_a_tp_slice_written_into_its_own_slot_joins_the_first_ranks_slot():
    table = reserving()
    rank0, _ = table.reserve("rank0", 1)
    rank1, _ = table.reserve("rank1", 1)
    first = table.begin_write("r", [key(1)], owner="rank0", named=rank0, allocate=False)
    second = table.begin_write("r", [key(1)], owner="rank1", named=rank1, allocate=False)
    assert second.slots == first.slots == [rank0[0][0]]
    assert second.sources == [rank1[0][0]]  # the node copies rank 1's slice from here
    table.finish_write(first, 0, 2)
    publish, assembled = table.finish_write(second, 2, 4)
    assert assembled and [loc.slot for loc in publish] == [rank0[0][0]]
    assert table.slots[rank1[0][0]].state == SlotState.FREE
    table.check()


def test_reservations_lapse_when_their_client_stops_using_them():
    clock = Clock()
    table = reserving(clock=clock)
    slots, _ = table.reserve("gone", 2)
    live, _ = table.reserve("live", 1)
    clock.now = 20.0
    table.begin_write("r", [key(1)], owner="live", named=[live[0]])  # renews live's lease
    clock.now = 31.0
    assert table.expire() == 2
    assert all(table.slots[s].state == SlotState.FREE for s, _ in slots)
    assert "gone" not in table.reserved
    table.check()


def test_reserving_evicts_least_recently_used_blocks_when_the_slab_is_full():
    table = reserving(num_slots=2)
    put(table, "r", [key(1), key(2)])
    slots, evicted = table.reserve("c1", 3)
    assert len(slots) == 2 and {loc.key for loc in evicted} == {key(1), key(2)}
    assert table.reserve("c2", 1) == ([], [])  # nothing left to take
    table.check()


def test_consumed_frees_a_private_block_read_without_a_lease():
    table = reserving()
    put(table, "r", [key(1)], [True])
    private = next(s for s in table.slots if s.state == SlotState.PRIVATE)
    stale = Location(private.key, NODE, private.index, private.generation + 1)
    assert table.consumed([stale]) == 0
    fresh = Location(private.key, NODE, private.index, private.generation)
    assert table.consumed([fresh]) == 1 and private.state == SlotState.FREE
    table.check()


def test_every_state_change_is_observed_after_the_generation_rose():
    seen = []
    table = SlotTable(2, HEADS, NODE, on_change=lambda s: seen.append((s.index, s.generation, s.state)))
    slots, _ = table.reserve("c", 1)
    plan = table.begin_write("r", [key(1)], owner="c", named=slots)
    table.finish_write(plan)
    assert seen == [(0, 1, SlotState.RESERVED), (0, 1, SlotState.WRITING), (0, 1, SlotState.PUBLISHED)]
