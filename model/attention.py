"""Attention over a paged KV cache for ragged batches.

One forward pass carries any mix of single-token decodes and chunked-prefill pieces. Tokens are laid
out decodes first (one token each), then prefill chunks back to back. Every token's K/V is written to
its slot (block id, offset in block) before attention reads the cache.

Cache layout (per layer, for K and for V alike): [num_kv_heads, num_blocks, block_size, head_dim].
Decodes read their blocks through a block table (`kernels/`: the Triton kernel on CUDA, a C++ CPU
kernel, or the torch reference that gathers them). Prefill chunks read theirs in place with the Triton
prefill kernel (every chunk of the step in one launch) or the C++ one (AVX2 or AVX-512; one call per
chunk, a cached prefix included, causal by position); the torch path runs SDPA over the chunk's own
K/V, or over the gathered cached prefix with a causal mask. Which one: `kernels.select`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvferry.kernels.cpu import ops as cpu_ops
from kvferry.kernels.int8 import quantize_kv
from kvferry.kernels.paged_attention import block_rows, gather_kv, paged_decode_attention_reference


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
    block_tables: torch.Tensor | None = None  # [Bd, W] the decodes' block ids, rows padded with block 0
    context_lens: torch.Tensor | None = None  # [Bd] tokens each decode attends over
    prefills: list[PrefillChunk] = field(default_factory=list)
    skip_keys: int = 0  # decodes attend from this position on (the MTP layer's slot 0 holds no entry)

    @classmethod
    def build(
        cls,
        slot_blocks: list[int],
        slot_offsets: list[int],
        decode_tables: list[list[int]],
        decode_context_lens: list[int],
        prefills: list[PrefillChunk],
        device: torch.device,
    ) -> AttentionMetadata:
        lists = (slot_blocks, slot_offsets, decode_tables, decode_context_lens)
        return cls.build_step([], [], *lists, prefills, device)[2]

    @classmethod
    def build_step(
        cls,
        input_ids: list[int],
        positions: list[int],
        slot_blocks: list[int],
        slot_offsets: list[int],
        decode_tables: list[list[int]],
        decode_context_lens: list[int],
        prefills: list[PrefillChunk],
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A step's token ids and positions [T] and its metadata, every integer in one tensor (these are
        views of it): at batch 1 each torch op around the decode call costs more than its work."""
        tokens, decodes = len(slot_blocks), len(decode_context_lens)
        rows, width = padded_tables(decode_tables)
        ints = [*input_ids, *positions, *slot_blocks, *slot_offsets, *decode_context_lens, *rows]
        flat = torch.tensor(ints, dtype=torch.long, device=device)
        sizes = [len(input_ids), len(positions), tokens, tokens, decodes, len(decode_tables) * width]
        ids, pos, blocks, offsets, lens, tables = flat.split(sizes)
        meta = cls(blocks, offsets, num_decodes=len(decode_tables), prefills=prefills)
        if decode_tables:
            meta.block_tables = tables.view(len(decode_tables), width)
            meta.context_lens = lens
        return ids, pos, meta


def padded_tables(tables: list[list[int]]) -> tuple[list[int], int]:
    """Block tables as one flat list of rows [len(tables), width], each padded with block 0 to the longest
    (width)."""
    width = max(map(len, tables), default=0)
    return [block for table in tables for block in (*table, *[0] * (width - len(table)))], width


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """k, v: [T, Hkv, D] written into their slots of the [Hkv, num_blocks, block_size, D] caches (int8
    caches: rows of D + 4, quantized per row, `kernels.int8.quantize_kv`)."""
    if k_cache.dtype == torch.int8:
        k, v = quantize_kv(k), quantize_kv(v)
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
    backend: str = "torch",
    bf16: bool = False,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (this step's, already in the cache). Returns [T, Hq, D].

    `backend` (`kernels.select.choose`): "triton" (CUDA, or the interpreter), "cpu" (the C++ kernels,
    float32) or "torch" (the references). `bf16` (a bf16 model on the C++ kernels): a prefill chunk's
    QK^T and PV products in bf16 where the kernels' AMX path serves (`kernels.cpu.amx`), else ignored.
    """
    if backend == "triton":
        return _triton_attention(q, k_cache, v_cache, meta, scale)
    kernels = backend == "cpu"
    out = torch.empty_like(q)
    if meta.num_decodes:
        nd = meta.num_decodes
        decode = cpu_ops().paged_decode_attention if kernels else paged_decode_attention_reference
        attn = decode(q[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        out[:nd] = attn.view_as(q[:nd])
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        if kernels:
            attn = cpu_ops().paged_prefill_attention(
                q[rows], k_cache, v_cache, chunk.block_table, chunk.context_len, scale, bf16
            )
            out[rows] = attn.view_as(q[rows])
        else:
            out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def _triton_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The step's decodes in one Triton launch, its prefill chunks (block tables padded) in another."""
    from kvferry.kernels import triton_attention

    out = torch.empty_like(q)  # each kernel writes its own rows in place
    if meta.num_decodes:
        nd = meta.num_decodes
        triton_attention.paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, scale, out=out[:nd]
        )
    if meta.prefills:
        width = max(chunk.block_table.numel() for chunk in meta.prefills)
        tables = torch.zeros(len(meta.prefills), width, dtype=torch.long, device=q.device)
        for row, chunk in zip(tables, meta.prefills, strict=True):
            row[: chunk.block_table.numel()] = chunk.block_table
        spans = [(c.q_start, c.q_len, c.context_len) for c in meta.prefills]
        starts, lens, contexts = torch.tensor(spans, dtype=torch.long, device=q.device).unbind(1)
        triton_attention.paged_prefill_attention(
            q, k_cache, v_cache, tables, starts, lens, contexts, scale, out=out
        )  # the chunks' rows only: the decodes' rows stay as written above
    return out


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
    # nothing cached before this chunk: plain causal attention (an int8 cache is always read back, so that
    # every chunking attends over the same dequantized K/V)
    if chunk.context_len == chunk.q_len and k_cache.dtype != torch.int8:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
        mask, causal = None, True
    else:
        rows = block_rows(k_cache, chunk.block_table)
        hkv, d = k_cache.shape[0], q.shape[-1]
        keys = gather_kv(k_cache, rows, q.dtype).view(hkv, -1, d)[:, : chunk.context_len]  # [Hkv, S, D]
        values = gather_kv(v_cache, rows, q.dtype).view(hkv, -1, d)[:, : chunk.context_len]
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
