"""Attention over a paged KV cache for ragged batches.

One forward pass carries any mix of single-token decodes and chunked-prefill pieces. Tokens are laid
out decodes first (one token each), then prefill chunks back to back. Every token's K/V is written to
its slot (block id, offset in block) before attention reads the cache.

Cache layout (per layer, for K and for V alike): [num_kv_heads, num_blocks, block_size, head_dim].
Head-major means gathering a batch's blocks yields [Hkv, B, S, D], which batched matmuls read as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvferry.model.decode_mirror import DecodeMirror


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
    decode_rows: torch.Tensor | None = None  # [Hkv * Bd * max_blocks] cache rows (head, block) to gather
    decode_bias: torch.Tensor | None = None  # [1, Bd, 1, max_blocks * block_size] 0 or -inf
    prefills: list[PrefillChunk] = field(default_factory=list)
    mirror: DecodeMirror | None = None  # set by the runner when the decode batch uses a mirror

    @classmethod
    def build(
        cls,
        slot_blocks: list[int],
        slot_offsets: list[int],
        decode_tables: list[list[int]],
        decode_context_lens: list[int],
        prefills: list[PrefillChunk],
        layer_cache: torch.Tensor,
    ) -> AttentionMetadata:
        """layer_cache: one layer's K cache, [Hkv, num_blocks, block_size, D] (gives layout and device)."""
        device = layer_cache.device
        meta = cls(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=device),
            num_decodes=len(decode_tables),
            prefills=prefills,
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            flat = [b for t in decode_tables for b in t + [0] * (width - len(t))]
            meta.decode_rows = block_rows(layer_cache, torch.tensor(flat, dtype=torch.long, device=device))
            block_size = layer_cache.shape[2]
            lens = torch.tensor(decode_context_lens, dtype=torch.long, device=device)
            span = torch.arange(width * block_size, device=device)
            bias = torch.zeros(len(decode_tables), width * block_size, dtype=layer_cache.dtype, device=device)
            meta.decode_bias = bias.masked_fill_(span[None, :] >= lens[:, None], float("-inf"))[None, :, None]
        return meta


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """k, v: [T, Hkv, D] written into their slots of the [Hkv, num_blocks, block_size, D] caches."""
    k_cache[:, meta.slot_blocks, meta.slot_offsets] = k.transpose(0, 1)
    v_cache[:, meta.slot_blocks, meta.slot_offsets] = v.transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    layer: int = 0,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (this step's, already in the cache). Returns [T, Hq, D]."""
    out = torch.empty_like(q)
    if meta.num_decodes:
        nd = meta.num_decodes
        out[:nd] = _decode_attention(q[:nd], k[:nd], v[:nd], k_cache, v_cache, meta, scale, layer)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def gather_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Copy (head, block) rows of a [Hkv, num_blocks, bs, D] cache: -> [len(rows) * bs, D].

    index_select over dim 0 of the flattened cache is one memcpy per row, 4x faster than over dim 1.
    """
    hkv, num_blocks, bs, d = cache.shape
    return cache.view(hkv * num_blocks, bs * d).index_select(0, rows).view(-1, d)


def block_rows(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Row ids of `blocks` for every head, head-major: [Hkv * len(blocks)]."""
    hkv, num_blocks = cache.shape[:2]
    return (torch.arange(hkv, device=blocks.device)[:, None] * num_blocks + blocks[None, :]).flatten()


def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    layer: int,
) -> torch.Tensor:
    """q: [Bd, Hq, D]. The G query heads sharing a KV head act as G query rows of one batched matmul."""
    bd, hq, d = q.shape
    hkv = k_cache.shape[0]
    group = hq // hkv

    def gather() -> tuple[torch.Tensor, torch.Tensor]:  # [Hkv*Bd, S, D] each
        keys = gather_rows(k_cache, meta.decode_rows).view(hkv * bd, -1, d)
        return keys, gather_rows(v_cache, meta.decode_rows).view(hkv * bd, -1, d)

    if meta.mirror is not None:
        keys_t, values = meta.mirror.layer_kv(layer, k, v, gather)
    else:
        keys, values = gather()
        keys_t = keys.transpose(1, 2)
    width = keys_t.shape[-1]
    # [Hkv*Bd, G, D], scaled here (small) rather than the scores; not in place: reshape may be a view of q
    grouped = q.view(bd, hkv, group, d).transpose(0, 1).reshape(hkv * bd, group, d) * scale
    scores = torch.bmm(grouped, keys_t).view(hkv, bd, group, width)
    probs = scores.add_(meta.decode_bias[..., :width]).softmax(-1).view(hkv * bd, group, width)
    out = torch.bmm(probs, values)  # [Hkv*Bd, G, D]
    return out.view(hkv, bd, group, d).transpose(0, 1).reshape(bd, hq, d)


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
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
        mask, causal = None, True
    else:
        rows = block_rows(k_cache, chunk.block_table)
        hkv, d = k_cache.shape[0], k_cache.shape[-1]
        keys = gather_rows(k_cache, rows).view(hkv, -1, d)[:, : chunk.context_len]  # [Hkv, S, D]
        values = gather_rows(v_cache, rows).view(hkv, -1, d)[:, : chunk.context_len]
        first = chunk.context_len - chunk.q_len
        q_pos = torch.arange(first, chunk.context_len, device=q.device)
        mask = torch.arange(chunk.context_len, device=q.device)[None, :] <= q_pos[:, None]
        causal = False
    attn = F.scaled_dot_product_attention(
        qt,
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return attn.squeeze(0).transpose(0, 1)
