"""Triton paged attention for the GPU path: batched decode, and many prefill chunks in one launch.

Cache layout (one layer, K and V alike): [Hkv, num_blocks, block_size, D], any strides. A sequence's
blocks are named by a row of a block table (int64, rows padded with any valid block id); position p of
a sequence lives in block `table[p // block_size]` at offset `p % block_size`. GQA: query heads
h*G .. h*G+G-1 read KV head h (G = Hq // Hkv).

Both kernels visit the keys in tiles of TILE_N positions (a tile may span several cache blocks, so block
sizes below 16 still feed `tl.dot`, which needs 16 in every dimension), gathering each position's
block id from the table, and keep an online softmax (running max, running sum, rescaled accumulator) in
float32. The head dim is padded to a power of two >= 16 with masks, so any D works. float32 inputs use
IEEE `tl.dot` (no TF32) so results match the torch references to ~1e-5; 16-bit inputs feed the tensor
cores and round the probabilities to the input dtype before the P @ V product, as flash attention does.

- `paged_decode_attention`: one query token per sequence; one program per (sequence, KV head) computes
  that head's G query heads together, padded to 16 rows, so each K/V tile is read once per group.
- `latent_decode_attention`: MLA's absorbed decode (DeepSeek-V3, `model/mla.py`): one latent row per
  cached token, read from the cache's two half planes, shared by every head; one program per
  (sequence, 16 query heads).
- `paged_prefill_attention`: chunked prefill; one program per (chunk, tile of BLOCK_M query rows, query
  head). The chunk's K/V (cached prefix and its own new tokens) are read from the cache, causal by
  position. `paged_prefill_attention_reference` is the torch contract (the gathering branch of
  `model.attention._prefill_attention`, one chunk at a time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvferry.kernels.paged_attention import block_rows, gather_rows

_LOG2E = 1.4426950408889634


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: IEEE for float32 (TF32 would cost ~1e-3 relative); 16-bit inputs
    ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _softmax_tile(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One key tile of online (flash) softmax: scores s [M, N] (masked keys at -inf, log2 scaled) and
    their values v [N, D] folded into the running row max m_i, row sum l_i and output acc [M, D]."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _kv_tile(
    k_base, v_base, table_ptr, stride_tw, pos, valid, d, d_mask,
    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """K and V rows [N, D] of key positions `pos` (valid ones; the rest 0), each read through the block
    table row at `table_ptr`: one block id per position, so a tile may span several cache blocks."""
    block = tl.load(table_ptr + (pos // BLOCK_SIZE) * stride_tw, mask=valid, other=0)
    slot = pos % BLOCK_SIZE
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(
        k_base + block[:, None] * stride_kb + slot[:, None] * stride_ks + d[None, :] * stride_kd,
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_base + block[:, None] * stride_vb + slot[:, None] * stride_vs + d[None, :] * stride_vd,
        mask=kv_mask,
        other=0.0,
    )
    return k, v


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_qd,
    stride_kh, stride_kb, stride_ks, stride_kd,
    stride_vh, stride_vb, stride_vs, stride_vd,
    stride_tb, stride_tw,
    stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)  # int64 offsets: a cache may pass 2**31 elements
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, TILE_N)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    ctx = tl.load(lens_ptr + seq)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    for start in range(0, ctx, TILE_N):
        pos = start + n
        valid = pos < ctx
        k, v = _kv_tile(
            k_base, v_base, tables_ptr + seq * stride_tb, stride_tw, pos, valid, d, d_mask,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, BLOCK_SIZE,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = _softmax_tile(s, v, m_i, l_i, acc, PRECISION)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    hq, d = q.shape[1], q.shape[2]
    hkv, _, block_size, dk = k_cache.shape
    if v_cache.shape != k_cache.shape or dk != d or hq % hkv:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)}"
        )
    return hq // hkv, d, block_size


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D]; caches: [Hkv, num_blocks, bs, D]; block_tables: [B, W] int64; context_lens: [B]
    (each >= 1). Returns [B, Hq, D] in q's dtype (written into `out` when given: any strides), the same
    contract as `kernels.paged_attention.paged_decode_attention_reference`."""
    group, d, block_size = _check_cache(q, k_cache, v_cache)
    b = q.shape[0]
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    _decode_kernel[(b, k_cache.shape[0])](
        q, k_cache, v_cache, block_tables, context_lens.contiguous(), out,
        scale * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, HEAD_DIM=d, BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        TILE_N=max(32, triton.next_power_of_2(block_size)), PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out


@triton.jit
def _latent_decode_kernel(
    q_ptr, first_ptr, second_ptr, tables_ptr, lens_ptr, out_ptr,
    qk_scale, skip,
    stride_qb, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_cd,
    stride_tb, stride_tw,
    stride_ob, stride_oh, stride_od,
    HEADS: tl.constexpr, HALF: tl.constexpr, RANK: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """MLA's absorbed decode: one program per (sequence, BLOCK_H query heads); every head reads the same
    latent rows, the row's halves from the two planes. Scores q . [first | second]; the output is the
    probabilities applied to the row's first RANK values (all of `first`'s and part of `second`'s, or
    part of `first`'s)."""
    seq = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, TILE_N)
    h_mask = h < HEADS
    d_mask = d < HALF
    q_rows = q_ptr + seq * stride_qb + h[:, None] * stride_qh
    qm = h_mask[:, None] & d_mask[None, :]
    q0 = tl.load(q_rows + d[None, :] * stride_qd, mask=qm, other=0.0)
    q1 = tl.load(q_rows + (HALF + d[None, :]) * stride_qd, mask=qm, other=0.0)
    ctx = tl.load(lens_ptr + seq)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    acc1 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(0, ctx, TILE_N):
        pos = start + n
        valid = (pos < ctx) & (pos >= skip)
        c0, c1 = _kv_tile(
            first_ptr, second_ptr, tables_ptr + seq * stride_tb, stride_tw, pos, valid, d, d_mask,
            stride_cb, stride_cs, stride_cd, stride_cb, stride_cs, stride_cd, BLOCK_SIZE,
        )  # fmt: skip
        s = tl.dot(q0, tl.trans(c0), input_precision=PRECISION)
        s = tl.dot(q1, tl.trans(c1), s, input_precision=PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc0 = tl.dot(p.to(c0.dtype), c0, acc0 * alpha[:, None], input_precision=PRECISION)
        acc1 = tl.dot(p.to(c1.dtype), c1, acc1 * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    out_rows = out_ptr + seq * stride_ob + h[:, None] * stride_oh
    ty = out_ptr.dtype.element_ty
    tl.store(out_rows + d[None, :] * stride_od, (acc0 / l_i[:, None]).to(ty), mask=qm & (d[None, :] < RANK))
    tl.store(
        out_rows + (HALF + d[None, :]) * stride_od,
        (acc1 / l_i[:, None]).to(ty),
        mask=qm & (HALF + d[None, :] < RANK),
    )


def latent_decode_attention(
    q: torch.Tensor,
    first: torch.Tensor,
    second: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    rank: int,
    skip: int = 0,
) -> torch.Tensor:
    """MLA's absorbed decode: q [B, H, W] (W = rank + rope) over the latent rows in the half planes
    [1, num_blocks, bs, W/2]; context_lens [B] (each > skip); positions below `skip` not attended.
    Returns [B, H, rank], the contract of `model.mla.latent_decode_attention_reference`."""
    b, heads, width = q.shape
    _, _, block_size, half = first.shape
    if second.shape != first.shape or width != 2 * half or first.shape[0] != 1 or not 0 < rank <= width:
        raise ValueError(f"q {tuple(q.shape)} does not fit latent planes {tuple(first.shape)}")
    if first.stride() != second.stride():
        raise ValueError("the two latent planes must have the same strides")
    out = q.new_empty(b, heads, rank)
    if b == 0:
        return out
    block_h = 16
    _latent_decode_kernel[(b, triton.cdiv(heads, block_h))](
        q, first, second, block_tables, context_lens.contiguous(), out,
        scale * _LOG2E, skip,
        *q.stride(), *first.stride()[1:], *block_tables.stride(), *out.stride(),
        HEADS=heads, HALF=half, RANK=rank, BLOCK_SIZE=block_size,
        BLOCK_H=block_h, BLOCK_D=max(16, triton.next_power_of_2(half)),
        TILE_N=max(32, triton.next_power_of_2(block_size)), PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, starts_ptr, qlens_ptr, lens_ptr, out_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_kh, stride_kb, stride_ks, stride_kd,
    stride_vh, stride_vb, stride_vs, stride_vd,
    stride_tc, stride_tw,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    m_start = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    q_len = tl.load(qlens_ptr + chunk)
    if m_start >= q_len:
        return
    q_start = tl.load(starts_ptr + chunk)
    ctx = tl.load(lens_ptr + chunk)
    first = ctx - q_len  # position of the chunk's first query row
    kv_head = (head // GROUP).to(tl.int64)  # int64 offsets: a cache may pass 2**31 elements
    i = m_start + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, TILE_N)
    row_mask = i < q_len
    d_mask = d < HEAD_DIM
    q_pos = first + i
    rows = q_start + i
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    end = tl.minimum(ctx, first + m_start + BLOCK_M)  # keys past the tile's last row are all masked
    for start in range(0, end, TILE_N):
        pos = start + n
        valid = pos < end
        k, v = _kv_tile(
            k_base, v_base, tables_ptr + chunk * stride_tc, stride_tw, pos, valid, d, d_mask,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, BLOCK_SIZE,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        # every row sees key 0, so the running max is finite after the first tile
        causal = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(causal, s * qk_scale, float("-inf"))
        m_i, l_i, acc = _softmax_tile(s, v, m_i, l_i, acc, PRECISION)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill chunks c = 0 .. C-1 in one launch.

    q: [T, Hq, D], chunk c's query rows q_starts[c] .. q_starts[c] + q_lens[c] - 1; caches:
    [Hkv, num_blocks, bs, D] already holding every chunk's new tokens; block_tables: [C, W] int64 (padded);
    context_lens[c]: the sequence's tokens in the cache after the chunk (>= q_lens[c] >= 1). Row i of
    chunk c is at position context_lens[c] - q_lens[c] + i and attends to positions <= its own.
    Returns [T, Hq, D] in q's dtype (written into `out` when given); rows outside every chunk are left
    unwritten. `max_q_len` (an upper bound of q_lens) sizes the grid without reading q_lens back.
    """
    group, d, block_size = _check_cache(q, k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    num_chunks = q_lens.shape[0]
    if num_chunks == 0 or q.shape[0] == 0:
        return out
    if max_q_len is None:
        max_q_len = int(q_lens.max())
    block_m = 16 if max_q_len <= 16 else 32 if max_q_len <= 32 else 64
    # the kernel reads the per-chunk scalars as dense vectors (callers may pass views, e.g. unbind(1))
    q_starts, q_lens, context_lens = q_starts.contiguous(), q_lens.contiguous(), context_lens.contiguous()
    grid = (num_chunks, triton.cdiv(max_q_len, block_m), q.shape[1])
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, q_starts, q_lens, context_lens, out,
        scale * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, HEAD_DIM=d, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_D=max(16, triton.next_power_of_2(d)),
        TILE_N=max(32, triton.next_power_of_2(block_size)), PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The torch contract of `paged_prefill_attention`, one chunk at a time: gather the chunk's blocks,
    mask causally by position, SDPA with GQA. Rows outside every chunk are zero."""
    out = torch.zeros_like(q)
    hkv, d = k_cache.shape[0], k_cache.shape[-1]
    chunks = zip(q_starts.tolist(), q_lens.tolist(), context_lens.tolist(), strict=True)
    for c, (q_start, q_len, ctx) in enumerate(chunks):
        rows = slice(q_start, q_start + q_len)
        cache_rows = block_rows(k_cache, block_tables[c])
        keys = gather_rows(k_cache, cache_rows).view(hkv, -1, d)[:, :ctx]  # [Hkv, S, D]
        values = gather_rows(v_cache, cache_rows).view(hkv, -1, d)[:, :ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        attn = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = attn.squeeze(0).transpose(0, 1)
    return out
