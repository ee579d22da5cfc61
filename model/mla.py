"""DeepSeek-V3's Multi-head Latent Attention over a paged latent cache.

Each token's K and V for every head come from one latent row: `kv_a` projects the hidden state to
`kv_lora_rank` values (RMS-normalised: c) and `qk_rope_head_dim` more (rotated: the key's shared rope
part, k_r). The cache holds [c | k_r] and nothing else: in the cache's two planes per layer, the row's
first half in one and its second half in the other (`ModelConfig.kv_cache_dim`), one "KV head".

Head h's key is [c @ W_uk[h] | k_r] and its value c @ W_uv[h] (`kv_b`, the up-projection). Prefill chunks
expand the latent of their context to per-head K and V and run SDPA. Decodes attend in the absorbed form
(DeepSeek's inference code, vLLM's MLA backend): the query's nope part folded through W_uk into the
latent space, q' = [q_nope @ W_uk[h]^T | q_rope], scores q' . [c | k_r] over the cached rows as they are,
the probabilities applied to c, and the result taken through W_uv: one pass over kv_lora_rank +
qk_rope_head_dim values per cached token, shared by every head, whatever the number of heads.

Tensor parallelism splits the heads (q, kv_b and o by head; `kv_a` and its norm replicated: every rank
computes the whole latent, the cache is replicated and rank 0 alone writes it out).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.kernels.cpu import ops as cpu_ops
from kvferry.kernels.paged_attention import block_rows, gather_kv
from kvferry.model.attention import AttentionMetadata, PrefillChunk, write_kv
from kvferry.model.config import ModelConfig
from kvferry.model.layers import RMSNorm, apply_rotary, linear
from kvferry.model.parallel import TPShard


class LatentAttention(nn.Module):
    PACKED = ("q", "q_a", "q_b", "kv_a", "o")

    def __init__(self, cfg: ModelConfig, shard: TPShard):
        super().__init__()
        self.num_heads = h = len(shard.heads)
        self.rank, self.nope, self.rope = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        qk = self.nope + self.rope
        hidden = cfg.hidden_size
        # weights are [in, out] (see moe.py)
        if cfg.q_lora_rank:
            self.q_a = nn.Parameter(torch.empty(hidden, cfg.q_lora_rank), requires_grad=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b = nn.Parameter(torch.empty(cfg.q_lora_rank, h * qk), requires_grad=False)
        else:
            self.q = nn.Parameter(torch.empty(hidden, h * qk), requires_grad=False)
        self.kv_a = nn.Parameter(torch.empty(hidden, self.rank + self.rope), requires_grad=False)
        self.kv_a_norm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b = nn.Parameter(torch.empty(self.rank, h * (self.nope + self.v_dim)), requires_grad=False)
        self.o = nn.Parameter(torch.empty(h * self.v_dim, hidden), requires_grad=False)
        self.scale = cfg.softmax_scale
        self.cpu_kernels = False  # the C++ CPU kernels (`pack_weights`): latent decode attention there
        self.triton = False  # the Triton kernels (`use_triton`): latent decode attention there
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
        self._absorbed_key: tuple | None = None  # the kv_b (device, dtype, data) and cpu_kernels they are of

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [H, nope, rank], W_uv [H, rank, v]) from `kv_b` (made once), in its dtype; under the C++
        kernels in bfloat16 where every value is one (any bf16 checkpoint: the kernels widen them exactly,
        so the products are the same and the decode reads half the bytes)."""
        key = (self.kv_b.device, self.kv_b.dtype, self.kv_b.data_ptr(), self.cpu_kernels)
        if self._absorbed is None or self._absorbed_key != key:
            kv_b = self.kv_b.view(self.rank, self.num_heads, self.nope + self.v_dim)
            w_uk = kv_b[:, :, : self.nope].permute(1, 2, 0).contiguous()
            w_uv = kv_b[:, :, self.nope :].permute(1, 0, 2).contiguous()
            if self.cpu_kernels:
                narrow = (w_uk.to(torch.bfloat16), w_uv.to(torch.bfloat16))
                if all(torch.equal(n.to(w.dtype), w) for n, w in zip(narrow, (w_uk, w_uv), strict=True)):
                    w_uk, w_uv = narrow
            self._absorbed, self._absorbed_key = (w_uk, w_uv), key
        return self._absorbed

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        lora = not hasattr(self, "q")
        q = linear(self.q_a_norm(linear(x, self.q_a)), self.q_b) if lora else linear(x, self.q)
        q_nope, q_rope, row = self._rotate_store(x, q.view(t, h, self.nope + self.rope), rope, kv, meta)
        out = x.new_empty(t, h, self.v_dim)
        if meta.num_decodes:
            nd = meta.num_decodes
            out[:nd] = self._decode(q_nope[:nd], q_rope[:nd], kv, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
            query = torch.cat((q_nope[rows], q_rope[rows]), dim=-1)
            out[rows] = self._prefill(query, row[rows], kv, chunk)
        return linear(out.view(t, h * self.v_dim), self.o)

    def store(self, x: torch.Tensor, rope, kv, meta: AttentionMetadata) -> None:
        """Only the cache write of `forward` (the latent rows of x's tokens into their slots)."""
        self._rotate_store(x, x.new_empty(x.shape[0], 0, self.nope + self.rope), rope, kv, meta)

    def _rotate_store(self, x, q, rope, kv, meta: AttentionMetadata):
        """q [T, H, nope + rope] -> (q_nope, rotated q_rope, the latent rows [T, rank + rope]), the rows
        written into the cache."""
        t = x.shape[0]
        latent = linear(x, self.kv_a)
        c = self.kv_a_norm(latent[:, : self.rank].contiguous())
        if self.cpu_kernels:  # rotation and the cache write in one pass
            cos, sin = (r.reshape(t, self.rope) for r in rope)
            slots = (meta.slot_blocks, meta.slot_offsets)
            q, row = cpu_ops().latent_rope_store(q, latent, c, cos, sin, *kv, *slots)
            return q[:, :, : self.nope], q[:, :, self.nope :], row
        cos, sin = (r if r.dim() == 3 else r.unsqueeze(1) for r in rope)  # [T, 1, rope]
        q_rope = apply_rotary(q[:, :, self.nope :], cos, sin)
        k_rope = apply_rotary(latent[:, None, self.rank :], cos, sin)[:, 0]
        row = torch.cat((c, k_rope), dim=-1)  # [T, rank + rope]: what the cache holds
        half = row.shape[1] // 2
        write_kv(kv[0], kv[1], row[:, None, :half], row[:, None, half:], meta)
        return q[:, :, : self.nope], q_rope, row

    def _decode(self, q_nope, q_rope, kv, meta: AttentionMetadata) -> torch.Tensor:
        """Absorbed: q_nope [B, H, nope] into the latent space, attention over the cached rows, W_uv."""
        w_uk, w_uv = self.absorbed()
        tables, skip = (meta.block_tables, meta.context_lens), meta.skip_keys
        if self.cpu_kernels:  # the three in one call
            query = torch.cat((q_nope, q_rope), dim=-1)
            return cpu_ops().latent_decode(query, w_uk, w_uv, kv[0], kv[1], *tables, self.scale, skip)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)  # [B, H, rank]
        query = torch.cat((q_lat, q_rope), dim=-1)
        if self.triton:
            from kvferry.kernels import triton_attention

            attn = triton_attention.latent_decode_attention(
                query, kv[0], kv[1], *tables, self.scale, self.rank, skip
            )
        else:
            attn = latent_decode_attention_reference(
                query, kv[0], kv[1], *tables, self.scale, self.rank, skip
            )
        return torch.bmm(attn.transpose(0, 1), w_uv.to(attn.dtype)).transpose(0, 1)  # [B, H, v]

    def _prefill(self, query, rows, kv, chunk: PrefillChunk) -> torch.Tensor:
        """Expanded: the chunk's context latents (its own rows when nothing is cached before it) up to
        per-head K and V, then causal SDPA. query: [Tq, H, nope + rope] -> [Tq, H, v]."""
        if chunk.context_len == chunk.q_len and kv[0].dtype != torch.int8:
            context, mask, causal = rows, None, True
        else:
            context = gather_latent(kv[0], kv[1], chunk.block_table, query.dtype)[: chunk.context_len]
            first = chunk.context_len - chunk.q_len
            q_pos = torch.arange(first, chunk.context_len, device=query.device)
            mask = torch.arange(chunk.context_len, device=query.device)[None, :] <= q_pos[:, None]
            causal = False
        s, h = context.shape[0], self.num_heads
        kv_up = (context[:, : self.rank] @ self.kv_b.to(context.dtype)).view(s, h, self.nope + self.v_dim)
        keys = torch.cat((kv_up[..., : self.nope], context[:, None, self.rank :].expand(s, h, self.rope)), -1)
        attn = F.scaled_dot_product_attention(
            query.transpose(0, 1),
            keys.transpose(0, 1),
            kv_up[..., self.nope :].transpose(0, 1),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
        )
        return attn.transpose(0, 1)


