"""Qwen3-MoE decoder over a paged KV cache (the HF `Qwen3MoeForCausalLM` network, inference only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.model.attention import AttentionMetadata, paged_attention, write_kv
from kvferry.model.config import ModelConfig
from kvferry.model.layers import RMSNorm, RotaryEmbedding, apply_rotary, rms_norm
from kvferry.model.moe import DenseMLP, SparseMoeBlock


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # weights are [in, out] (see moe.py)
        self.qkv = nn.Parameter(
            torch.empty(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size), requires_grad=False
        )
        self.o = nn.Parameter(torch.empty(cfg.q_size, cfg.hidden_size), requires_grad=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = x @ self.qkv
        # q and k heads are adjacent: normalise (each with its own weight) and rotate them in one pass
        qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
        weight = torch.cat((self.q_norm.weight.expand(hq, d), self.k_norm.weight.expand(hkv, d)))
        qk = apply_rotary(rms_norm(qk, weight, self.q_norm.eps), *rope)
        q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        write_kv(kv[0], kv[1], k, v, meta)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.layer)
        return out.reshape(t, -1) @ self.o


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer):
            self.mlp: nn.Module = SparseMoeBlock(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
            )
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope, kv, meta) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), rope, kv, meta)
        return x + self.mlp(self.post_attn_norm(x))


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.empty(cfg.hidden_size, cfg.vocab_size), requires_grad=False)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [L, 2, Hkv, num_blocks, block_size, D]. Returns [T, H]."""
        x = F.embedding(input_ids, self.embed)
        rope = self.rotary(positions, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_cache, strict=True):
            x = layer(x, rope, (k_cache, v_cache), meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> float32 logits [N, V]."""
        return (hidden @ self.lm_head).float()
