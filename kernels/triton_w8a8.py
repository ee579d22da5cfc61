"""Triton W8A8 GEMM for `--quantization int8` on CUDA: int8 activations (per row) x int8 weights (per output
channel), int32 accumulation, float32 scales applied once per output.

`w8a8_linear(x, q, scale)` quantizes x's rows (`int8.quantize_rows`: torch ops, one amax, one
multiply and round per row), then one kernel launch computes out[m, n] = float(sum_k xq[m, k] q[k, n]) *
(xs[m] * scale[n]). The integer sums are exact, so the result equals the torch reference
(`quant.w8a8_linear`) bit for bit at the same activation range (`act_qmax`: 127 on CUDA; the CPU kernels
take 127 with AVX512-VNNI, 63 on AVX2-only CPUs); tests run it under TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvferry.kernels.int8 import quantize_rows


@triton.jit
def _w8a8_kernel(
    x_ptr, q_ptr, xs_ptr, ws_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0,
        )
        b = tl.load(
            q_ptr + kk[:, None] * stride_qk + rn[None, :] * stride_qn,
            mask=(kk[:, None] < K) & (rn[None, :] < N),
            other=0,
        )
        acc += tl.dot(a, b, out_dtype=tl.int32)
    xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
    out = acc.to(tl.float32) * (xs[:, None] * ws[None, :])
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on,
        out,
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def w8a8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, act_qmax: int = 127) -> torch.Tensor:
    """x [M, K] (float) @ q [K, N] int8 with channel scales [N] -> [M, N] in x's dtype; x's rows quantized
    to [-act_qmax, act_qmax]."""
    assert q.dtype == torch.int8 and q.dim() == 2 and x.shape[-1] == q.shape[0], (x.shape, q.shape, q.dtype)
    xq, xs = quantize_rows(x, act_qmax)
    M, K = xq.shape
    N = q.shape[1]
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0:
        return out.to(x.dtype)
    block_m = 16 if M <= 16 else 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, 64))
    _w8a8_kernel[grid](
        xq, q, xs.contiguous(), scale.float().contiguous(), out,
        M, N, K,
        xq.stride(0), xq.stride(1), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
    )  # fmt: skip
    return out.to(x.dtype)
