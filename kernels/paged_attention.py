"""Paged decode attention: one query token per sequence over KV blocks named by a block table.

Cache layout (per layer, K and V alike): [Hkv, num_blocks, block_size, D]. `block_tables` [B, W] holds
each sequence's block ids (rows padded with any valid id), `context_lens` [B] how many of its tokens to
attend over; slots past a sequence's length are masked. Query heads h*G .. h*G+G-1 read KV head h.

Implementations of this contract: the C++ CPU kernel `torch.ops.kvferry_cpu.paged_decode_attention`
(`cpu/kvferry_cpu.cpp`: reads K/V rows straight from the cache by block id, no copy) and the torch
reference below (gathers the blocks, then two batched matmuls; any device and dtype).
"""

from __future__ import annotations

import torch


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hq, D]; caches: [Hkv, num_blocks, bs, D]; block_tables: [B, W]; context_lens: [B].

    Returns [B, Hq, D].
    """
    b, hq, d = q.shape
    hkv, num_blocks, bs, _ = k_cache.shape
    group, width = hq // hkv, block_tables.shape[1] * bs
    # (head, block) rows of the flattened cache: index_select over dim 0 copies whole rows
    rows = (torch.arange(hkv, device=q.device)[:, None, None] * num_blocks + block_tables[None]).flatten()
    keys = k_cache.reshape(hkv * num_blocks, bs * d).index_select(0, rows).view(hkv * b, width, d)
    values = v_cache.reshape(hkv * num_blocks, bs * d).index_select(0, rows).view(hkv * b, width, d)
    qg = (q * scale).view(b, hkv, group, d).transpose(0, 1).reshape(hkv * b, group, d)
    scores = torch.bmm(qg, keys.transpose(1, 2)).view(hkv, b, group, width)
    valid = torch.arange(width, device=q.device)[None, :] < context_lens[:, None]  # [B, S]
    scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    probs = scores.softmax(-1).view(hkv * b, group, width)
    out = torch.bmm(probs, values)  # [Hkv*B, G, D]
    return out.view(hkv, b, group, d).transpose(0, 1).reshape(b, hq, d)
