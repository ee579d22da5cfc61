"""The engine's KV hand-off API: what a worker does with the KV of a request that is computed, or goes on,
in another process.

The workers move KV between the engine's paged cache and the pool; the engine owns the cache, its block
references and the requests' states. So every operation a worker needs is here, named for what it
means, and a worker never reaches into the block manager, the scheduler or the model runner
(tests/unit/test_layering.py checks it). `LLMEngine.kv` is the engine's instance.

- **Keys**: `prompt_keys` hashes a request's full prompt blocks once (the prefix cache's keys,
  `engine.block_hash`); `adopt_keys` takes the keys another process hashed (the router) instead.
- **Blocks**: `hold_cached` pins the blocks the local prefix cache holds for leading keys, `reserve`
  takes free blocks for KV that will arrive, `arrived` makes pulled blocks findable in the prefix cache,
  `release` drops the references a worker took. `cache` is the paged cache the KV lands in and is read
  from (the pool's pack/land copies take block ids in it).
- **A request waiting on remote KV** (the decode side): `await_kv` puts an admitted request in the
  scheduler's WAITING_FOR_REMOTE_KV state (held, counted, never scheduled; an abort finishes it like any
  other); `kv_arrived` hands it the blocks its KV landed in and the first token sampled elsewhere, and the
  scheduler resumes it from there (whatever did not arrive is recomputed).
- **Export** (the prefill side): `on_finished` is called with each request that finishes, before its
  blocks are freed (`block_ids` names the cache blocks of its prompt blocks); `on_layers` is given each
  step's batch before its forward pass and may return a callback run after every layer.
- `load` is what a worker reports about the engine (queues, blocks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvferry.engine.block_hash import chain_key
from kvferry.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvferry.engine.engine import LLMEngine
    from kvferry.engine.scheduler import ScheduledBatch


class KVHandoff:
    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self._blocks = engine.block_manager
        self._scheduler = engine.scheduler
        self.block_size = engine.cfg.block_size
        self.caching = self._blocks.enable_caching
        self.finished_hook: Callable[[Request], None] | None = None
        self.layers_hook: Callable[[ScheduledBatch], Callable[[int], None] | None] | None = None

    @property
    def cache(self) -> torch.Tensor:
        """The paged KV cache: [layers, 2, blocks, KV heads, block size, head dim] on this rank."""
        return self._engine.runner.kv_cache

    # -- keys -------------------------------------------------------------------------------------------
    def prompt_keys(self, req: Request) -> list[bytes]:
        """The keys of req's full prompt blocks (hashed once per request: later calls reuse them)."""
        self._blocks.update_keys(req)
        return req.block_keys[: req.num_prompt_tokens // self.block_size]

    def adopt_keys(self, req: Request, keys: Sequence[bytes]) -> bool:
        """Use keys hashed elsewhere (by the router, from the same prompt and this engine's fingerprint)
        for req's leading blocks; the engine hashes only what they do not cover. The last key's link is
        checked against req's tokens (one block's hash): keys of another prompt are refused (False),
        and the engine hashes the prompt itself."""
        n, bs = len(keys), self.block_size
        if req.block_keys or not keys or n > req.num_tokens // bs:
            return False
        parent = keys[-2] if n > 1 else req.salt_key
        if chain_key(parent, req.token_ids((n - 1) * bs, bs), self._blocks.fingerprint) != keys[-1]:
            return False
        req.block_keys = list(keys)
        return True

    def blocks_needed(self, num_tokens: int) -> int:
        return self._blocks.blocks_needed(num_tokens)

    # -- blocks -----------------------------------------------------------------------------------------
    def hold_cached(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the local prefix cache's blocks for the leading `keys` (stops at the first miss)."""
        return self._blocks.take_cached(list(keys))

    def reserve(self, count: int) -> list[int] | None:
        """`count` free blocks for KV that arrives from elsewhere; None if too few are free."""
        return self._blocks.reserve(count)

    def arrived(self, block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """KV under `keys` landed in these held blocks: the local prefix cache finds it from now on."""
        for block_id, key in zip(block_ids, keys, strict=False):
            self._blocks.register(block_id, key)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop the references `hold_cached` / `reserve` took."""
        self._blocks.release(list(block_ids))

    def blocks_in_use(self) -> int:
        """Blocks some request holds (0: a request that does not fit now never will)."""
        return self._blocks.num_blocks - self._blocks.num_free_blocks

    @staticmethod
    def block_ids(req: Request, indices: Sequence[int]) -> list[int]:
        """The cache blocks holding these blocks of req (indices into its token blocks)."""
        return [req.block_ids[i] for i in indices]

    # -- a request whose KV comes from elsewhere ----------------------------------------------------------
    def await_kv(self, req: Request) -> None:
        """Admit req (made by `LLMEngine.make_request`) to wait for its prompt's KV: it is the engine's
        from now on (an abort finishes it), but the scheduler runs it only after `kv_arrived`."""
        self._engine.track(req)
        self._scheduler.park(req)

    def kv_arrived(
        self, req: Request, first_token: int, block_ids: Sequence[int], num_kv_tokens: int
    ) -> None:
        """req's prompt KV lies in `block_ids` (held for it: the engine owns the references now), covering
        `num_kv_tokens` tokens, and its first output token was sampled elsewhere. The scheduler resumes it
        from `num_kv_tokens` (the rest of the prompt is recomputed here)."""
        e = self._engine
        state = e.states[req.request_id]
        req.block_ids = list(block_ids)
        req.num_computed_tokens = num_kv_tokens
        finished = state.add_token(first_token)
        state.pending_ids, state.pending_logprobs = [], []  # the first token was streamed by the prefill side
        if finished is not None:
            self._scheduler.finish(req, finished)
            e.finished_elsewhere(state)
            return
        self._scheduler.resume(req)

    def awaiting(self, request_id: str) -> bool:
        """Whether the request waits for its remote KV (admitted by `await_kv`, not yet arrived)."""
        return request_id in self._scheduler.awaiting_kv

    # -- export -----------------------------------------------------------------------------------------
    def watch_cache(self) -> deque:
        """The local prefix cache's changes from now on, as (kind, key) pairs (BlockManager.watch):
        what a worker publishes as KV events (kvpool.kv_events)."""
        return self._blocks.watch()

    def on_finished(self, fn: Callable[[Request], None] | None) -> None:
        """Call fn(req) with each request that finishes, before its blocks are freed (in the step)."""
        self.finished_hook = fn

    def on_layers(self, fn: Callable[[ScheduledBatch], Callable[[int], None] | None] | None) -> None:
        """Give fn each step's batch before its forward pass; the callback it returns (or None) runs
        after every layer of that forward pass, with the layer's index."""
        self.layers_hook = fn

    # -- figures ----------------------------------------------------------------------------------------
    def load(self) -> dict:
        s, b = self._scheduler, self._blocks
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "waiting_for_kv": len(s.awaiting_kv),
            "free_blocks": b.num_free_blocks,
            "total_blocks": b.num_blocks,
            # since start: running requests preempted, and of those the ones for a higher priority
            "preemptions": s.num_preemptions,
            "priority_preemptions": s.num_priority_preemptions,
        }

    def step_cost(self) -> list[float] | None:
        """The engine's fitted step-time model (engine.cost_model), as [fixed_ms, per_token_ms,
        per_kpair_ms] for a heartbeat; None before enough steps."""
        fit = self._engine.step_costs.fit()
        return None if fit is None else fit.to_list()


__all__ = ["KVHandoff", "RequestStatus"]
