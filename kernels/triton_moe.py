"""Triton mixture-of-experts for the GPU path: routing, sorted token/expert alignment, grouped GEMMs.

Layout (as `model.moe`): x [T, H]; router choices ids, weights [T, k] (global expert ids); expert weights
input-major, w13 [E_local, H, 2I] (gate | up halves) and w2 [E_local, I, H], holding global experts
first_expert .. first_expert + E_local - 1. Assignment a = t * k + j is token t's j-th choice.

- `route_topk`: softmax over the router logits [T, E] in float32, then top-k (+ renormalisation), one
  program per token. Torch contract: `model.moe.route` (which also does the logits matmul).
- `moe_align` (torch ops, no host sync): the assignments grouped by expert, each expert's group padded
  to a multiple of block_m with the sentinel T*k, and the expert of every block_m block.
- `fused_moe`: two grouped GEMMs over the aligned row blocks. Kernel 1 gathers x rows, multiplies by
  w13[expert] and applies SiLU(gate) * up in its epilogue into a [T*k, I] buffer indexed by assignment;
  kernel 2 multiplies that by w2[expert] and the routing weight into a [T*k, H] buffer, and the k partial
  outputs of a token are summed by a reshape (no atomics). Blocks of a non-local expert write zeros.
  Torch contract: `model.moe.experts_forward`.
- `ep_dispatch_layout`: the expert-parallel dispatch order (a token goes once to every rank owning one
  of its experts); a Triton kernel fills the [T, ranks] "needs" matrix, torch groups it. Torch contract:
  `ep_dispatch_layout_reference` (the layout `model.moe.dispatch_combine` builds, for any owner map).

float32 GEMMs use IEEE `tl.dot` (no TF32), so float32 results match torch to ~1e-5; 16-bit inputs feed
the tensor cores with float32 accumulation, and the SiLU * up product is rounded to the input dtype
before the second GEMM (as the torch path does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvferry.kernels.triton_attention import dot_precision


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_experts, stride_lt, stride_le,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    x = tl.load(logits_ptr + token * stride_lt + e * stride_le, mask=e < num_experts, other=float("-inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < num_experts, p, -1.0)  # probabilities are >= 0: -1 is never chosen
    chosen_w = tl.zeros([BLOCK_K], tl.float32)
    chosen_id = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(p, axis=0)
        chosen_w = tl.where(kk == j, tl.max(p, axis=0), chosen_w)
        chosen_id = tl.where(kk == j, best.to(tl.int64), chosen_id)
        p = tl.where(e == best, -1.0, p)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, axis=0)
    tl.store(weights_ptr + token * TOP_K + kk, chosen_w, mask=kk < TOP_K)
    tl.store(ids_ptr + token * TOP_K + kk, chosen_id, mask=kk < TOP_K)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] router logits -> (weights float32 [T, k], expert ids int64 [T, k]), highest first."""
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} outside 1..{num_experts}")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits, weights, ids, num_experts, *logits.stride(),
            TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        )  # fmt: skip
    return weights, ids


