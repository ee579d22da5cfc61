"""The prefill side of the KV hand-off: what a request carries through each stage.

    admitted -> prefix lookup -> prefix pull -> prefilling -> KV write -> answered
               (pool metadata)  (pool -> cache)  (the engine)  (cache -> pool)

- **prefix lookup**: which of the prompt's full blocks the pool holds. The router looked them up
  already and sent the answer with the request (its block keys too); only a request that comes
  without it (a direct call) gets its own lookup (`PrefixLookup`, on the lookup thread: one Redis
  lookup). Either way the request is looked up once, never on the engine thread.
- **prefix pull** (`PrefixPull`, transfer thread): the pooled blocks past the ones the worker's own
  prefix cache holds land in cache blocks reserved for them; they are registered in the local prefix
  cache, so the scheduler simply sees a prefix hit.
- **prefilling**: the request is in the engine (chunked prefill; one token sampled).
- **KV write** (`KVWrite`, transfer thread): when the engine finishes the request, its prompt KV is
  copied out of the paged cache (before the blocks are freed) and the blocks the pool lacks are
  written: full blocks shared by key (those the lookup did not find in the pool; the node drops a block
  it completed meanwhile), the partial tail as the request's private block. The pool's
  reply answers the request at once (`PrefillJob.future`), with the first token and every block's
  location.

Each stage is a `kvferry.worker.stages.TransferStage` the engine loop polls; nothing is kept per
request after the answer.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch

from kvferry.engine.request import Request
from kvferry.kvpool.metadata import Location
from kvferry.model.sampler import Sampled, TokenLogprob
from kvferry.v1 import worker_pb2


@dataclass
class PrefillJob:
    """One Prefill call, from admission to its answer."""

    request: worker_pb2.PrefillRequest
    arrived: float
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    req: Request | None = None
    holder: list[int] = field(default_factory=list)  # local + pulled blocks, pinned until admission
    started: float = 0.0
    pool_hit_blocks: int = 0
    pooled: list[Location] = field(default_factory=list)  # the lookup: the pool's leading blocks
    matcher: object | None = None  # its structured output's matcher (compiled in the gRPC handler)


@dataclass
class PrefixLookup:
    job: PrefillJob
    keys: list[bytes]  # the prompt's full-block keys


@dataclass
class PrefixPull:
    job: PrefillJob
    keys: list[bytes]  # the keys of `locations`, in order
    locations: list[Location]
    reserved: list[int]  # cache blocks they land in


@dataclass
class KVWrite:
    """The prompt's KV on its way to the pool, and everything the answer reports."""

    job: PrefillJob
    first_token: int
    first_logprob: TokenLogprob | None  # when the request asks for logprobs
    prompt_logprobs: list[TokenLogprob]  # when it asks for prompt logprobs
    siblings: list[Sampled]  # sampling.n > 1: the first tokens of the other sequences
    locations: list[Location | None]  # per prompt block: where the pool holds it (None: not yet)
    write: list[int]  # prompt blocks to send (the pool lacks them)
    keys: list[bytes]  # their keys (the private tail: a random one)
    private: list[bool]
    block_ids: list[int]
    data: torch.Tensor | None  # the blocks' bytes, copied out of the paged cache
    nodes: list[str] | None  # a tensor-parallel group writes every rank's slice to the same nodes
    # blocks streamed layer by layer during the prefill (`streaming.py`): (prompt block indices, the
    # future of their locations), added to `write` when the KV write starts
    streamed: list
    cached_tokens: int
    pool_cached_tokens: int
    computed_tokens: int
    prefill_done: float
    put_started: float = 0.0
