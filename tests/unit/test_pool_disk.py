"""kvferry.kvpool.disk: the pool's disk tier, on a real directory (no node, no network)."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest
import torch

from kvferry.kvpool import disk
from kvferry.kvpool.disk import HEADER_BYTES, DiskTier, DiskTierBusy
from kvferry.kvpool.transfer import BlockLayout

LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype="float32")
FILE = HEADER_BYTES + LAYOUT.block_bytes


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int, layout: BlockLayout = LAYOUT) -> torch.Tensor:
    """Random bits (NaNs and infinities included), so equality below is bit-exactness."""
    gen = torch.Generator().manual_seed(i)
    bits = torch.randint(-(2**15), 2**15, (layout.block_bytes // 2,), dtype=torch.int16, generator=gen)
    return bits.view(layout.torch_dtype).reshape(layout.shape)


def same_bits(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def tier(path, files: int = 8, layout: BlockLayout = LAYOUT, **kwargs) -> DiskTier:
    return DiskTier(path, files * (HEADER_BYTES + layout.block_bytes), layout, "n0", **kwargs)


def spilled(t: DiskTier, *ids: int) -> None:
    for i in ids:
        assert t.spill(key(i), block(i))
    assert t.flush(10.0)


def block_files(path) -> list[str]:
    return sorted(name for name in os.listdir(path) if name.endswith(".kvb"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_spilled_block_loads_back_bit_exact_and_files_are_private(tmp_path, dtype):
    layout = BlockLayout(2, 2, 4, 8, dtype)
    t = tier(tmp_path / "d", layout=layout)
    data = block(7, layout)
    assert t.spill(key(7), data)
    assert t.flush(10.0)
    assert same_bits(t.load(key(7)), data)
    slab = torch.zeros((3, *layout.shape), dtype=layout.torch_dtype)
    assert t.load_into(key(7), slab[1])  # straight into a slab row
    assert same_bits(slab[1], data) and not slab[0].any() and not slab[2].any()
    assert t.load(key(8)) is None
    assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o700
    (name,) = block_files(tmp_path / "d")
    assert stat.S_IMODE(os.stat(tmp_path / "d" / name).st_mode) == 0o600
    assert os.path.getsize(tmp_path / "d" / name) == HEADER_BYTES + layout.block_bytes
    s = t.stats()
    assert (s["spills"], s["disk_hits"], s["disk_misses"], s["files"]) == (1, 2, 1, 1)
    assert s["bytes_used"] == HEADER_BYTES + layout.block_bytes
    t.close()


def test_the_caller_may_reuse_its_row_once_spill_returns(tmp_path):
    t = tier(tmp_path)
    row = block(1).clone()
    assert t.spill(key(1), row)
    row.zero_()  # the slot is reused at once
    strided = block(2).transpose(0, 4).contiguous().transpose(0, 4)  # the layout's shape, not contiguous
    assert not strided.is_contiguous() and t.spill(key(2), strided)
    assert t.flush(10.0)
    assert same_bits(t.load(key(1)), block(1)) and same_bits(t.load(key(2)), block(2))
    t.close()


def test_the_least_recently_used_files_go_first_and_the_size_stays_bounded(tmp_path):
    stored, dropped = [], []
    t = tier(
        tmp_path, files=3, on_stored=lambda k, g: stored.append(k), on_dropped=lambda k, g: dropped.append(k)
    )
    spilled(t, 0, 1, 2)
    assert t.load(key(0)) is not None  # 0 is now the most recent: 1 is the oldest
    spilled(t, 3)
    assert dropped == [key(1)]
    spilled(t, 4)
    assert dropped == [key(1), key(2)]
    assert [k for k, _ in t.entries()] == [key(0), key(3), key(4)]
    assert stored == [key(i) for i in range(5)]
    assert len(block_files(tmp_path)) == 3
    s = t.stats()
    assert s["bytes_used"] == 3 * FILE and s["evictions"] == 2
    assert t.load(key(1)) is None and same_bits(t.load(key(4)), block(4))
    t.close()


def test_a_key_already_on_disk_is_not_written_again(tmp_path):
    t = tier(tmp_path, files=2)
    spilled(t, 0, 1)
    before = dict(t.entries())
    spilled(t, 0)  # refreshes it: 1 is the oldest now
    assert t.stats()["spills"] == 2
    assert t.entries() == [(key(1), before[key(1)]), (key(0), before[key(0)])]
    t.close()


def test_generations_rise_with_every_file_and_across_restarts(tmp_path):
    t = tier(tmp_path)
    spilled(t, 0, 1)
    gens = [g for _, g in t.entries()]
    assert gens[0] < gens[1]
    t.close()
    t = tier(tmp_path)
    spilled(t, 2)
    assert t.entries()[-1][1] > gens[1]
    t.close()


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


# in the payload, its last byte, the header's key padding, its generation: the CRC covers them all
@pytest.mark.parametrize("offset", [HEADER_BYTES + 17, FILE - 1, 100, 110])
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path, offset):
    dropped = []
    t = tier(tmp_path, on_dropped=lambda k, g: dropped.append(k))
    spilled(t, 0, 1)
    flip_byte(tmp_path / f"{key(0).hex()}.kvb", offset)
    assert t.load(key(0)) is None
    assert dropped == [key(0)]
    assert block_files(tmp_path) == [f"{key(1).hex()}.kvb"]
    assert [k for k, _ in t.entries()] == [key(1)]
    s = t.stats()
    assert (s["corrupt"], s["disk_misses"], s["files"]) == (1, 1, 1)
    assert same_bits(t.load(key(1)), block(1))  # the others are untouched
    spilled(t, 0)  # and the key can be stored again
    assert same_bits(t.load(key(0)), block(0))
    t.close()


def test_a_truncated_file_is_a_miss_on_load_and_dropped_on_restart(tmp_path):
    t = tier(tmp_path)
    spilled(t, 0, 1)
    os.truncate(tmp_path / f"{key(0).hex()}.kvb", FILE - 5)
    assert t.load(key(0)) is None
    assert t.stats()["corrupt"] == 1
    os.truncate(tmp_path / f"{key(1).hex()}.kvb", HEADER_BYTES // 2)  # torn inside the header
    t.close()
    t = tier(tmp_path)
    assert t.entries() == [] and block_files(tmp_path) == []
    assert t.stats()["corrupt"] == 1
    t.close()


def test_a_file_under_another_key_name_is_a_miss(tmp_path):
    t = tier(tmp_path)
    spilled(t, 0, 1)
    os.replace(tmp_path / f"{key(0).hex()}.kvb", tmp_path / f"{key(1).hex()}.kvb")  # 1's name, 0's bytes
    assert t.load(key(1)) is None
    assert t.load(key(0)) is None  # its file is gone
    assert block_files(tmp_path) == []
    t.close()


def test_files_of_another_layout_are_dropped_on_restart(tmp_path):
    t = tier(tmp_path)
    spilled(t, 0)
    t.close()
    other = BlockLayout(2, 2, 8, 4, "float32")  # files of the same size: only the header tells them apart
    t = tier(tmp_path, layout=other)
    assert t.entries() == [] and block_files(tmp_path) == []
    assert t.stats()["corrupt"] == 1
    t.close()


def test_a_restarted_tier_keeps_the_blocks_and_their_recency(tmp_path):
    t = tier(tmp_path, files=3)
    spilled(t, 0, 1, 2)
    assert t.load(key(0)) is not None  # most recent
    entries = t.entries()
    t.close()
    t = tier(tmp_path, files=3)
    assert [k for k, _ in entries] == [key(1), key(2), key(0)]
    assert t.entries() == entries
    for i in (1, 2, 0):  # in their order: each hit makes it the most recent
        assert same_bits(t.load(key(i)), block(i))
    spilled(t, 3)  # the oldest before the restart goes first
    assert key(1) not in dict(t.entries())
    t.close()


def test_a_restart_with_a_smaller_bound_evicts_the_oldest(tmp_path):
    t = tier(tmp_path, files=4)
    spilled(t, 0, 1, 2, 3)
    t.close()
    dropped = []
    t = tier(tmp_path, files=2, on_dropped=lambda k, g: dropped.append(k))
    assert [k for k, _ in t.entries()] == [key(2), key(3)]
    assert dropped == [key(0), key(1)] and len(block_files(tmp_path)) == 2
    t.close()


def test_tmp_leftovers_are_removed_and_foreign_files_left_alone(tmp_path):
    t = tier(tmp_path)
    spilled(t, 0)
    t.close()
    (tmp_path / f".{key(5).hex()}.123.tmp").write_bytes(b"\x00" * 100)  # a write cut short by kill -9
    (tmp_path / "notes.txt").write_text("not ours")
    t = tier(tmp_path)
    assert [k for k, _ in t.entries()] == [key(0)]
    assert sorted(os.listdir(tmp_path)) == sorted([".lock", f"{key(0).hex()}.kvb", "notes.txt"])
    t.close()


def test_a_directory_is_held_by_one_tier_at_a_time(tmp_path):
    t = tier(tmp_path)
    with pytest.raises(DiskTierBusy, match="n0"):
        tier(tmp_path)
    t.close()
    tier(tmp_path).close()


def test_a_full_queue_drops_the_spill_without_waiting(tmp_path, monkeypatch):
    gate, writing = threading.Event(), threading.Event()
    real = disk._write_file

    def slow(path, header, payload):
        writing.set()
        assert gate.wait(10.0)
        real(path, header, payload)

    monkeypatch.setattr(disk, "_write_file", slow)
    t = tier(tmp_path, queue_depth=2)
    assert t.spill(key(0), block(0))
    assert writing.wait(10.0)  # the writer holds block 0 (one buffer), stuck on the disk
    assert t.spill(key(1), block(1))  # queued in the second buffer
    began = time.monotonic()
    assert not t.spill(key(2), block(2))  # no buffer left: dropped, at once
    assert time.monotonic() - began < 1.0
    assert t.stats()["spill_drops"] == 1
    gate.set()
    assert t.flush(10.0)
    assert same_bits(t.load(key(1)), block(1)) and t.load(key(2)) is None
    assert t.spill(key(2), block(2))  # the buffers are free again
    t.close()
    assert t.stats()["spills"] == 3


def test_a_failed_write_drops_the_block_and_the_tier_goes_on(tmp_path, monkeypatch):
    real = disk._write_file

    def full(path, header, payload):
        real(path, header, payload[:10])  # a part landed, then the disk filled up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "_write_file", full)
    t = tier(tmp_path)
    spilled(t, 0)
    assert os.listdir(tmp_path) == [".lock"]  # no tmp left behind
    s = t.stats()
    assert (s["write_errors"], s["spill_drops"], s["files"]) == (1, 1, 0)
    monkeypatch.setattr(disk, "_write_file", real)
    spilled(t, 0)
    assert same_bits(t.load(key(0)), block(0))
    t.close()


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no"):
        DiskTier(tmp_path, FILE - 1, LAYOUT, "n0")
    t = tier(tmp_path)
    with pytest.raises(ValueError, match="a block is"):
        t.spill(key(0), torch.zeros(3))
    with pytest.raises(ValueError, match="key"):
        t.spill(b"", block(0))
    with pytest.raises(ValueError, match="a block is"):
        t.load_into(key(0), block(0).to(torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        t.load_into(key(0), torch.zeros(LAYOUT.shape[::-1]).permute(4, 3, 2, 1, 0))
    t.close()


def test_concurrent_spills_and_loads_never_return_wrong_bytes(tmp_path):
    t = tier(tmp_path, files=6, queue_depth=4)
    errors: list[str] = []
    stop = time.monotonic() + 2.0

    def spiller(first: int) -> None:
        i = 0
        while time.monotonic() < stop:
            t.spill(key(first + i % 10), block(first + i % 10))
            i += 1

    def loader(first: int) -> None:
        i = 0
        while time.monotonic() < stop:
            got = t.load(key(first + i % 10))
            if got is not None and not same_bits(got, block(first + i % 10)):
                errors.append(f"wrong bytes for block {first + i % 10}")
            i += 1

    threads = [threading.Thread(target=f, args=(base,)) for f in (spiller, loader) for base in (0, 100)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.flush(10.0)
    assert errors == []
    s = t.stats()
    assert s["corrupt"] == 0 and s["disk_hits"] > 0 and s["evictions"] > 0
    assert s["files"] <= 6 and len(block_files(tmp_path)) == s["files"]
    for k, _ in t.entries():
        assert same_bits(t.load(k), block(int.from_bytes(k, "little")))
    t.close()
