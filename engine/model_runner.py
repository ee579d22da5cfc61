"""Turns a scheduled batch into one ragged forward pass over the paged KV cache, then samples."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvferry.engine.request import Request
from kvferry.engine.scheduler import ScheduledBatch
from kvferry.engine.structured import fill_mask, masks
from kvferry.kernels.int8 import kv_row_width
from kvferry.model.attention import AttentionMetadata, PrefillChunk
from kvferry.model.qwen3_moe import MtpInputs, Qwen3MoeModel
from kvferry.model.sampler import (
    Sampled,
    SampleRow,
    argmax_rows,
    sample,
    speculative_sample,
    token_logprobs,
)


def kv_block_bytes(model: Qwen3MoeModel, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of this rank's cache (its KV heads only under tensor parallelism)."""
    cfg = model.cfg
    width = kv_row_width(cfg.kv_cache_dim, dtype)
    return cfg.num_cache_layers * 2 * block_size * model.num_local_kv_heads * width * dtype.itemsize


@dataclass
class StepInputs:
    """One forward pass, flattened: what a tensor-parallel leader sends its followers (as a GroupStep,
    `kvferry.prefill_worker.tp`)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_blocks: list[int] = field(default_factory=list)
    slot_offsets: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    prefills: list[tuple[int, int, int, list[int]]] = field(
        default_factory=list
    )  # q_start, q_len, ctx, table
    sample_rows: list[int] = field(default_factory=list)
    # a model with an MTP layer: each token's previous hidden state for its MTP cache row (`MtpInputs`): a
    # row of this step (>= 0), none (-1: the row goes to the sink), or mtp_saved[-2 - value] (the leader's
    # own: a tensor-parallel leader never sends these, it recomputes a token instead)
    mtp_prev: list[int] = field(default_factory=list)
    mtp_saved: list[torch.Tensor] = field(default_factory=list)


class ModelRunner:
    """The paged cache holds the block manager's `num_blocks` blocks and one more, the sink (id
    `num_blocks`, never handed out): a token computed again although its K/V is already cached (a full
    prefix hit's last token, for its logits) writes its K/V there, and attends over the cached K/V of
    every position, its own included. So a block registered in the prefix cache is never written: it
    may be shared by other requests and published in the pool, and a recomputation in another batch
    shape need not give the same bits. Everything else in the sink is garbage nobody reads."""

    def __init__(
        self,
        model: Qwen3MoeModel,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype | None = None,
    ):
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sink_block = num_blocks
        dtype = kv_dtype or model.embed.dtype
        # [L, 2 (K/V), Hkv, num_blocks + 1 (the sink), block_size, D]: head-major for batched attention reads
        # (an int8 cache: D + 4, each row's values and its scale)
        width = kv_row_width(cfg.kv_cache_dim, dtype)
        shape = (cfg.num_cache_layers, 2, model.num_local_kv_heads, num_blocks + 1, block_size, width)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.hidden: torch.Tensor | None = None  # a model with an MTP layer: the last step's hidden states
        self.eos_ids: tuple[int, ...] = ()  # what a grammar in its error state allows (ends the request)
        # tensor-parallel leader: each step's inputs go to the followers before the forward pass
        self.broadcast_step: Callable[[StepInputs], None] | None = None

    def run(self, batch: ScheduledBatch) -> dict[Request, Sampled | list[Sampled]]:
        """Compute every scheduled token; sample for the requests whose last token was computed (and
        score the prompt tokens of the requests that ask for prompt logprobs). A decode with drafts
        (`req.spec_tokens`) gets a list: the drafts the target accepted and one token of its own."""
        # decode rows first: single tokens, and the tokens of a decode with drafts (each attends like a
        # decode of its own position: the K/V of the drafts before it are written first, in each layer)
        work = sorted(batch.work, key=lambda item: item[1] != 1 and not item[0].spec_tokens)
        step = StepInputs()
        sampled_reqs = []
        scored: list[tuple[Request, int, int]] = []  # (request, first position, count): prompt logprobs
        score_rows: list[int] = []
        bs = self.block_size
        spec: list[tuple[Request, int]] = []  # (request, its first row): decodes with drafts
        spec_rows: list[int] = []
        mtp = self.model.mtp is not None
        kept: list[tuple[Request, int, int]] = []  # MTP: (request, its first row, its first position)
        for req, n in work:
            start = req.num_computed_tokens
            extra = mtp and self._recompute_for_mtp(req, start)
            if extra:  # position start - 1 again, for its hidden state (its K/V to the sink: cached)
                step.input_ids += req.token_ids(start - 1, 1)
                step.positions.append(start - 1)
                step.slot_blocks.append(self.sink_block)
                step.slot_offsets.append((start - 1) % bs)
            row = len(step.input_ids)
            if mtp:  # (the recomputed token's own MTP row: unknown, to the sink)
                kept.append((req, row, start))
                step.mtp_prev += [-1] * extra
                step.mtp_prev += [
                    self._mtp_first_prev(step, req, start, row, extra),
                    *range(row, row + n - 1),
                ]
            drafts = req.spec_tokens
            step.input_ids += req.token_ids(start, n - len(drafts)) + drafts
            step.positions += range(start, start + n)
            cached = req.num_committed_blocks * bs  # K/V already there: never written again
            step.slot_blocks += [
                req.block_ids[p // bs] if p >= cached else self.sink_block for p in range(start, start + n)
            ]
            step.slot_offsets += [p % bs for p in range(start, start + n)]
            if n == 1 or drafts:
                step.decode_tables += [req.block_ids] * (n + extra)
                step.decode_lens += range(start + 1 - extra, start + n + 1)
            else:
                step.prefills.append((row - extra, n + extra, start + n, req.block_ids))
            if drafts:  # logits at the last token and after each draft
                spec.append((req, len(spec_rows)))
                spec_rows += range(row, row + n)
            elif start + n == req.num_tokens:
                step.sample_rows.append(row + n - 1)
                sampled_reqs.append(req)
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                end = min(start + n, req.num_prompt_tokens - 1)  # position p scores prompt token p + 1
                scored.append((req, start, end - start))
                score_rows += range(row, row + end - start)
        num_sampled = len(step.sample_rows)
        step.sample_rows += spec_rows + score_rows  # after the sampled rows: their logits come first
        if self.broadcast_step is not None:
            self.broadcast_step(step)
        logits = self.execute(step)
        if not sampled_reqs and not scored and not spec:
            self._keep_mtp_hidden(kept, {}, batch)
            return {}
        if scored:
            self._score_prompts(logits, num_sampled + len(spec_rows), scored)
        verified = {
            req: speculative_sample(
                logits[num_sampled + at : num_sampled + at + len(req.spec_tokens) + 1],
                self._draft_rows(req),
                req.spec_tokens,
            )
            for req, at in spec
        }
        self._keep_mtp_hidden(kept, verified, batch)
        if not sampled_reqs:
            return verified
        return self._sample(logits, num_sampled, sampled_reqs) | verified

    @property
    def bursts(self) -> bool:
        """Whether `run_burst` serves: a decode step is one forward pass of this process alone (not with an
        MTP layer's rows, nor on a tensor- or expert-parallel group, whose ranks step together)."""
        model = self.model
        parallel = model.parallel
        return self.broadcast_step is None and model.mtp is None and parallel.tp.size == parallel.ep.size == 1

    def run_burst(self, reqs: Sequence[Request], steps: int) -> list[list[int]] | None:
        """`steps` greedy decode steps of `reqs` without the scheduler or the sampler in between (multi-step
        decode): each request decodes its last token, then each token the step before gave it (its
        logits row's argmax, the greedy sampler's rule); its blocks must hold every position. The one-call
        C++ step runs them all in one call (`decode_burst`); any other model, one forward pass a step. Each
        step's tokens, in `reqs`' order; None where it does not serve (`bursts`)."""
        model = self.model
        if not self.bursts:
            return None
        input_ids, positions, tables, lens = [], [], [], []
        for req in reqs:
            start = req.num_computed_tokens
            input_ids += req.token_ids(start, 1)
            positions.append(start)
            tables.append(req.block_ids)
            lens.append(start + 1)
        burst = model.decode_burst(input_ids, positions, tables, lens, self.kv_cache, steps)
        if burst is not None:
            return burst
        burst, bs, rows = [], self.block_size, list(range(len(reqs)))
        for _ in range(steps):
            step = StepInputs(
                input_ids=input_ids,
                positions=positions,
                slot_blocks=[table[p // bs] for table, p in zip(tables, positions, strict=True)],
                slot_offsets=[p % bs for p in positions],
                decode_tables=tables,
                decode_lens=lens,
                sample_rows=rows,
            )
            logits = self.execute(step)
            known, model.step_argmax = model.step_argmax, None
            input_ids = known[1] if known is not None and known[0] is logits else argmax_rows(logits)
            burst.append(input_ids)
            positions, lens = [p + 1 for p in positions], [n + 1 for n in lens]
        return burst

    def _recompute_for_mtp(self, req: Request, start: int) -> bool:
        """Whether `req`'s step starts one token early for the MTP layer: its first token's MTP row needs
        the hidden state of the token before, which this process does not hold (a prefix-cache hit, KV
        from another worker, a tensor-parallel leader whose followers could not be sent it)."""
        if start == 0:
            return False
        known = req.mtp_hidden is not None and req.mtp_hidden[0] == start - 1
        return not known or self.broadcast_step is not None

    @staticmethod
    def _mtp_first_prev(step: StepInputs, req: Request, start: int, row: int, extra: bool) -> int:
        """The `StepInputs.mtp_prev` entry of a request's first row of the step."""
        if extra:
            return row - 1
        if start == 0:
            return -1
        step.mtp_saved.append(req.mtp_hidden[1])
        return -1 - len(step.mtp_saved)

    def _keep_mtp_hidden(self, kept, verified: dict, batch: ScheduledBatch) -> None:
        """Each request's hidden state at its last accepted position (`Request.mtp_hidden`)."""
        if not kept or self.hidden is None:
            return
        counts = dict(batch.work)
        for req, row, start in kept:
            accepted = len(verified[req]) if req in verified else counts[req]
            req.mtp_hidden = (start + accepted - 1, self.hidden[row + accepted - 1].clone())

    def _mtp_inputs(self, step: StepInputs, meta: AttentionMetadata) -> MtpInputs:
        tokens, dev = len(step.input_ids), self.device
        hidden = self.model.cfg.hidden_size
        saved = torch.stack([*step.mtp_saved, torch.zeros(hidden, device=dev)]).to(dev)
        none = tokens + len(step.mtp_saved)  # the zeros row
        prev = [r if r >= 0 else none if r == -1 else tokens - 2 - r for r in step.mtp_prev]
        blocks = [
            self.sink_block if r == -1 else b for r, b in zip(step.mtp_prev, step.slot_blocks, strict=True)
        ]
        return MtpInputs(
            torch.tensor(prev, dtype=torch.long, device=dev),
            saved,
            torch.tensor(blocks, dtype=torch.long, device=dev),
        )

    def _sample(self, logits: torch.Tensor, num_sampled: int, sampled_reqs: list[Request]):
        if num_sampled < logits.shape[0]:  # (not a view when every row is sampled: each op costs tens of us)
            logits = logits[:num_sampled]
        known, self.model.step_argmax = self.model.step_argmax, None
        if all(map(self.argmax_only, sampled_reqs)):  # (no SampleRow: cold, each Python line costs us)
            best = known[1] if known is not None and known[0] is logits else argmax_rows(logits)
            return dict(zip(sampled_reqs, map(Sampled, best), strict=True))
        rows = [self._sample_row(r) for r in sampled_reqs]
        constrained = [i for i, r in enumerate(sampled_reqs) if r.matcher is not None]
        if constrained:  # structured outputs: the tokens each grammar allows next
            vocab = logits.shape[-1]
            bitmask = fill_mask([sampled_reqs[i].matcher for i in constrained], vocab)
            allowed = masks(bitmask, vocab, self.eos_ids).to(logits.device)
            for row, i in enumerate(constrained):
                rows[i].mask = allowed[row]
        siblings = [i for i, r in enumerate(sampled_reqs) if r.params.n > 1 and not r.output_token_ids]
        if siblings:  # n sequences: n - 1 more first tokens from the same logits rows (after the others)
            index = list(range(num_sampled))
            for i in siblings:
                extra = sampled_reqs[i].params.n - 1
                index += [i] * extra
                rows += [rows[i]] * extra
            drawn = sample(logits[index], rows)
            at = num_sampled
            for i in siblings:
                extra = sampled_reqs[i].params.n - 1
                sampled_reqs[i].sibling_samples = drawn[at : at + extra]
                at += extra
            return dict(zip(sampled_reqs, drawn[:num_sampled], strict=False))
        return dict(zip(sampled_reqs, sample(logits, rows), strict=True))

    @staticmethod
    def argmax_only(req: Request) -> bool:
        """Whether `req`'s token this step is its logits row's argmax, as `sample` would find it: a plain
        greedy request (`SamplingSpec.plain_greedy`) with no grammar, no tokens banned until `min_tokens`
        (`_sample_row`'s rule) and no sibling sequences still to start."""
        params = req.params
        return (
            params.spec.plain_greedy
            and req.matcher is None
            and (params.n == 1 or bool(req.output_token_ids))
            and (not req.banned_until_min or len(req.output_token_ids) >= params.min_tokens)
        )

    @staticmethod
    def _sample_row(req: Request, drafts: Sequence[int] = ()) -> SampleRow:
        """`drafts`: the sampled position follows these draft tokens (they count as outputs)."""
        params = req.params
        penalized = params.spec.penalized  # the prompt and outputs matter to the penalties only
        return SampleRow(
            params.spec,
            req.generator,
            prompt=req.prompt_token_ids[: req.num_prompt_tokens - req.output_offset] if penalized else (),
            outputs=[*req.generated, *drafts] if penalized else (),
            banned=req.banned_until_min
            if len(req.output_token_ids) + len(drafts) < params.min_tokens
            else (),
        )

    @classmethod
    def _draft_rows(cls, req: Request) -> list[SampleRow]:
        """The sample rows of a decode with drafts: after 0, 1, ..., k of its drafts."""
        return [cls._sample_row(req, req.spec_tokens[:j]) for j in range(len(req.spec_tokens) + 1)]

    @staticmethod
    def _score_prompts(logits: torch.Tensor, row: int, scored: list[tuple[Request, int, int]]) -> None:
        """Prompt logprobs of this step's prompt chunks (rows from `row` on, in `scored`'s order)."""
        rows, tokens, tops = [], [], []
        for req, start, count in scored:
            rows += range(row, row + count)
            tokens += req.prompt_token_ids[start + 1 : start + 1 + count]
            tops += [req.params.prompt_logprobs] * count
            row += count
        found = token_logprobs(logits, rows, tokens, tops)
        for req, start, count in scored:
            del req.prompt_logprobs[start:]  # a chunk computed again (after a preemption) replaces its own
            req.prompt_logprobs += found[:count]
            found = found[count:]

    def execute(self, step: StepInputs) -> torch.Tensor | None:
        """The forward pass (and the logits of `sample_rows`); every rank of a group runs it in step.

        An empty step is a forward over zero tokens: an expert-parallel rank with no sequences still
        takes part in every layer's all_to_all.
        """
        hidden = None
        if not step.prefills and not step.mtp_prev and 0 < len(step.decode_tables) == len(step.input_ids):
            hidden = self.model.decode_lists(
                step.input_ids, step.positions, step.slot_blocks, step.slot_offsets, step.decode_tables,
                step.decode_lens, self.kv_cache,
            )  # fmt: skip
        if hidden is None:
            dev = self.device
            prefills = [
                PrefillChunk(a, b, c, torch.tensor(t, dtype=torch.long, device=dev))
                for a, b, c, t in step.prefills
            ]
            input_ids, positions, meta = AttentionMetadata.build_step(
                step.input_ids, step.positions, step.slot_blocks, step.slot_offsets, step.decode_tables,
                step.decode_lens, prefills, dev,
            )  # fmt: skip
            hidden = self.model(
                input_ids,
                positions,
                self.kv_cache,
                meta,
                self._mtp_inputs(step, meta) if self.model.mtp is not None and step.mtp_prev else None,
            )
        self.hidden = hidden if self.model.mtp is not None else None
        rows = step.sample_rows
        if not rows:
            return None
        every = len(rows) == hidden.shape[0] and rows == list(range(len(rows)))  # all, in order (decodes)
        return self.model.compute_logits(hidden, None if every else rows)
