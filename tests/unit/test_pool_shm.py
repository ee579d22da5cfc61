"""kvferry.kvpool.shm: the shared slab file, its slot mirror and the lock-free read check."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

from kvferry.kvpool.metadata import Location
from kvferry.kvpool.shm import SHM_DIR, Mirror, SharedSlab, sweep_stale
from kvferry.kvpool.slots import SlotTable
from kvferry.kvpool.transfer import BlockLayout

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")

LAYOUT = BlockLayout(2, 4, 4, 8, "float32")


@pytest.fixture
def slab():
    shm = SharedSlab.create(LAYOUT, 4, "0ddba11")
    yield shm
    shm.unlink()


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_the_file_is_private_and_a_second_mapping_shares_its_bytes(slab):
    assert stat.S_IMODE(slab.path.stat().st_mode) == 0o600
    other = SharedSlab.open(str(slab.path), LAYOUT, 4)
    slab.slab[2] = 1.5
    assert torch.equal(other.slab[2], torch.full(LAYOUT.shape, 1.5))
    with pytest.raises(ValueError, match="slots need"):
        SharedSlab.open(str(slab.path), LAYOUT, 5)
    with pytest.raises(ValueError, match="not a pool node"):
        SharedSlab.open("/etc/passwd", LAYOUT, 4)


def test_a_read_is_valid_only_for_the_key_at_its_generation_complete(slab):
    table = SlotTable(4, LAYOUT.num_kv_heads, "n", on_change=Mirror(slab.meta))
    plan = table.begin_write("r", [key(1), key(2)], [False, True])
    a, b = (
        Location(key(i + 1), "n", s, g)
        for i, (s, g) in enumerate(zip(plan.slots, plan.generations, strict=True))
    )
    assert slab.valid([a, b]) == (0, [])  # being written: not yet
    table.finish_write(plan)
    assert slab.valid([a, b]) == (2, [False, True])  # b is a private tail
    assert slab.valid([Location(key(9), "n", a.slot, a.generation)])[0] == 0  # another key
    assert slab.valid([Location(a.key, "n", a.slot, a.generation + 1)])[0] == 0  # another generation
    assert slab.valid([Location(a.key, "n", 99, a.generation)])[0] == 0  # no such slot
    table.consumed([b])
    assert slab.valid([a, b]) == (1, [False])  # b freed: the read stops there
    assert slab.valid([b], complete=False)[0] == 1  # a copy made before the free is still b's bytes
    table.reserve("c", 4)  # evicts a, reuses b's slot: both generations rise
    assert slab.valid([a], complete=False)[0] == 0 and slab.valid([b], complete=False)[0] == 0


def test_files_of_dead_nodes_are_swept():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    path = SHM_DIR / f"kvferry-pool-{int(dead.stdout)}-deadbeef"
    path.write_bytes(b"")
    mine = SharedSlab.create(LAYOUT, 1, "a11ce")
    try:
        sweep_stale()
        assert not path.exists() and mine.path.exists()  # this process is alive: its file stays
        assert mine.path.name.startswith(f"kvferry-pool-{os.getpid()}-")
    finally:
        path.unlink(missing_ok=True)
        mine.unlink()
