"""Paged decode attention: one query token per sequence over KV blocks named by a block table.

Cache layout (per layer, K and V alike): [Hkv, num_blocks, block_size, D] (an int8 cache: D + 4, each
row's int8 values and its float32 scale, `int8.quantize_kv`). `block_tables` [B, W] holds
each sequence's block ids (rows padded with any valid id), `context_lens` [B] how many of its tokens to
attend over; slots past a sequence's length are masked. Query heads h*G .. h*G+G-1 read KV head h.

Implementations of this contract: the C++ CPU kernel `torch.ops.kvferry_cpu.paged_decode_attention`
(`cpu/kvferry_cpu.cpp`: reads K/V rows straight from the cache by block id, no copy) and the torch
reference below (gathers the blocks, then two batched matmuls; any device and dtype).
"""

from __future__ import annotations

import torch

from kvferry.kernels.int8 import dequantize_kv


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
    hkv, _, bs, _ = k_cache.shape
    group, width = hq // hkv, block_tables.shape[1] * bs
    rows = block_rows(k_cache, block_tables.flatten())  # head-major: [Hkv * B * W]
    keys = gather_kv(k_cache, rows, q.dtype).view(hkv * b, width, d)
    values = gather_kv(v_cache, rows, q.dtype).view(hkv * b, width, d)
    qg = (q * scale).view(b, hkv, group, d).transpose(0, 1).reshape(hkv * b, group, d)
    scores = torch.bmm(qg, keys.transpose(1, 2)).view(hkv, b, group, width)
    valid = torch.arange(width, device=q.device)[None, :] < context_lens[:, None]  # [B, S]
    scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    probs = scores.softmax(-1).view(hkv * b, group, width)
    out = torch.bmm(probs, values)  # [Hkv*B, G, D]
    return out.view(hkv, b, group, d).transpose(0, 1).reshape(b, hq, d)


def gather_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Copy (head, block) rows of a [Hkv, num_blocks, bs, D] cache: -> [len(rows) * bs, D].

    index_select over dim 0 of the flattened cache is one memcpy per row, 4x faster than over dim 1.
    """
    hkv, num_blocks, bs, d = cache.shape
    return cache.view(hkv * num_blocks, bs * d).index_select(0, rows).view(-1, d)


def gather_kv(cache: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`gather_rows`, then an int8 cache's rows dequantized (`int8.dequantize_kv`) to `dtype`."""
    out = gather_rows(cache, rows)
    return dequantize_kv(out, dtype) if cache.dtype == torch.int8 else out


def block_rows(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Row ids of `blocks` for every head, head-major: [Hkv * len(blocks)]."""
    hkv, num_blocks = cache.shape[:2]
    return (torch.arange(hkv, device=blocks.device)[:, None] * num_blocks + blocks[None, :]).flatten()