def gather_latent(
    first: torch.Tensor, second: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The latent rows of `blocks` from the two half planes [1, num_blocks, bs, W/2] (int8: dequantized):
    [len(blocks) * bs, W]."""
    rows = block_rows(first, blocks)
    return torch.cat((gather_kv(first, rows, dtype), gather_kv(second, rows, dtype)), dim=-1)


def latent_decode_attention_reference(
    q: torch.Tensor,
    first: torch.Tensor,
    second: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    rank: int,
    skip: int = 0,
) -> torch.Tensor:
    """Absorbed MLA decode: q [B, H, W] (W = rank + rope) against each sequence's cached latent rows
    (the half planes [1, num_blocks, bs, W/2], read through block_tables [B, Wb]; context_lens [B]), the
    probabilities applied to the rows' first `rank` values; positions below `skip` are not attended.
    Returns [B, H, rank]."""
    b, _, w = q.shape
    width = block_tables.shape[1] * first.shape[2]
    latent = gather_latent(first, second, block_tables.flatten(), q.dtype).view(b, width, w)
    scores = torch.bmm(q * scale, latent.transpose(1, 2))  # [B, H, S]
    key = torch.arange(width, device=q.device)[None, :]
    valid = (key < context_lens[:, None]) & (key >= skip)
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
    return torch.bmm(probs, latent[..., :rank])
