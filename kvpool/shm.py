"""Same-host transport: the pool node's slab in a /dev/shm file that its clients map too.

The file (mode 0600, so only the node's user can map it) is
`[meta: num_slots x (generation, state, key lo, key hi) int64, padded to 4 KiB][slab: num_slots blocks]`.
The node mirrors every slot's (generation, state, key) into `meta` as its `SlotTable` changes them
(`Mirror`). A same-host client then moves KV with one copy and no socket on the data path:
- put: it writes the blocks straight into slots it reserved (`Reserve`), then sends a COMMIT header
  (keys, slots, KV-head slice; `dataplane.py`) on its pair group; the node completes and publishes
  them as for a PUT, and its answer resolves the put's future. A gRPC commit was measured slower: the
  node's Python gRPC server spends more per call than the header costs.
- get: lock-free and RPC-free, a seqlock: check that each slot holds the location's key at its
  generation, complete; copy out; check the generation again. A slot is reused only after its
  generation rose (the node bumps it, and mirrors it here, before it hands the slot to any writer), so
  a copy that raced an eviction fails the second check: a miss, never wrong KV. Private blocks read
  whole are then freed with `Consumed` (the node's rule: freed after their first whole read).
The checks rely on x86-64 store ordering (a writer's stores to the slab become visible after the
generation bump it made before them); on weaker memory models add fences before trusting this path.
Files of nodes that died (kill -9 leaves the file) are removed by the next node that starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from kvferry.kvpool.slots import BlockRef, SlotState
from kvferry.kvpool.transfer import BlockLayout

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_MADV_POPULATE_WRITE = 23
META_COLS = 4  # generation, state, key bytes 0-7, key bytes 8-15 (as little-endian int64)
_NAME = re.compile(r"^kvferry-pool-(\d+)-[0-9a-f]+$")


def shm_host() -> str:
    """Which /dev/shm this process sees: the host's boot id and the device of its /dev/shm mount. Two
    processes with the same value can map each other's slab files; two containers (or emulated hosts)
    on one machine with /dev/shm mounts of their own share the boot id but not the device."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{SHM_DIR.stat().st_dev}"
    except OSError:
        return ""


def key_words(key: bytes) -> tuple[int, int]:
    """A 16-byte block key as the two int64 `meta` columns that hold it."""
    key = key.ljust(16, b"\0")
    return int.from_bytes(key[:8], "little", signed=True), int.from_bytes(key[8:16], "little", signed=True)


def _meta_bytes(num_slots: int) -> int:
    return -(-num_slots * META_COLS * 8 // 4096) * 4096


class SharedSlab:
    """The mapped file: `meta` [num_slots, META_COLS] int64 and `slab` [num_slots, *layout.shape]."""

    def __init__(self, path: Path, layout: BlockLayout, num_slots: int):
        self.path = path
        meta_bytes = _meta_bytes(num_slots)
        size = meta_bytes + num_slots * layout.block_bytes
        if path.stat().st_size != size:
            raise ValueError(f"{path} holds {path.stat().st_size} bytes, {num_slots} slots need {size}")
        raw = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self.meta = raw[: num_slots * META_COLS * 8].view(torch.int64).view(num_slots, META_COLS)
        self.slab = raw[meta_bytes:].view(layout.torch_dtype).view(num_slots, *layout.shape)
        # this process's page tables start empty: a first write to each page faults (a fresh mapping
        # copies at a third of the speed), so fill them in the background, data untouched
        threading.Thread(target=_populate, args=(raw.data_ptr(), size), daemon=True).start()

    @classmethod
    def create(cls, layout: BlockLayout, num_slots: int, tag: str) -> SharedSlab:
        """A new file for this process (0600; its pages allocated now, so a /dev/shm too small fails
        here with ENOSPC rather than with SIGBUS on a later write)."""
        sweep_stale()
        path = SHM_DIR / f"kvferry-pool-{os.getpid()}-{tag}"
        size = _meta_bytes(num_slots) + num_slots * layout.block_bytes
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return cls(path, layout, num_slots)

    @classmethod
    def open(cls, path: str, layout: BlockLayout, num_slots: int) -> SharedSlab:
        """Map a node's file; raises OSError/ValueError when it cannot (another user's, gone, resized)."""
        p = Path(path)
        if p.parent != SHM_DIR or not _NAME.match(p.name):
            raise ValueError(f"{path} is not a pool node's shared slab")
        return cls(p, layout, num_slots)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def valid(self, blocks: Sequence[BlockRef], complete: bool = True) -> tuple[int, list[bool]]:
        """How many leading `blocks` their slots hold now (the key at that generation, and, when
        `complete`, a finished block), and which of those are private."""
        if not blocks:
            return 0, []
        slots = torch.tensor([b.slot for b in blocks], dtype=torch.int64)
        inside = slots < self.meta.shape[0]
        rows = self.meta[slots.clamp(max=self.meta.shape[0] - 1)]  # a copy: one consistent read per row
        want = torch.tensor([[b.generation, *key_words(b.key)] for b in blocks], dtype=torch.int64)
        ok = inside & (rows[:, 0] == want[:, 0]) & (rows[:, 2] == want[:, 1]) & (rows[:, 3] == want[:, 2])
        private = rows[:, 1] == SlotState.PRIVATE
        if complete:
            ok &= private | (rows[:, 1] == SlotState.PUBLISHED)
        n = int(ok.long().cumprod(0).sum())
        return n, private[:n].tolist()


class Mirror:
    """`SlotTable.on_change`: writes a slot's (generation, state, key) into the shared `meta`."""

    def __init__(self, meta: torch.Tensor):
        self.meta = meta.numpy()  # a view of the mapping: per-element writes without torch overhead

    def __call__(self, slot) -> None:
        row = self.meta[slot.index]
        row[2], row[3] = key_words(slot.key)
        row[0] = slot.generation
        row[1] = int(slot.state)


def _populate(addr: int, size: int) -> None:
    """madvise(MADV_POPULATE_WRITE) over the mapping (Linux >= 5.14; a no-op where it is missing)."""
    libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL for the call
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(addr, size, _MADV_POPULATE_WRITE) != 0:
        log.debug("MADV_POPULATE_WRITE: errno %d", ctypes.get_errno())


def sweep_stale() -> None:
    """Remove the slab files of pool nodes whose process is gone (killed before it could clean up)."""
    for path in SHM_DIR.glob("kvferry-pool-*"):
        match = _NAME.match(path.name)
        if match is None or path.stat().st_uid != os.getuid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                path.unlink()
                log.info("removed %s (its pool node is gone)", path)
        except PermissionError:
            continue
