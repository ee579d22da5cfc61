"""Small building blocks: linear, RMSNorm and rotary position embeddings (numerics as in HF Qwen3-MoE).

Each op has a plain torch form and, for float32 on CPU once `kernels.cpu` is loaded and the weights
packed (`pack_weights`), one C++ kernel call. Modules carry `kernels` (set by `pack_weights`) to choose.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvferry.kernels.cpu import ops as cpu_ops
from kvferry.model import quant


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ an input-major weight: plain [K, N], packed by `pack` (it carries `.out_features`), or
    int8 with channel scales (`.int8_scale`, `quantize`: W8A8 by Triton where it runs, else torch)."""
    n = getattr(w, "out_features", None)
    if n is not None:
        return cpu_ops().packed_linear(x, w, n)
    scale = getattr(w, "int8_scale", None)
    if scale is not None:
        return int8_linear(x, w, scale)
    return x @ w


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ int8 q [K, N] with channel scales, activations quantized per row (model/quant.py); on a
    CPU to the range the C++ kernels use on this host (`quant.act_qmax`), so every path agrees."""
    from kvferry.kernels.select import triton_runs_on

    qmax = quant.act_qmax(x.device)
    if triton_runs_on(x.device):
        from kvferry.kernels import triton_w8a8

        return triton_w8a8.w8a8_linear(x, q, scale, qmax)
    return quant.w8a8_linear(x, q, scale, qmax)


def quantize(w: torch.Tensor) -> nn.Parameter:
    """An input-major weight [..., K, N] -> int8 [..., K, N] carrying `.int8_scale` [..., N] (torch and
    Triton paths; the CPU kernels pack theirs with `pack(..., int8=True)`)."""
    q, scale = quant.quantize_weight(w)
    param = nn.Parameter(q, requires_grad=False)
    param.int8_scale = scale.to(w.device)
    return param


def pack(w: torch.Tensor, bf16_dot: bool = False, int8: bool = False) -> nn.Parameter:
    """[K, N] -> the CPU kernels' [ceil(N/16), K, 16] layout (stacks [E, K, N] pack per expert).

    A float32 weight whose values are all bfloat16 numbers (any bf16 checkpoint) is stored as bf16:
    the kernels widen it exactly, so the products are the same and the step reads half the bytes.
    `bf16_dot` (kernels built with AVX512-BF16, even K): the weight is rounded to bf16 and packed in k
    pairs, [ceil(N/16), K/2, 32], and the GEMM rounds the activations to bf16 too (bf16 compute).
    `int8` (K a multiple of 4): per-channel int8 with the scales in the packing (`quant.py`, W8A8).
    """
    if int8 and w.shape[-2] % 4 == 0:
        q, scale = quant.quantize_weight(w)
        pack_i8 = cpu_ops().pack_weight_int8
        if w.dim() == 2:
            packed = pack_i8(q, scale)
        else:
            packed = torch.stack([pack_i8(qe, se) for qe, se in zip(q, scale, strict=True)])
        param = nn.Parameter(packed, requires_grad=False)
        param.out_features = w.shape[-1]
        return param
    if bf16_dot and w.shape[-2] % 2 == 0:
        pack_one = cpu_ops().pack_weight_bf16_pairs
    else:
        pack_one = cpu_ops().pack_weight
        narrow = w.to(torch.bfloat16)
        if torch.equal(narrow.to(w.dtype), w):
            w = narrow
    packed = pack_one(w) if w.dim() == 2 else torch.stack([pack_one(e) for e in w])
    param = nn.Parameter(packed, requires_grad=False)
    param.out_features = w.shape[-1]
    return param


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise the last dim (statistics in float32, as HF), then scale by `weight` (broadcast)."""
    if x.dtype == torch.float32:  # same arithmetic as below, with two fewer temporaries
        scale = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        return (x * scale).mul_(weight)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.cpu_kernels = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels:
            return cpu_ops().rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place); returns the normalised residual (vLLM's fused_add_rms_norm)."""
        if self.cpu_kernels:
            return cpu_ops().add_rms_norm(x, residual, self.weight, self.eps)
        return rms_norm(residual.add_(x), self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position: [max_pos, head_dim] in float32.

    The sin table has its first half negated, so that rotate_half(x) * sin == roll(x, D/2) * sin_signed
    and rotation takes one roll instead of a negate and a concatenation.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        llama3: tuple[float, ...] = (),
        yarn: tuple[float, ...] = (),
    ):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scale = 1.0
        if llama3:
            inv_freq = llama3_inv_freq(inv_freq, *llama3)
        if yarn:
            inv_freq, scale = yarn_inv_freq(head_dim, theta, *yarn[:4], truncate=bool(yarn[6])), yarn[4]
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_signed", emb.sin() * scale * sign, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, D] so they broadcast over heads of [T, H, D]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)
        return cos.to(dtype), sin.to(dtype)


def llama3_inv_freq(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original: float
) -> torch.Tensor:
    """Llama 3's RoPE scaling (as transformers computes it): wavelengths past the original context's
    over `low_freq_factor` are stretched by `factor`, those under it over `high_freq_factor` kept, and
    the band between blended."""
    low_wavelen, high_wavelen = original / low_freq_factor, original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original: float,
    beta_fast: float,
    beta_slow: float,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN's frequencies (as transformers computes them): dimensions that turn fewer than `beta_slow`
    times over the original context are interpolated by `factor`, those turning more than `beta_fast`
    times kept, and a linear ramp between."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (HF's non-interleaved RoPE), x: [T, H, D]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
