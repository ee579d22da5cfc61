"""Small building blocks: RMSNorm and rotary position embeddings (numerics as in HF Qwen3-MoE)."""

from __future__ import annotations

import torch
from torch import nn


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position: [max_pos, head_dim] in float32.

    The sin table has its first half negated, so that rotate_half(x) * sin == roll(x, D/2) * sin_signed
    and rotation takes one roll instead of a negate and a concatenation.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin_signed", emb.sin() * sign, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, D] so they broadcast over heads of [T, H, D]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (HF's non-interleaved RoPE), x: [T, H, D]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
