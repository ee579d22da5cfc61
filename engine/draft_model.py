"""The draft-model proposer of speculative decoding (`{"method": "draft_model", "model": ...}`).

A smaller model on the target's tokenizer (the built-in `draft`, trained here like `trained`, or any
Qwen3-MoE checkpoint with the same vocabulary) proposes K tokens greedily for every request in steady
decode, all requests batched: one forward pass catches each request's draft KV up with the tokens the
target accepted since its last proposal (the whole prompt the first time) and gives the first draft,
then K - 1 single-token passes give the rest. The draft keeps its own paged KV cache (its own
`ModelRunner`, as many blocks as the target's cache within a quarter of its memory budget, a block list
per request); the KV written for a draft lies past the accepted tokens and is overwritten by the next
catch-up, as in the target. A request that leaves the running set gives its blocks back (on a resume the
catch-up starts from its prompt).

Greedy drafts are a deterministic proposal, so `model.sampler.speculative_sample`'s rule (accept draft d
with probability p(d), else draw from p without d) keeps sampled outputs distributed as the target's, and
greedy outputs are exactly the non-speculative ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvferry.engine.model_runner import ModelRunner, StepInputs, kv_block_bytes
from kvferry.engine.spec_decode import SpeculativeConfig, SpeculativeConfigError
from kvferry.kernels.select import choose
from kvferry.model.config import ModelConfig, resolve_dtype
from kvferry.model.create import resolve_model
from kvferry.model.loader import load_model
from kvferry.settings import load_settings

log = logging.getLogger(__name__)
DECODE_ROWS_MAX = 16  # a catch-up of at most this many tokens runs as decode rows


@dataclass
class _DraftState:
    block_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens of the request whose draft KV is in the cache


class DraftModelProposer:
    def __init__(
        self,
        cfg: SpeculativeConfig,
        target: ModelConfig,
        device: torch.device,
        dtype: str,
        kernels: str,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        memory_bytes: int,
    ):
        """`num_blocks`: the target cache's; the draft's has as many, within `memory_bytes` (fewer blocks
        than its requests need only means some get no drafts)."""
        self.k = cfg.num_speculative_tokens
        self.block_size = block_size
        model_dir = resolve_model(cfg.model, load_settings().models_dir)
        draft_cfg = ModelConfig.from_dir(model_dir)
        if draft_cfg.vocab_size != target.vocab_size:
            raise SpeculativeConfigError(
                f"speculative_config.model {cfg.model!r}: its vocabulary ({draft_cfg.vocab_size} tokens) is "
                f"not the target's ({target.vocab_size}); a draft model must share the tokenizer"
            )
        draft_dtype = resolve_dtype(dtype, draft_cfg, device)
        self.model = load_model(model_dir, draft_dtype, device, max_positions=max_model_len)
        backend = choose(device, draft_dtype, kernels)
        if backend == "cpu" and not self.model.pack_weights():
            backend = "torch"
        elif backend == "triton":
            self.model.use_triton()
        block_bytes = kv_block_bytes(self.model, block_size, self.model.embed.dtype)
        num_blocks = max(1, min(num_blocks, memory_bytes // block_bytes))
        self.runner = ModelRunner(self.model, num_blocks, block_size, device)
        self.free = list(range(num_blocks - 1, -1, -1))
        self.states: dict[str, _DraftState] = {}
        log.info(
            "draft model %s (%s, %s kernels), %d tokens a proposal", model_dir, draft_dtype, backend, self.k
        )

    def propose_batch(self, items: list[tuple[str, list[int], int]], running: set[str]) -> list[list[int]]:
        """Drafts for each (request id, its tokens, at most how many): up to min(K, limit) greedy tokens
        of the draft model. `running`: the ids still running (the others' blocks are given back)."""
        for rid in [r for r in self.states if r not in running]:
            self.free += self.states.pop(rid).block_ids
        bs = self.block_size
        work = []  # (index in items, state, tokens, k)
        for i, (rid, tokens, limit) in enumerate(items):
            k = min(self.k, limit)
            state = self.states.setdefault(rid, _DraftState())
            state.num_cached = min(state.num_cached, len(tokens) - 1)
            need = -(-(len(tokens) + k - 1) // bs)  # blocks for the tokens and the drafts but the last
            while k > 0 and len(state.block_ids) < need and self.free:
                state.block_ids.append(self.free.pop())
            if k > 0 and len(state.block_ids) >= need:
                work.append((i, state, tokens, k))
        out: list[list[int]] = [[] for _ in items]
        if not work:
            return out
        # catch-up and the first draft. A few tokens (what the target accepted since the last proposal)
        # run as decode rows, each attending as a decode of its own position, so that the pass stays in
        # the one-call decode path; a prompt runs as a prefill chunk, after them
        work.sort(key=lambda w: len(w[2]) - w[1].num_cached > DECODE_ROWS_MAX)
        step = StepInputs()
        for _, state, tokens, _ in work:
            start, n, row = state.num_cached, len(tokens) - state.num_cached, len(step.input_ids)
            self._add(step, state, tokens[start:], start)
            if n <= DECODE_ROWS_MAX:
                step.decode_tables += [state.block_ids] * n
                step.decode_lens += range(start + 1, start + n + 1)
            else:
                step.prefills.append((row, n, start + n, state.block_ids))
            step.sample_rows.append(row + n - 1)
        drafts = self.runner.execute(step).argmax(dim=-1).tolist()
        for (i, state, tokens, _), d in zip(work, drafts, strict=True):
            out[i].append(d)
            state.num_cached = len(tokens)
        # the rest: one token per pass, for the requests that take that many
        for j in range(1, max(w[3] for w in work)):
            live = [w for w in work if w[3] > j]
            step = StepInputs()
            for i, state, tokens, _ in live:
                pos = len(tokens) + j - 1
                step.sample_rows.append(len(step.input_ids))
                self._add(step, state, [out[i][-1]], pos)
                step.decode_tables.append(state.block_ids)
                step.decode_lens.append(pos + 1)
            drafts = self.runner.execute(step).argmax(dim=-1).tolist()
            for (i, *_), d in zip(live, drafts, strict=True):
                out[i].append(d)
        return out

    def _add(self, step: StepInputs, state: _DraftState, ids: list[int], start: int) -> None:
        bs = self.block_size
        step.input_ids += ids
        step.positions += range(start, start + len(ids))
        step.slot_blocks += [state.block_ids[p // bs] for p in range(start, start + len(ids))]
        step.slot_offsets += [p % bs for p in range(start, start + len(ids))]
