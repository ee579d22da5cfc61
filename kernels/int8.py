"""Per-row (per-token) int8 quantization of activations, as every W8A8 GEMM here does it: the C++ kernels
(`cpu/int8_gemm.h`), the Triton kernel (`triton_w8a8.py`) and the torch reference (`model/quant.py`)."""

from __future__ import annotations

import torch


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float rows [M, K] -> (int8 [M, K], float32 scales [M]): scale = max |x| / 127 (0 for a zero row),
    q = round_half_even(x * (127 / max |x|)), computed in float32."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv.unsqueeze(-1)).to(torch.int8)
    return q, amax / 127.0
