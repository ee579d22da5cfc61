"""Continuous-batching scheduler: a token budget per step, chunked prefill, priorities, preemption by
recompute.

Requests are ordered by (priority, arrival): a lower `priority` value first (vLLM's semantics), then
first come, first served; with every priority equal (the default 0) that is plain FCFS. Each step,
running requests go first in that order (a decode needs one token, an unfinished prefill its next
chunk), then waiting requests are admitted in that order while the token budget, `max_num_seqs` and
free KV blocks allow; the head of the queue is never overtaken. An admitted request takes the cached
blocks of its prefix and computes the rest; on a full hit (every token cached: the length is a
multiple of the block size) only its last token is computed again, for the logits (the model runner
sends that token's K/V to its sink block). When blocks run out for a running request, the last running
one in that order (the lowest priority, then the latest arrival) is preempted: its blocks are freed and
it rejoins the waiting queue at its place to be recomputed (prefix-cache hits make that cheap). When the
head of the waiting queue does not fit (blocks or `max_num_seqs`) and a running request has a strictly
lower priority, that one is preempted for it (equal priorities never preempt each other, so FCFS never
thrashes). Queues a request passes through: waiting -> running -> (preempted -> waiting ->) finished.

A request whose prompt KV is computed elsewhere (a disaggregated decode) starts in `awaiting_kv`
(WAITING_FOR_REMOTE_KV, `park`): held, never scheduled, and finished like any other if aborted there.
When its KV has landed in blocks it holds, `resume` queues it to go on after that KV.

A running decode with draft tokens (`req.spec_tokens`, speculative decoding) is scheduled as its last
token plus the drafts that fit the budget; drafts never cause a preemption (they are dropped first).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from kvferry.engine.block_manager import BlockManager
from kvferry.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048


@dataclass
class ScheduledBatch:
    work: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens computed this step)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, block_manager: BlockManager):
        self.cfg = cfg
        self.blocks = block_manager
        self.waiting: list[Request] = []  # sorted by `order`
        self.running: list[Request] = []  # sorted by `order` at the start of each step
        self.awaiting_kv: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV: not schedulable yet
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of num_preemptions, those made for a higher-priority request
        self._arrivals = 0

    @staticmethod
    def order(req: Request) -> tuple[int, int]:
        """The scheduling order: priority (lower first), then arrival at this scheduler."""
        return req.priority, req.arrival_seq

    def _arrive(self, req: Request) -> None:
        if req.arrival_seq < 0:  # a preempted or resumed request keeps its place
            req.arrival_seq = self._arrivals
            self._arrivals += 1

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=self.order)

    def add(self, req: Request) -> None:
        self._arrive(req)
        self._enqueue(req)

    def park(self, req: Request) -> None:
        """Hold req until its prompt KV arrives from elsewhere (`resume`)."""
        self._arrive(req)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.awaiting_kv[req.request_id] = req

    def resume(self, req: Request) -> None:
        """req's KV arrived (in req.block_ids, covering req.num_computed_tokens): queue it."""
        del self.awaiting_kv[req.request_id]
        req.status = RequestStatus.WAITING
        self._enqueue(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self.running.sort(key=self.order)
        budget = self._schedule_running(batch, self.cfg.max_num_batched_tokens)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(remaining, budget)
            if req.spec_tokens:  # a decode with drafts (engine.spec_decode): its token and as many drafts
                req.spec_tokens = req.spec_tokens[: budget - 1] if remaining == 1 else []
                if req.spec_tokens and self.blocks.allocate(req, 1 + len(req.spec_tokens)):
                    n = 1 + len(req.spec_tokens)
                else:  # drafts never cost a preemption
                    req.spec_tokens = []
            while not self.blocks.allocate(req, n):
                victim = self.running.pop()  # the last in order; never one already scheduled (before `index`)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    return budget
            batch.work.append((req, n))
            budget -= n
            index += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if len(self.running) >= self.cfg.max_num_seqs:
                freed = self._preempt_for(req, batch)
                if freed is None:
                    return
                budget += freed
                continue
            if req.block_ids:  # arrived with its KV (pulled from the pool): resume after it
                cached, num_cached, overlap = [], req.num_computed_tokens, 0
            elif req.params.prompt_logprobs is not None:  # every prompt token is computed, to score it
                cached, num_cached, overlap = [], 0, 0
            else:
                cached = self.blocks.cached_prefix(req)
                num_cached = len(cached) * self.blocks.block_size
                # a full hit still computes the last token, for its logits: inside the last cached block
                overlap = int(num_cached == req.num_tokens)
                num_cached -= overlap
            n = min(req.num_tokens - num_cached, budget)
            if not self.blocks.allocate(req, n - overlap, cached):
                freed = self._preempt_for(req, batch)
                if freed is None:
                    return
                budget += freed
                continue  # looked up again: the victim's freed blocks may have left the prefix cache
            self.waiting.pop(0)
            if req.status == RequestStatus.WAITING and cached:
                req.num_cached_tokens = num_cached
                self.blocks.hits += num_cached
            if cached:  # registered already: the model runner never writes them (see ModelRunner)
                req.num_committed_blocks = len(cached)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.work.append((req, n))
            budget -= n

    def _preempt_for(self, req: Request, batch: ScheduledBatch) -> int | None:
        """Preempt the last running request in order if its priority is strictly lower than waiting
        `req`'s (taking back its place in this step's batch, if it had one); returns the tokens that
        gives back to the budget, or None when no running request ranks below `req`."""
        if not self.running:
            return None
        victim = max(self.running, key=self.order)
        if victim.priority <= req.priority:
            return None
        freed = 0
        for i, (r, n) in enumerate(batch.work):
            if r is victim:
                del batch.work[i]
                freed = n
                break
        self.running.remove(victim)
        self._preempt(victim)
        self.num_priority_preemptions += 1
        batch.preempted.append(victim)
        return freed

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req)
        req.spec_tokens = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self._enqueue(req)

    def update(self, batch: ScheduledBatch) -> list[Request]:
        """Advance computed-token counters; returns the requests that reached their last token. A row's
        drafts are not counted here: the engine counts those the target accepted."""
        done = []
        for req, n in batch.work:
            req.num_computed_tokens += n - len(req.spec_tokens)
            self.blocks.commit(req)
            if req.num_computed_tokens == req.num_tokens:
                done.append(req)
        return done

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove req from whichever queue holds it and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif self.awaiting_kv.pop(req.request_id, None) is None and req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req)
        req.status = status