def moe_align(
    ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the assignments of ids [T, k] (expert ids 0 .. num_experts-1) by expert, in row blocks.

    Returns (sorted_ids, expert_of_block, num_tokens_post_pad):
    - sorted_ids [P] int64: assignment ids t*k+j, expert by expert (ascending within an expert), each
      expert's group padded to a multiple of block_m with the sentinel T*k. P is a bound that needs no host
      sync (T*k + min(E, T*k) * (block_m - 1)); slots past num_tokens_post_pad hold the sentinel too.
    - expert_of_block [P // block_m] int64: the expert of each block (-1 past the end); mapped through
      `expert_map` [E] (global expert -> local index, or -1 for an expert on another rank) when given.
    - num_tokens_post_pad [1] int64: the used length of sorted_ids (a multiple of block_m).
    """
    device = ids.device
    flat = ids.flatten()
    num = flat.numel()
    bound = num + min(num_experts, num) * (block_m - 1)
    bound = triton.cdiv(bound, block_m) * block_m
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(num, device=device) - (torch.cumsum(counts, 0) - counts)[expert]
    sorted_ids = torch.full((bound,), num, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, (ends - padded)[expert] + rank, order)
    block_starts = torch.arange(0, bound, block_m, device=device)
    expert_of_block = torch.searchsorted(ends, block_starts, right=True)  # num_experts past the end
    if expert_map is not None:
        expert_map = expert_map.to(device=device, dtype=torch.int64)
        table = torch.cat((expert_map, expert_map.new_full((1,), -1)))  # the past-the-end index -> -1
        expert_of_block = table[expert_of_block]
    else:
        expert_of_block = torch.where(expert_of_block < num_experts, expert_of_block, -1)
    return sorted_ids, expert_of_block, ends[-1:].clone() if num_experts else counts.new_zeros(1)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, expert_ptr, post_pad_ptr, scale_ptr,
    num_assign, n_out, k_in, up_offset,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_om, stride_on,
    A_DIV: tl.constexpr, SWIGLU: tl.constexpr, MUL_SCALE: tl.constexpr, ZERO_SKIPPED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[a, n] = act(a_rows[a // A_DIV] @ w[expert][:, n]) (* scale[a]) for the assignments a of one
    aligned row block. SWIGLU: the product with columns n and up_offset + n, then silu(gate) * up.
    A block of expert -1 writes zeros (ZERO_SKIPPED) or nothing."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(post_pad_ptr):
        return
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    assign = tl.load(sorted_ptr + m)
    row_mask = assign < num_assign
    n_mask = n < n_out
    out_ptrs = out_ptr + assign[:, None] * stride_om + n[None, :] * stride_on
    out_mask = row_mask[:, None] & n_mask[None, :]
    expert = tl.load(expert_ptr + pid_m)
    if expert < 0:  # another rank's expert: these assignments contribute nothing here
        if ZERO_SKIPPED:
            tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_N], out_ptr.dtype.element_ty), mask=out_mask)
        return
    a_ptrs = a_ptr + (assign // A_DIV)[:, None] * stride_am + kk[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + kk[:, None] * stride_wk + n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_mask = kk < k_in - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if SWIGLU:
            w_up = tl.load(w_ptrs + up_offset * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_SCALE:
        acc = acc * tl.load(scale_ptr + assign, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def fused_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    first_expert: int = 0,
    block_m: int | None = None,
) -> torch.Tensor:
    """x: [T, H]; ids, weights: [T, k] (global expert ids, routing weights); w13: [E_local, H, 2I];
    w2: [E_local, I, H] for global experts first_expert .. first_expert + E_local - 1 (assignments to
    other experts contribute nothing). Returns [T, H] in x's dtype: the weighted sum over local experts.
    `block_m` (>= 16, a power of two): rows per aligned block; default by batch size."""
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_local, _, two_i = w13.shape
    inter = two_i // 2
    if w2.shape != (num_local, inter, hidden) or w13.shape[1] != hidden:
        raise ValueError(f"expert weights {tuple(w13.shape)}/{tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    num_assign = num_tokens * top_k
    if num_assign == 0:
        return torch.zeros_like(x)
    if block_m is None:
        per_expert = num_assign / num_local
        block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    # the remote experts (ids outside the local range) form one extra bucket whose blocks write zeros
    local = ids - first_expert
    local = torch.where((local >= 0) & (local < num_local), local, num_local)
    expert_map = torch.cat((torch.arange(num_local, device=x.device), torch.full((1,), -1, device=x.device)))
    sorted_ids, expert_of_block, post_pad = moe_align(local, num_local + 1, block_m, expert_map)
    num_blocks = expert_of_block.shape[0]
    precision = dot_precision(x.dtype)
    block_n = 64 if max(inter, hidden) >= 64 else 32
    block_k = 64 if max(inter, hidden) >= 64 else 32

    h = torch.empty(num_assign, inter, dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, h, sorted_ids, expert_of_block, post_pad, weights,
        num_assign, inter, hidden, inter,
        *x.stride(), *w13.stride(), *h.stride(),
        A_DIV=top_k, SWIGLU=True, MUL_SCALE=False, ZERO_SKIPPED=False, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    partial = torch.empty(num_assign, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, w2, partial, sorted_ids, expert_of_block, post_pad, weights.contiguous(),
        num_assign, hidden, inter, 0,
        *h.stride(), *w2.stride(), *partial.stride(),
        A_DIV=1, SWIGLU=False, MUL_SCALE=True, ZERO_SKIPPED=True, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return partial.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)


@triton.jit
def _needs_kernel(
    ids_ptr, owner_ptr, needs_ptr, num_tokens, num_ranks,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    mask = (t < num_tokens)[:, None] & (kk < TOP_K)[None, :]
    expert = tl.load(ids_ptr + t[:, None] * TOP_K + kk[None, :], mask=mask, other=0)
    owner = tl.load(owner_ptr + expert, mask=mask, other=-1)
    for r in range(num_ranks):
        hit = tl.max(((owner == r) & mask).to(tl.int8), axis=1)
        tl.store(needs_ptr + t * num_ranks + r, hit, mask=t < num_tokens)


def ep_dispatch_layout(
    ids: torch.Tensor, expert_owner: torch.Tensor, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] global expert ids; expert_owner [E] int64 global expert -> rank (any map, uneven ok).

    Returns (token_order, send_counts): the token indices grouped by destination rank, a token once per
    rank owning at least one of its experts, ascending within a rank; send_counts [num_ranks] int64.
    """
    num_tokens, top_k = ids.shape
    needs = torch.empty(num_tokens, num_ranks, dtype=torch.int8, device=ids.device)
    if num_tokens:
        block_t = 32
        _needs_kernel[(triton.cdiv(num_tokens, block_t),)](
            ids.contiguous(), expert_owner.contiguous(), needs, num_tokens, num_ranks,
            TOP_K=top_k, BLOCK_T=block_t, BLOCK_K=triton.next_power_of_2(top_k),
        )  # fmt: skip
    token_order = needs.t().nonzero()[:, 1]
    return token_order, needs.sum(0, dtype=torch.int64)


def ep_dispatch_layout_reference(
    ids: torch.Tensor, expert_owner: torch.Tensor, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch contract of `ep_dispatch_layout`."""
    needs = torch.zeros(ids.shape[0], num_ranks, dtype=torch.bool, device=ids.device)
    needs.scatter_(1, expert_owner[ids], True)
    pairs = needs.t().nonzero()
    return pairs[:, 1], needs.sum(0)
