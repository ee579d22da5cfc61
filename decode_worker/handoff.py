"""The decode side of the KV hand-off: what a request carries through each stage.

    admitted -> prealloc -> transfer -> waiting -> running -> finished
               (blocks)    (pool -> cache)  (the engine's queues)

- **prealloc** (`DecodeWorker.prealloc`, a queue in arrival order): the request waits for free cache
  blocks to pull its KV into. The head of the queue takes its local prefix-cache hits and reserves
  blocks for the rest as soon as enough are free.
- **transfer** (`KVPull`, a `kvferry.worker.stages.TransferStage`): the transfer thread pulls the
  blocks from the pool straight into the reserved blocks while the running batch keeps stepping.
- **waiting / running**: the engine's scheduler owns the request (`add_with_kv`): it resumes from
  the tokens whose KV arrived and recomputes the rest, so a pool miss costs time, never correctness.

A colocated request (`prefill_here`) skips the hand-off and goes to the engine whole.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

from kvferry.engine.request import Request
from kvferry.kvpool.metadata import Location
from kvferry.v1 import worker_pb2


@dataclass
class HandoffReport:
    """What the request's first message reports about its hand-off."""

    kv_pull_ms: float = 0.0
    kv_ready: float = 0.0  # when the engine took it (perf_counter)
    pulled_tokens: int = 0
    recomputed_tokens: int = 0


@dataclass
class Stream:
    """One Decode call: its request, the queue its handler thread streams from, its first report."""

    request: worker_pb2.DecodeRequest
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    req: Request | None = None
    report: HandoffReport | None = field(default_factory=HandoffReport)  # None once sent


@dataclass
class KVPull:
    """A request in the transfer stage: the blocks it holds and the ones being filled."""

    stream: Stream
    local: list[int]  # blocks found in the local prefix cache
    reserved: list[int]  # blocks the pulled KV lands in
    remote: list[Location]  # where the rest lies in the pool
