"""Per-row (per-token) int8 quantization of activations, as every W8A8 GEMM here does it: the C++ kernels
(`cpu/int8_gemm.h`), the Triton kernel (`triton_w8a8.py`) and the torch reference (`model/quant.py`)."""

from __future__ import annotations

import torch


def quantize_rows(x: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """float rows [M, K] -> (int8 [M, K], float32 scales [M]): scale = max |x| / qmax (0 for a zero row),
    q = round_half_even(x * (qmax / max |x|)), computed in float32. qmax 127 everywhere but the AVX2 CPU
    kernels' activations (63: `cpu.int8_act_qmax`)."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    # qmax / amax as one float32 division, as the C++ kernels compute it (`float / tensor` in torch is
    # reciprocal(amax) * qmax: two roundings, an ulp off in about a quarter of the rows)
    inv = torch.where(amax > 0, torch.full_like(amax, float(qmax)) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv.unsqueeze(-1)).to(torch.int8)
    return q, amax / float(qmax)


# int8 KV cache (`--kv-cache-dtype int8`): each cached K or V row of one head is D int8 values followed by
# its float32 scale (4 bytes), so a block carries its scales and the pool stores and ships them with it.
KV_SCALE_BYTES = 4


def kv_row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one cached row of one head: D, or D + 4 bytes for the int8 cache."""
    return head_dim + KV_SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., D] -> int8 rows [..., D + 4]: per-row symmetric int8 (`quantize_rows`), then the scale's
    four bytes."""
    shape = x.shape
    q, scale = quantize_rows(x.reshape(-1, shape[-1]))
    rows = torch.cat((q, scale.unsqueeze(-1).view(torch.int8)), dim=-1)
    return rows.view(*shape[:-1], shape[-1] + KV_SCALE_BYTES)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows [..., D + 4] -> [..., D]: q * scale in float32 (as the C++ kernels compute it)."""
    d = rows.shape[-1] - KV_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].float() * scale).to(dtype)
