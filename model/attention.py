"""Attention over a paged KV cache for ragged batches.

One forward pass carries any mix of single-token decodes and chunked-prefill pieces. Tokens are laid
out decodes first (one token each), then prefill chunks back to back. Every token's K/V is written to
its slot (block id, offset in block) before attention reads the cache.

Cache layout (per layer): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    q_start: int  # first row of this chunk in the flat token batch
    q_len: int  # tokens computed now
    context_len: int  # tokens in the cache after this chunk (cached prefix + q_len)
    block_table: torch.Tensor  # [num_blocks_of_seq] long


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block id of every token
    slot_offsets: torch.Tensor  # [T] offset within the block
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks]
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, max_blocks * block_size] True = attend
    prefills: list[PrefillChunk] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        slot_blocks: list[int],
        slot_offsets: list[int],
        decode_tables: list[list[int]],
        decode_context_lens: list[int],
        prefills: list[PrefillChunk],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        meta = cls(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=device),
            num_decodes=len(decode_tables),
            prefills=prefills,
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=device)
            lens = torch.tensor(decode_context_lens, dtype=torch.long, device=device)
            span = torch.arange(width * block_size, device=device)
            meta.decode_mask = (span[None, :] < lens[:, None])[:, None, None, :]
        return meta


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """k, v: [T, Hkv, D] written into their slots."""
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (this step's, already in the cache). Returns [T, Hq, D]."""
    out = torch.empty_like(q)
    if meta.num_decodes:
        nd = meta.num_decodes
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    bd, hq, d = q.shape
    hkv = k_cache.shape[2]
    tables = meta.decode_block_tables
    # [Bd, nb, bs, Hkv, D] -> [Bd, Hkv, S, D]
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2)
    values = v_cache[tables].flatten(1, 2).transpose(1, 2)
    # the G query heads sharing a KV head act as G query positions: [Bd, Hkv, G, D]
    grouped = q.view(bd, hkv, hq // hkv, d)
    attn = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=meta.decode_mask, scale=scale)
    return attn.reshape(bd, hq, d)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Tq, D]
    if chunk.context_len == chunk.q_len:  # nothing cached before this chunk: plain causal attention
        keys, values, mask, causal = k, v, None, True
    else:
        keys = k_cache[chunk.block_table].flatten(0, 1)[: chunk.context_len]  # [S, Hkv, D]
        values = v_cache[chunk.block_table].flatten(0, 1)[: chunk.context_len]
        first = chunk.context_len - chunk.q_len
        q_pos = torch.arange(first, chunk.context_len, device=q.device)
        mask = torch.arange(chunk.context_len, device=q.device)[None, :] <= q_pos[:, None]
        causal = False
    attn = F.scaled_dot_product_attention(
        qt,
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return attn.squeeze(0).transpose(0, 1)
