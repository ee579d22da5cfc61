"""Layer-wise streaming of a prompt's KV to the pool while the prefill computes.

Without it the prompt's KV goes to the pool after the last layer of the last chunk (`KVWrite`). With
it, each step's forward pass calls back after every layer (`KVHandoff.on_layers`, the model's
`after_layer`): the full prompt blocks that this step completes are final at that layer from then
on, so that layer's slice of them is copied out of the paged cache and put to the pool
(`PoolClient.put_async(layers=(l, l + 1))`) while the next layers compute; the pool node assembles
each block from its layer slices and publishes it once the last layer is in. Chunked prefill streams
each chunk's blocks during its own step, so at the end only the private tail block (and any blocks
that came from the local prefix cache and the pool lacks) is left for the `KVWrite`.

A block is streamed only if it is computed in this request's steps (hits came from a cache) and only
to the nodes picked at the request's first step (every layer of a block must reach the same nodes).
Tensor-parallel groups do not stream (their other ranks write their slices after the prefill).
A request that ends before its last layer is put (aborted, failed) leaves blocks the node frees after
its assemble timeout.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvferry.engine.scheduler import ScheduledBatch
from kvferry.kvpool.client import PoolClient, PoolError, failed_future
from kvferry.kvpool.transfer import pack_blocks

log = logging.getLogger(__name__)


@dataclass
class Streamed:
    """What one request streamed: its blocks (prompt block indices) and, per step, the future of the
    last layer's put (it completes once those blocks are whole on the node)."""

    nodes: list[str]
    blocks: list[int] = field(default_factory=list)
    futures: list[tuple[list[int], concurrent.futures.Future]] = field(default_factory=list)
    first: int = -1  # the first prompt block computed here (before it: cache hits)


@dataclass
class _Part:
    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    streamed: Streamed
    indices: list[int]
    failed: Exception | None = None  # a layer's put failed: the later ones are not sent


class LayerStreamer:
    """The prefill worker's layer hook (`engine.kv.on_layers`, engine thread). What each request streamed
    is kept in `streams` (by request id) until the worker takes it at finish (`take`)."""

    def __init__(self, engine, pool: PoolClient, heads: tuple[int, int], active: Callable[[str], bool]):
        self.engine, self.pool, self.heads = engine, pool, heads
        self.active = active  # whether a request id is a prefill job of this worker
        self.streams: dict[str, Streamed] = {}
        self.num_layers = engine.kv.cache.shape[0]

    def take(self, request_id: str) -> Streamed | None:
        return self.streams.pop(request_id, None)

    def hook(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        """Before the step's forward: the blocks each prefill completes in it; the per-layer callback."""
        bs = self.engine.cfg.block_size
        parts = []
        for req, n in batch.work:
            rid = req.request_id
            if not self.active(rid) or req.num_computed_tokens >= req.num_prompt_tokens:
                continue
            streamed = self.streams.get(rid)
            if streamed is None:
                try:
                    streamed = Streamed(self.pool.pick_nodes(wait=False))
                except PoolError as err:
                    log.warning("no pool node to stream %s to: %s", rid, err)
                    continue
                streamed.first = -(-req.num_computed_tokens // bs)  # the first block not whole yet
                self.streams[rid] = streamed
            done = min(req.num_computed_tokens + n, req.num_prompt_tokens) // bs
            start = max(streamed.first, streamed.blocks[-1] + 1 if streamed.blocks else 0)
            indices = list(range(start, done))
            if not indices or len(req.block_keys) < done:
                continue
            streamed.blocks += indices
            keys = [req.block_keys[i] for i in indices]
            parts.append(_Part(rid, keys, self.engine.kv.block_ids(req, indices), streamed, indices))
        if not parts:
            return None
        return lambda layer: self._put_layer(parts, layer)

    def _put_layer(self, parts: list[_Part], layer: int) -> None:
        # called inside the forward's inference mode: a tensor made there (a copy, a transfer buffer the
        # pool client grows) could never be written in place by the pool client's other threads
        with torch.inference_mode(False):
            self._put_slices(parts, layer)

    def _put_slices(self, parts: list[_Part], layer: int) -> None:
        cache = self.engine.kv.cache
        last = layer == self.num_layers - 1
        for part in parts:
            if part.failed is None:
                try:
                    data = pack_blocks(cache[layer : layer + 1], part.block_ids, *self.heads)
                    future = self.pool.put_async(
                        part.request_id,
                        part.keys,
                        data,
                        (),
                        part.streamed.nodes,
                        *self.heads,
                        layers=(layer, layer + 1),
                    )
                except Exception as err:  # never fails the step: the request is answered without them
                    log.warning("streaming layer %d of %s failed: %s", layer, part.request_id, err)
                    part.failed = err
            if last:
                outcome = failed_future(part.failed) if part.failed is not None else future
                part.streamed.futures.append((part.indices, outcome))


def missing_on_failure(
    future: concurrent.futures.Future, n: int, request_id: str
) -> concurrent.futures.Future:
    """`future`'s locations, or n Nones (not stored: the decode recomputes them) if it failed."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def settle(f: concurrent.futures.Future) -> None:
        if f.exception() is not None:
            log.warning("streamed blocks of %s not stored: %s", request_id, f.exception())
            out.set_result([None] * n)
        else:
            out.set_result(f.result())

    future.add_done_callback(settle)
    return out
