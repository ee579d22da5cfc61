"""Triton pack/unpack of KV blocks between a paged cache and the pool's canonical block layout.

Paged cache (all layers): [L, 2 (K/V), H, num_blocks, block_size, D], any strides. Canonical transfer
layout (`kvpool.transfer`): [n, L, 2, heads, block_size, D] for n blocks of the KV-head slice
head_begin .. head_end. `block_ids` name the blocks in any order (a list or a 1-D int64 tensor; no runs
needed). One program copies one (block, layer, K/V, head) tile of block_size * D elements, in pieces of
at most BLOCK elements.

Bit-exact: elements travel as same-width integers (a dtype view), never converted, so every float
format (bfloat16 included, NaN payloads too) round-trips unchanged. Torch contract:
`kvpool.transfer.pack_blocks` / `unpack_blocks`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_blocks_kernel(
    cache_ptr, data_ptr, ids_ptr,
    heads, head_begin, tile,
    stride_cl, stride_ckv, stride_ch, stride_cb, stride_cs, stride_cd,
    stride_dn, stride_dl, stride_dkv, stride_dh, stride_ds, stride_dd,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PACK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)  # position in block_ids
    lkh = tl.program_id(1).to(tl.int64)  # (layer, K/V, head) of the slice; int64: caches pass 2**31
    piece = tl.program_id(2)
    layer = lkh // (2 * heads)
    kv = (lkh // heads) % 2
    head = lkh % heads
    block = tl.load(ids_ptr + i)
    e = piece * BLOCK + tl.arange(0, BLOCK)
    mask = e < tile
    s = e // HEAD_DIM
    d = e % HEAD_DIM
    cache_ptrs = (
        cache_ptr
        + layer * stride_cl
        + kv * stride_ckv
        + (head_begin + head) * stride_ch
        + block * stride_cb
        + s * stride_cs
        + d * stride_cd
    )
    data_ptrs = (
        data_ptr
        + i.to(tl.int64) * stride_dn
        + layer * stride_dl
        + kv * stride_dkv
        + head * stride_dh
        + s * stride_ds
        + d * stride_dd
    )
    if PACK:
        tl.store(data_ptrs, tl.load(cache_ptrs, mask=mask), mask=mask)
    else:
        tl.store(cache_ptrs, tl.load(data_ptrs, mask=mask), mask=mask)


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def _launch(cache: torch.Tensor, ids: torch.Tensor, data: torch.Tensor, head_begin: int, pack: bool) -> None:
    num_layers, _, _, _, block_size, head_dim = cache.shape
    n, heads = data.shape[0], data.shape[3]
    if n == 0 or heads == 0:
        return
    tile = block_size * head_dim
    block = min(1024, triton.next_power_of_2(tile))
    cache_i, data_i = _as_ints(cache), _as_ints(data)
    _copy_blocks_kernel[(n, num_layers * 2 * heads, triton.cdiv(tile, block))](
        cache_i, data_i, ids,
        heads, head_begin, tile,
        *cache_i.stride(), *data_i.stride(),
        HEAD_DIM=head_dim, BLOCK=block, PACK=pack,
    )  # fmt: skip


def _block_ids(block_ids, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.int64, device=device).reshape(-1).contiguous()


def pack_blocks(
    cache: torch.Tensor,
    block_ids,
    head_begin: int = 0,
    head_end: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """cache [L, 2, H, num_blocks, bs, D] -> [n, L, 2, head_end - head_begin, bs, D] (into `out` if
    given, any strides, cache's dtype) holding the blocks `block_ids` in that order."""
    head_end = cache.shape[2] if head_end is None else head_end
    if not 0 <= head_begin <= head_end <= cache.shape[2]:
        raise ValueError(f"KV-head slice [{head_begin}, {head_end}) outside [0, {cache.shape[2]})")
    ids = _block_ids(block_ids, cache.device)
    shape = (ids.numel(), cache.shape[0], 2, head_end - head_begin, *cache.shape[4:])
    if out is None:
        out = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    elif tuple(out.shape) != shape or out.dtype != cache.dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, expected {shape} {cache.dtype}")
    _launch(cache, ids, out, head_begin, pack=True)
    return out


def unpack_blocks(cache: torch.Tensor, block_ids, data: torch.Tensor, head_begin: int = 0) -> None:
    """Write data [n, L, 2, heads, bs, D] into the blocks `block_ids` of the paged cache
    [L, 2, H, num_blocks, bs, D], KV heads head_begin .. head_begin + heads - 1."""
    ids = _block_ids(block_ids, cache.device)
    heads = data.shape[3]
    expected = (ids.numel(), cache.shape[0], 2, heads, *cache.shape[4:])
    if tuple(data.shape) != expected or data.dtype != cache.dtype or head_begin + heads > cache.shape[2]:
        raise ValueError(f"data {tuple(data.shape)} {data.dtype} does not fit cache {tuple(cache.shape)}")
    _launch(cache, ids, data, head_begin, pack=False)
