"""int8 weight quantization (`--quantization int8`, vLLM's flag): W8A8, dynamic.

- Weights: symmetric int8 per output channel, scale = max |w[:, n]| / 127, q = round(w / scale) in [-127, 127]
  (computed in float32 from the checkpoint's weight when the model loads; checkpoints already quantized in
  the compressed-tensors int8 format are not read yet).
- Activations: symmetric int8 per token (row), quantized at each call: scale = max |x| / 127,
  q = round_half_even(x * (127 / max |x|)). The C++ kernels' AVX2 loop (CPUs without AVX512-VNNI) takes
  7-bit activations instead, [-63, 63] (`act_qmax` 63, `kernels.cpu.int8_act_qmax()`), so vpmaddubsw
  can multiply them unsigned without saturating: 1.6-1.7x the GEMM's speed with 8 bits; held-out
  perplexity 69.048 against 69.008 float32 (+0.06%).
  The torch path on a CPU uses the same range as the host's kernels (`act_qmax`), and the KV
  fingerprint records a range other than 127 (`/a63`): such KV never mixes with 8-bit activations'.
- Products in int32, exact; the result is float32(acc) * (row scale * channel scale).

The C++ kernels (`kernels/cpu/int8_gemm.h`: AVX512-VNNI or AVX2) and the Triton kernel
(`kernels/triton_w8a8.py`) compute exactly this; `w8a8_linear` is the torch reference they are tested
against and what serves where neither runs. Which weights: the attention projections and the MLP / expert
GEMMs whose K is a multiple of 4; embeddings, the router, the norms and the LM head keep the model's dtype
(vLLM's compressed-tensors recipes leave the LM head and the router alone, too).
"""

from __future__ import annotations

import functools

import torch

from kvferry.kernels.int8 import quantize_rows

QUANTIZATION_CHOICES = ("int8",)


class QuantizationError(ValueError):
    """An unknown or unusable `--quantization`."""


def check_quantization(value: str | None) -> str | None:
    """`--quantization`: None (the model's dtype) or 'int8'; anything else is an error naming it."""
    if value in (None, "", "none"):
        return None
    if value not in QUANTIZATION_CHOICES:
        raise QuantizationError(
            f"--quantization {value!r} is not supported: "
            f"use {', '.join(QUANTIZATION_CHOICES)} or leave it unset"
        )
    return value


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An input-major weight [..., K, N] -> (int8 q [..., K, N], float32 scales [..., N]), per channel."""
    w32 = w.float()
    amax = w32.abs().amax(dim=-2)
    scale = amax / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w32 / safe.unsqueeze(-2)).clamp_(-127, 127).to(torch.int8)
    return q, scale


@functools.cache
def _cpu_act_qmax() -> int:
    from kvferry.kernels import cpu

    return cpu.int8_act_qmax()


def act_qmax(device: torch.device) -> int:
    """The int8 activation range W8A8 uses on `device`: on a CPU this host's C++ kernels' (127, or 63 on
    an AVX2-only CPU; `kernels.cpu.int8_act_qmax`), whichever path runs, so `--kernels torch` and the
    kernels compute the same; 127 elsewhere (Triton)."""
    return _cpu_act_qmax() if device.type == "cpu" else 127


def w8a8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, act_qmax: int = 127) -> torch.Tensor:
    """x [M, K] @ (q [K, N] int8, scale [N]) with x quantized per row to [-act_qmax, act_qmax]: the kernels'
    arithmetic, in float64 for the exact integer sums (K * 127^2 < 2^53), returned in x's dtype."""
    xq, xs = quantize_rows(x, act_qmax)
    acc = (xq.double() @ q.double()).float()
    return (acc * (xs.unsqueeze(-1) * scale.float().unsqueeze(0))).to(x.dtype)
