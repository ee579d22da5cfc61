"""The MTP proposer of speculative decoding (`{"method": "mtp", "num_speculative_tokens": K}`): the
checkpoint's multi-token-prediction layer (DeepSeek-V3's `nextn`, `model.qwen3_moe.MtpLayer`) drafts K
tokens greedily for every request in steady decode, all requests batched, one MTP pass per draft.

Its cache is the target cache's last layer: the target writes a token's MTP row in the same forward as
its other layers (slot p holds the entry of token p and the target's hidden state at p - 1), so the rows
travel with the sequence's blocks through the pool, from prefill worker to decode worker, and a
prefix-cache hit brings them too. A proposal starts from the request's last accepted token (its position
p, not yet computed) and the target's hidden state at p - 1 (`Request.mtp_hidden`): pass 1 writes the
MTP row of slot p and its logits give draft 1; pass j writes slot p + j - 1 from draft j - 1 and the MTP
layer's own output. Those rows lie past the request's computed tokens, in blocks taken for them now
(the ones the scheduler would take for the drafts' K/V), and the target's next forward writes its own
rows there. A request whose hidden state this process does not hold yet (its first step after a
hand-off or a prefix hit: the target recomputes the token before it) gets no drafts this step.

Greedy drafts are a deterministic proposal, so `model.sampler.speculative_sample` keeps sampled
outputs distributed as the target's, and greedy outputs exactly the non-speculative ones.
"""

from __future__ import annotations

import torch

from kvferry.engine.block_manager import BlockManager
from kvferry.engine.model_runner import ModelRunner
from kvferry.engine.request import Request
from kvferry.engine.spec_decode import SpeculativeConfig
from kvferry.model.attention import AttentionMetadata


class MtpProposer:
    def __init__(self, cfg: SpeculativeConfig, runner: ModelRunner, blocks: BlockManager):
        self.k = cfg.num_speculative_tokens
        self.runner = runner
        self.blocks = blocks

    def propose(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        """Drafts for each (request, at most how many)."""
        out: list[list[int]] = [[] for _ in items]
        work = []  # (index in items, request, its k, the bonus token's position)
        for i, (req, limit) in enumerate(items):
            k, pos = min(self.k, limit), req.num_computed_tokens
            known = req.mtp_hidden is not None and req.mtp_hidden[0] == pos - 1
            # the blocks of the drafts' rows, taken now; never the last free ones: every running request
            # keeps one to grow into (drafts never cost a preemption)
            new = self.blocks.blocks_needed(pos + 1 + k) - len(req.block_ids)
            spare = new <= 0 or self.blocks.num_free_blocks - new >= len(items)
            if k > 0 and known and spare and self.blocks.allocate(req, 1 + k):
                work.append((i, req, k, pos))
        if not work:
            return out
        model, runner, bs = self.runner.model, self.runner, self.runner.block_size
        dev = runner.device
        tokens = torch.tensor([req.token_ids(pos, 1)[0] for _, req, _, pos in work], device=dev)
        prev = torch.stack([req.mtp_hidden[1] for _, req, _, _ in work])
        live = work
        for j in range(max(w[2] for w in work)):
            keep = [w[2] > j for w in live]
            if not all(keep):  # requests that asked for fewer drafts are done
                mask = torch.tensor(keep, device=dev)
                tokens, prev = tokens[mask], prev[mask]
                live = [w for w, kept in zip(live, keep, strict=True) if kept]
            slots = [pos + j for _, _, _, pos in live]
            meta = AttentionMetadata.build(
                [req.block_ids[s // bs] for s, (_, req, _, _) in zip(slots, live, strict=True)],
                [s % bs for s in slots],
                [req.block_ids for _, req, _, _ in live],
                [s + 1 for s in slots],
                [],
                dev,
            )
            meta.skip_keys = 1  # the MTP layer's slot 0 holds no entry
            logits, prev = model.draft(tokens, prev, runner.kv_cache, meta)
            tokens = logits.argmax(dim=-1)
            for (i, *_), d in zip(live, tokens.tolist(), strict=True):
                out[i].append(d)
        return out
