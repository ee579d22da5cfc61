"""The router's worker choice: least-loaded group (round robin among equals), then within an
expert-parallel decode group the rank with the most free KV blocks; and which members may take a call
at all (`available`, what KV-aware routing chooses among)."""

from __future__ import annotations

from kvferry.router.directory import Directory, Member


def add(directory: Directory, member_id: str, group: str, free_blocks: int, inflight: int = 0) -> Member:
    member = Member("decode", member_id, "addr", None, None, group=group, free_blocks=free_blocks)
    member.inflight = inflight
    directory.members["decode"][member_id] = member
    return member


def test_rank_with_most_free_blocks_then_what_was_sent_counts():
    d = Directory(meta=None)
    add(d, "ep.r0", "ep", free_blocks=100)
    add(d, "ep.r1", "ep", free_blocks=60)
    picks = [d.pick("decode", blocks=30).member_id for _ in range(3)]
    # 100 vs 60 -> r0 (70 left); 70 vs 60 -> r0 (40 left); 40 vs 60 -> r1
    assert picks == ["ep.r0", "ep.r0", "ep.r1"]


def test_least_loaded_group_first_whatever_its_size():
    d = Directory(meta=None)
    add(d, "ep.r0", "ep", free_blocks=500, inflight=2)
    add(d, "ep.r1", "ep", free_blocks=500, inflight=2)
    add(d, "solo", "solo", free_blocks=10, inflight=1)
    assert d.pick("decode").member_id == "solo"  # 1 in flight per rank beats 2
    d.members["decode"]["solo"].inflight = 2
    # equal load per rank: the groups take turns
    assert {d.pick("decode").group for _ in range(2)} == {"ep", "solo"}


def test_suspect_ranks_are_skipped():
    d = Directory(meta=None)
    best = add(d, "ep.r0", "ep", free_blocks=100)
    add(d, "ep.r1", "ep", free_blocks=1)
    d.suspect(best, 60)
    assert d.pick("decode").member_id == "ep.r1"
    assert Directory(meta=None).pick("decode") is None


def test_draining_members_get_nothing_new_and_do_not_count():
    d = Directory(meta=None)
    old = add(d, "decode-0", "decode-0", free_blocks=500)
    add(d, "decode-1", "decode-1", free_blocks=1, inflight=3)
    old.draining = True
    assert {d.pick("decode").member_id for _ in range(4)} == {"decode-1"}
    assert d.count("decode") == 1
    d.members["decode"]["decode-1"].draining = True
    assert d.pick("decode") is None and d.count("decode") == 0


def test_available_skips_tried_members_and_groups_draining_and_suspect():
    d = Directory(meta=None)
    add(d, "ep.r0", "ep", free_blocks=1)
    add(d, "ep.r1", "ep", free_blocks=1)
    add(d, "solo", "solo", free_blocks=1)
    add(d, "old", "old", free_blocks=1).draining = True
    d.suspect(add(d, "flaky", "flaky", free_blocks=1), 60)
    assert {m.member_id for m in d.available("decode")} == {"ep.r0", "ep.r1", "solo"}
    assert {m.member_id for m in d.available("decode", {"ep"})} == {"solo"}
    assert {m.member_id for m in d.available("decode", {"solo", "ep.r0"})} == {"ep.r1"}
