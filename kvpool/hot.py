"""Hot blocks: a block that readers pull from a node over the network again and again is copied to other
pool nodes, so its reads spread over them and the death of one node does not take it away.

The node counts the gets it serves over pair groups (`HotBlocks.read`; one per get of the block's first
KV-head slice, so a tensor-parallel reader counts once): a block read `reads` times within `window_s`
is hot. A same-host reader copies out of the shared slab without telling the node, and is not counted:
for it the block is as near as it can be. A hot block goes on a queue (once per window), and the
`replicator` thread copies the queued blocks out of the slab (under the node's lock, only while the
slot still holds the key) and puts them on the live nodes that hold no copy yet, the ones with the most
free slots first, until the block has `replicas` copies (the copies Redis knows of count). It writes
through an ordinary `PoolClient` (shared memory to a node on this host, else the pair group); each
target publishes its copy itself, so readers find it as one of the block's replicas
(`MetadataStore.lookup`). A copy is a block like any other: LRU eviction may take it again.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from kvferry.kvpool.client import PoolClient
from kvferry.kvpool.dataplane import PoolError
from kvferry.kvpool.metadata import DISK_SLOT, Location

log = logging.getLogger(__name__)

TRACKED_KEYS = 65536  # read counts kept at most (least recently read dropped first)
BATCH = 64  # hot blocks copied per round


class HotBlocks:
    """Read counts per key and the queue of hot blocks (`reads` = 0: off)."""

    def __init__(self, reads: int, window_s: float, replicas: int):
        self.reads, self.window_s, self.replicas = reads, window_s, replicas
        self.lock = threading.Lock()
        self.counts: OrderedDict[bytes, tuple[float, int]] = OrderedDict()  # key -> (window start, reads)
        self.queued: OrderedDict[bytes, float] = OrderedDict()  # key -> when it was last found hot
        self.hot: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.copied = 0  # copies made (counted when the target answered)
        self.failed = 0

    @property
    def enabled(self) -> bool:
        return self.reads > 0 and self.replicas > 1

    def read(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """Count one read of each of `keys`; queue the ones that just became hot."""
        if not self.enabled:
            return
        now = time.monotonic() if now is None else now
        with self.lock:
            for key in keys:
                start, n = self.counts.pop(key, (now, 0))
                if now - start > self.window_s:
                    start, n = now, 0
                self.counts[key] = (start, n + 1)
                if n + 1 == self.reads and now - self.queued.get(key, -1e18) > self.window_s:
                    self.queued.pop(key, None)
                    self.queued[key] = now
                    self.hot.put(key)
            for entries in (self.counts, self.queued):
                while len(entries) > TRACKED_KEYS:
                    entries.popitem(last=False)

    def take(self, timeout: float) -> list[bytes]:
        """The queued hot blocks (up to BATCH), waiting up to `timeout` for the first."""
        try:
            keys = [self.hot.get(timeout=timeout)]
        except queue.Empty:
            return []
        while len(keys) < BATCH and not self.hot.empty():
            keys.append(self.hot.get())
        return keys

    def stats(self) -> dict[str, int]:
        return {"hot_copies": self.copied, "hot_copy_failures": self.failed}


def replicator(
    hot: HotBlocks,
    client: PoolClient,
    node_id: str,
    read_blocks: Callable[[list[bytes]], dict[bytes, torch.Tensor]],
    stop: threading.Event,
) -> None:
    """Copy the hot blocks to other nodes until `stop` (see the module docstring). `read_blocks(keys)`
    copies out the blocks the node still holds (published, under its lock)."""
    while not stop.is_set():
        keys = hot.take(timeout=0.5)
        if not keys:
            continue
        try:
            _copy(hot, client, node_id, keys, read_blocks)
        except Exception:  # never let one round end the thread
            log.exception("copying %d hot blocks failed", len(keys))


def _copy(hot: HotBlocks, client: PoolClient, node_id: str, keys: list[bytes], read_blocks) -> None:
    nodes = client.refresh(max_age_s=1.0)
    targets: dict[str, list[bytes]] = {}  # node -> the hot keys it gets a copy of
    for key, loc in zip(keys, client.meta.lookup(keys), strict=True):
        holders = {node_id} | _holders(loc)
        missing = hot.replicas - len(holders)
        free = sorted(
            (n for n in nodes if n not in holders),
            key=lambda n: (nodes[n].get("free_slots", 0), n),
            reverse=True,
        )
        for target in free[: max(0, missing)]:
            targets.setdefault(target, []).append(key)
    if not targets:
        return
    blocks = read_blocks(sorted({k for ks in targets.values() for k in ks}))
    for target, wanted in targets.items():
        wanted = [k for k in wanted if k in blocks]
        if not wanted:
            continue
        data = torch.stack([blocks[k] for k in wanted])
        try:
            future = client.put_async(f"hot-copy-{node_id}", wanted, data, node_id=target)
        except PoolError as err:
            log.warning("copying %d hot blocks to %s failed: %s", len(wanted), target, err)
            hot.failed += len(wanted)
            continue
        future.add_done_callback(functools.partial(_counted, hot, n=len(wanted), target=target))


def _holders(loc: Location | None) -> set[str]:
    """The nodes holding the block in memory, by what Redis says."""
    if loc is None:
        return set()
    return {c.node_id for c in loc.copies() if c.slot != DISK_SLOT}


def _counted(hot: HotBlocks, future, n: int, target: str) -> None:
    """A copy of `n` hot blocks to `target` was answered."""
    if future.exception() is not None:
        log.warning("copying %d hot blocks to %s failed: %s", n, target, future.exception())
        hot.failed += n
        return
    stored = sum(loc is not None for loc in future.result())
    hot.copied += stored
    hot.failed += n - stored
