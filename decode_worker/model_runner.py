"""Turns a scheduled batch into one ragged forward pass over the paged KV cache, then samples."""

from __future__ import annotations

import torch

from kvferry.decode_worker.request import Request
from kvferry.decode_worker.scheduler import ScheduledBatch
from kvferry.model.attention import AttentionMetadata, PrefillChunk
from kvferry.model.decode_mirror import DecodeMirror
from kvferry.model.qwen3_moe import Qwen3MoeModel
from kvferry.model.sampler import sample


def kv_block_bytes(model: Qwen3MoeModel, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.cfg
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, model: Qwen3MoeModel, num_blocks: int, block_size: int, device: torch.device):
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = device
        dtype = model.embed.dtype
        # [L, 2 (K/V), Hkv, num_blocks, block_size, D]: head-major for batched attention reads
        shape = (cfg.num_layers, 2, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.mirror = DecodeMirror(cfg.num_layers) if device.type == "cpu" else None

    def run(self, batch: ScheduledBatch) -> dict[Request, int]:
        """Compute every scheduled token; sample for the requests whose last token was computed."""
        work = sorted(batch.work, key=lambda item: item[1] != 1)  # single-token rows first
        ids, positions, slot_blocks, slot_offsets = [], [], [], []
        decode_reqs, decode_tables, decode_lens, prefills, sample_rows, sampled_reqs = [], [], [], [], [], []
        bs = self.block_size
        for req, n in work:
            start = req.num_computed_tokens
            row = len(ids)
            ids += req.token_ids(start, n)
            positions += range(start, start + n)
            slot_blocks += [req.block_ids[p // bs] for p in range(start, start + n)]
            slot_offsets += [p % bs for p in range(start, start + n)]
            if n == 1:
                decode_reqs.append(req)
                decode_tables.append(req.block_ids)
                decode_lens.append(start + 1)
            else:
                table = torch.tensor(req.block_ids, dtype=torch.long, device=self.device)
                prefills.append(PrefillChunk(row, n, start + n, table))
            if start + n == req.num_tokens:
                sample_rows.append(row + n - 1)
                sampled_reqs.append(req)
        meta = AttentionMetadata.build(
            slot_blocks, slot_offsets, decode_tables, decode_lens, prefills, self.kv_cache[0, 0]
        )
        if decode_reqs and self.mirror is not None:
            cfg = self.model.cfg
            if self.mirror.prepare(decode_reqs, decode_lens, cfg.num_kv_heads, cfg.head_dim, self.kv_cache):
                meta.mirror = self.mirror
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_cache,
            meta,
        )
        if not sampled_reqs:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])
        tokens = sample(logits, [r.params.spec for r in sampled_reqs], [r.generator for r in sampled_reqs])
        return dict(zip(sampled_reqs, tokens, strict=True))
