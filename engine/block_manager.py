"""Paged KV block manager with ref counts and a local prefix cache keyed by the block-key hash chain.

Free blocks sit in an LRU queue. A freed block keeps its key (and stays findable) until it is handed
out again, so a later request with the same prefix can take it back: eviction is LRU over unreferenced
blocks. Only full blocks get keys; the tail block of a request is private.

`watch()` reports the prefix cache's changes (a key becomes findable: STORED; stops being: REMOVED) as
they happen, appended to a deque another thread drains (a prefill worker publishes them as KV events,
`kvpool.kv_events`); unwatched, a change costs one attribute test.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from kvferry.engine.block_hash import block_keys
from kvferry.engine.request import Request

# the kinds of prefix-cache change `watch()` reports (the strings of kvpool.kv_events' entries)
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, fingerprint: bytes, enable_caching: bool = True):
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.hits = 0  # prompt tokens served from the cache, over the engine's lifetime
        self.changes: deque[tuple[str, bytes | None]] | None = None  # what `watch()` returned

    def watch(self) -> deque[tuple[str, bytes | None]]:
        """Report every change of the prefix cache from now on, in order, on the deque returned:
        (STORED, key) when a full block becomes findable under `key`, (REMOVED, key) when it stops being.
        It starts with (CLEARED, None) and a STORED for each key cached now, so its reader's view is
        whole. Call it on the engine thread, or before the engine runs; the reader pops from the left on
        any thread (a deque's append and popleft are atomic)."""
        changes: deque[tuple[str, bytes | None]] = deque([(CLEARED, None)])
        changes.extend((STORED, key) for key in self.cached)
        self.changes = changes
        return changes

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_keys(self, req: Request) -> None:
        """Extend req.block_keys to cover every full block of its tokens."""
        have = len(req.block_keys)
        if req.num_tokens // self.block_size > have:
            parent = req.block_keys[-1] if have else req.salt_key
            req.block_keys += block_keys(req.all_token_ids, self.block_size, self.fingerprint, parent, have)

    def cached_prefix(self, req: Request) -> list[int]:
        """Block ids holding the longest cached prefix of req's full blocks (all of them on a full hit:
        the scheduler then recomputes only the last token)."""
        if not self.enable_caching:
            return []
        self.update_keys(req)
        hit = []
        for key in req.block_keys[: req.num_tokens // self.block_size]:
            block_id = self.cached.get(key)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give req blocks for num_new_tokens more tokens (after taking the `cached` prefix blocks).

        Returns False, changing nothing, when there are not enough free blocks.
        """
        total = self.blocks_needed(req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens)
        new = total - len(req.block_ids) - len(cached)
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        if new + revived > self.num_free_blocks:
            return False
        for block_id in cached:
            self._take(block_id)
        req.block_ids += cached
        for _ in range(max(new, 0)):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict_key(self.blocks[block_id])
            self._take(block_id)
            req.block_ids.append(block_id)
        return True

    def commit(self, req: Request) -> None:
        """Register req's blocks that are full of computed tokens in the prefix cache."""
        if not self.enable_caching:
            return
        full = req.num_computed_tokens // self.block_size
        if full == 0:
            return
        self.update_keys(req)
        for index in range(req.num_committed_blocks, full):
            block = self.blocks[req.block_ids[index]]
            if block.key is None and req.block_keys[index] not in self.cached:
                block.key = req.block_keys[index]
                self.cached[block.key] = block.block_id
                if self.changes is not None:
                    self.changes.append((STORED, block.key))
        req.num_committed_blocks = max(req.num_committed_blocks, full)

    def free(self, req: Request) -> None:
        """Drop req's references; tail blocks enter the LRU queue first so they are evicted first."""
        self.release(req.block_ids)
        req.block_ids = []
        req.num_committed_blocks = 0

    def reserve(self, count: int) -> list[int] | None:
        """Take `count` free blocks (ref 1) for KV that arrives from elsewhere; None if too few are free."""
        if count > self.num_free_blocks:
            return None
        out = []
        for _ in range(count):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict_key(self.blocks[block_id])
            self._take(block_id)
            out.append(block_id)
        return out

    def take_cached(self, keys: list[bytes]) -> list[int]:
        """Take a reference on the blocks caching the leading `keys` (stops at the first miss)."""
        out = []
        for key in keys:
            block_id = self.cached.get(key) if self.enable_caching else None
            if block_id is None:
                break
            self._take(block_id)
            out.append(block_id)
        return out

    def register(self, block_id: int, key: bytes) -> None:
        """Make a held block findable in the prefix cache under `key` (its KV must already be there)."""
        if not self.enable_caching or key in self.cached:
            return
        block = self.blocks[block_id]
        self._evict_key(block)
        block.key = key
        self.cached[key] = block_id
        if self.changes is not None:
            self.changes.append((STORED, key))

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block (those taken by reserve/take_cached)."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_queue.pop(block_id, None)
        block.ref_count += 1

    def _evict_key(self, block: Block) -> None:
        if block.key is not None:
            if self.cached.get(block.key) == block.block_id:
                del self.cached[block.key]
                if self.changes is not None:
                    self.changes.append((REMOVED, block.key))
            block.key = None

    def check_invariants(self) -> None:
        """Raise AssertionError if ref counts and the free queue disagree (used by tests)."""
        for block in self.blocks:
            if (block.ref_count == 0) != (block.block_id in self.free_queue):
                raise AssertionError(
                    f"block {block.block_id}: ref {block.ref_count} vs free-queue membership"
                )
            if block.ref_count < 0:
                raise AssertionError(f"block {block.block_id} has ref {block.ref_count}")
        for key, block_id in self.cached.items():
            if self.blocks[block_id].key != key:
                raise AssertionError(f"cache entry for block {block_id} does not match its key")
