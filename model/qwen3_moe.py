"""The decoder over a paged KV cache, inference only: HF's `Qwen3MoeForCausalLM` network, which with
no experts is `Qwen3ForCausalLM` and, without q/k norms and with Llama 3's RoPE, `LlamaForCausalLM`;
with latent attention (`mla.py`), grouped sigmoid routing and shared experts, `DeepseekV3ForCausalLM`
(`config.ARCHITECTURES`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.kernels.cpu import ops as cpu_ops
from kvferry.model.attention import AttentionMetadata, padded_tables, paged_attention, write_kv
from kvferry.model.config import ModelConfig
from kvferry.model.layers import RMSNorm, RotaryEmbedding, apply_rotary, linear, pack, quantize, rms_norm
from kvferry.model.mla import LatentAttention
from kvferry.model.moe import DenseMLP, ExpertParallelMoe, Gating, SparseMoeBlock
from kvferry.model.parallel import Comm, Parallel, TPShard


class Attention(nn.Module):
    PACKED = ("qkv", "o")

    def __init__(self, cfg: ModelConfig, shard: TPShard):
        super().__init__()
        # this rank's heads (all of them unless tensor-parallel)
        self.num_heads, self.num_kv_heads = len(shard.heads), len(shard.kv_heads)
        self.head_dim = d = cfg.head_dim
        # weights are [in, out] (see moe.py); qkv is column-parallel, o row-parallel
        self.qkv = nn.Parameter(
            torch.empty(cfg.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * d), requires_grad=False
        )
        self.o = nn.Parameter(torch.empty(self.num_heads * d, cfg.hidden_size), requires_grad=False)
        self.qk_norm = cfg.qk_norm  # Qwen3's per-head norms of q and k; Llama has none
        self.eps = cfg.rms_norm_eps
        if self.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5
        self.cpu_kernels = False  # the C++ CPU kernels (`pack_weights`)
        self.bf16_products = False  # a bf16 model on them: bf16 prefill attention products (AMX path)
        self.triton = False  # the Triton kernels (`use_triton`)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        if self.cpu_kernels:  # norms (if any), rotation and the K/V cache writes in one call
            qw, kw = self.qk_norm_weights()
            qk = cpu_ops().qk_norm_rope_store(
                qkv, qw, kw, self.eps, *rope, *kv, meta.slot_blocks, meta.slot_offsets, hq
            )
        else:
            # q and k heads are adjacent: normalise (each with its own weight) and rotate them in one pass
            qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
            if self.qk_norm:
                weight = torch.cat((self.q_norm.weight.expand(hq, d), self.k_norm.weight.expand(hkv, d)))
                qk = rms_norm(qk, weight, self.q_norm.eps)
            qk = apply_rotary(qk, *rope)
            write_kv(kv[0], kv[1], qk[:, hq:], v, meta)
        q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D]
        backend = "cpu" if self.cpu_kernels else "triton" if self.triton else "torch"
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, backend, self.bf16_products)
        return linear(out.reshape(t, hq * d), self.o)

    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The q and k norm weights as the C++ kernels take them (both empty: no norms, as in Llama)."""
        if self.qk_norm:
            return self.q_norm.weight, self.k_norm.weight
        none = torch.empty(0, device=self.qkv.device)
        return none, none


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, parallel: Parallel):
        super().__init__()
        tp, ep = parallel.tp, parallel.ep
        self.tp = tp
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        shard = TPShard(tp.rank, tp.size, cfg.num_heads, cfg.num_kv_heads)
        self.attn = LatentAttention(cfg, shard) if cfg.mla else Attention(cfg, shard)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_partial = tp.size > 1  # each rank's MLP output is a partial sum to all-reduce
        gating, shared = Gating.of(cfg), cfg.moe_intermediate_size * cfg.n_shared_experts
        if cfg.is_moe_layer(layer) and ep.size > 1:  # shared experts whole on every rank
            self.mlp: nn.Module = ExpertParallelMoe(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                ep,
                gating,
                shared,
            )
            self.mlp_partial = False
        elif cfg.is_moe_layer(layer):  # under TP every expert (shared ones too) is split along its
            self.mlp = SparseMoeBlock(  # intermediate dim
                cfg.hidden_size,
                cfg.moe_intermediate_size // tp.size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                gating,
                shared // tp.size,
            )
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size // tp.size)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope, kv, meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to `residual` (None at the first layer).

        Returns (this layer's MLP output, the residual stream before it); the next layer adds them.
        """
        if residual is None:
            residual, h = x, self.input_norm(x)
        else:
            h = self.input_norm.add_forward(x, residual)
        h = self.tp.all_reduce(self.attn(h, rope, kv, meta))
        out = self.mlp(self.post_attn_norm.add_forward(h, residual))
        return (self.tp.all_reduce(out) if self.mlp_partial else out), residual


def rotary_of(cfg: ModelConfig, max_positions: int | None = None) -> RotaryEmbedding:
    """The model's RoPE tables (its theta, and Llama 3's or YaRN's scaling where the config has it)."""
    return RotaryEmbedding(
        cfg.rope_dim,
        max_positions or cfg.max_position_embeddings,
        cfg.rope_theta,
        cfg.rope_llama3,
        cfg.rope_yarn,
    )


@dataclass
class MtpInputs:
    """What the multi-token-prediction layer's cache write needs for a step's tokens (`ModelRunner`):
    slot p holds the entry of (token p, the target's hidden state at p - 1) at RoPE position p - 1 (vLLM's
    entry p - 1), so a block's MTP rows depend on its own tokens only, like its other layers."""

    prev: torch.Tensor  # [T] each token's previous hidden state: a row of this step's output, or T + j
    saved: torch.Tensor  # [S, H] ... saved[j] (a state kept from an earlier step)
    slot_blocks: torch.Tensor  # [T] the MTP row's block (the sink where the previous state is unknown)


class MtpLayer(nn.Module):
    """DeepSeek-V3's multi-token-prediction module: h' = eh_proj([enorm(embed(t)), hnorm(h_prev)]), one
    decoder layer (its own latent cache: the cache's last layer), shared_head's norm before the LM head.
    Its experts are whole on every rank (no expert-parallel collectives: a rank drafts on its own)."""

    PACKED = ("eh_proj",)

    def __init__(self, cfg: ModelConfig, parallel: Parallel):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Parameter(torch.empty(2 * h, h), requires_grad=False)
        self.block = DecoderLayer(cfg, cfg.num_layers, Parallel(parallel.tp, Comm.single()))
        self.head_norm = RMSNorm(h, cfg.rms_norm_eps)

    def inputs(self, embeds: torch.Tensor, prev: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The block's input for tokens with these embeddings, previous hidden states and RoPE positions
        (the embedding zeroed at position 0, as vLLM's DeepSeek MTP does)."""
        embeds = embeds.masked_fill(positions[:, None] == 0, 0.0)
        return linear(torch.cat((self.enorm(embeds), self.hnorm(prev)), dim=-1), self.eh_proj)

    def forward(self, x: torch.Tensor, rope, kv, meta: AttentionMetadata) -> torch.Tensor:
        """The block's output before shared_head's norm (what the next draft takes as its h_prev)."""
        out, residual = self.block(x, None, rope, kv, meta)
        return out + residual


class Qwen3MoeModel(nn.Module):
    PACKED = ("lm_head",)
    # attributes that change every step and are never a parameter, buffer or module: set without
    # nn.Module.__setattr__'s lookups (after a step has streamed the weights through the caches, each one
    # costs microseconds)
    STEP_STATE = frozenset({"step_logits", "step_argmax", "after_layer"})

    def __setattr__(self, name: str, value) -> None:
        if name in Qwen3MoeModel.STEP_STATE:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, parallel: Parallel | None = None):
        super().__init__()
        self.cpu_kernels = False
        self.decode_weights: list[torch.Tensor] = []  # set by pack_weights where decode_layers can serve
        # (MLA) the kernels' LatentStep over decode_weights, built at the first decode step after pack_weights
        self.latent_step = None
        # the last forward's (hidden states, logits) where its one call computed the LM head too
        # (latent_decode_layers): compute_logits of those hidden states returns those logits
        self.step_logits: tuple[torch.Tensor, torch.Tensor] | None = None
        # a list-fed step's (decode_lists) logits and each row's argmax, found in its call: the sampler's
        # greedy tokens for those logits (`ModelRunner._sample`)
        self.step_argmax: tuple[torch.Tensor, list[int]] | None = None
        # called with a layer's index once its forward (and so its KV-cache write) is done: a prefill
        # streams that layer's finished blocks to the pool meanwhile (`engine.kv.on_layers`)
        self.after_layer: Callable[[int], None] | None = None
        self.cfg = cfg
        self.parallel = parallel = parallel or Parallel.single()
        tp = parallel.tp
        self.shard = TPShard(tp.rank, tp.size, cfg.num_heads, cfg.num_kv_heads)
        self.vocab_first, vocab_rows = self.shard.vocab(cfg.vocab_size)  # vocab-parallel under TP
        self.embed = nn.Parameter(torch.empty(vocab_rows, cfg.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, parallel) for i in range(cfg.num_layers))
        self.num_heads = self.layers[0].attn.num_heads  # this rank's query heads
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.empty(cfg.hidden_size, vocab_rows), requires_grad=False)
        self.rotary = rotary_of(cfg, max_positions)
        self.mtp = MtpLayer(cfg, parallel) if cfg.num_mtp_layers else None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        mtp: MtpInputs | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [L (+ 1: the MTP layer's), 2, Hkv, num_blocks, block_size, D].
        Returns the final hidden states [T, H]. `mtp`: also write the MTP layer's cache rows."""
        layers, self.step_logits, self.step_argmax = len(self.layers), None, None
        if self.decode_weights and 0 < meta.num_decodes == input_ids.shape[0]:
            layer_kv = kv_cache if kv_cache.shape[0] == layers else kv_cache[:layers]  # (ops run cold here)
            hidden = self._decode_step(input_ids, positions, layer_kv, meta)
            embeds = F.embedding(input_ids, self.embed) if mtp is not None else None
            if self.after_layer is not None:  # one call ran every layer: each one's KV is final now
                for i in range(layers):  # (a prompt's last chunk of one token among decodes streams too)
                    self.after_layer(i)
        else:
            x, residual = self._embed(input_ids), None
            embeds = x.clone() if mtp is not None else None  # (the first layer adds to x in place)
            rope = self._rope(positions, x.dtype)
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_cache[:layers], strict=True)):
                x, residual = layer(x, residual, rope, (k_cache, v_cache), meta)
                if self.after_layer is not None:
                    self.after_layer(i)
            hidden = self.norm.add_forward(x, residual)
        if self.mtp is not None:
            if mtp is not None:
                self._mtp_store(embeds, hidden, mtp, kv_cache[layers], meta, positions)
            if self.after_layer is not None:
                self.after_layer(layers)
        return hidden

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.rotary(positions, dtype)
        return tuple(t.squeeze(1) for t in rope) if self.cpu_kernels else rope  # the kernels take [T, D]

    def _mtp_store(self, embeds, hidden, mtp: MtpInputs, kv, meta: AttentionMetadata, positions) -> None:
        """The MTP layer's cache rows for this step's tokens (no attention or MLP: only its latent)."""
        prev = torch.cat((hidden, mtp.saved.to(hidden.dtype)))[mtp.prev]
        positions = (positions - 1).clamp(min=0)  # slot p: RoPE position p - 1 (slot 0 is never read)
        x = self.mtp.inputs(embeds, prev, positions)
        slots = AttentionMetadata(mtp.slot_blocks, meta.slot_offsets)
        block = self.mtp.block
        block.attn.store(block.input_norm(x), self._rope(positions, x.dtype), tuple(kv), slots)

    def draft(
        self, tokens: torch.Tensor, prev: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP pass for decode rows: tokens [B] at slots `meta` (the MTP entry of slot p: RoPE
        position p - 1), previous hidden states [B, H]. Returns (float32 logits [B, V], the hidden states
        a next pass takes)."""
        positions = meta.context_lens - 2  # slot p = context - 1; its RoPE position p - 1
        x = self.mtp.inputs(self._embed(tokens), prev, positions)
        out = self.mtp(x, self._rope(positions, x.dtype), tuple(kv_cache[len(self.layers)]), meta)
        return self.compute_logits(self.mtp.head_norm(out)), out

    def _decode_step(self, input_ids, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """A step of decodes only, every layer in one kernel call (`decode_weights`)."""
        cfg = self.cfg
        slots = (meta.slot_blocks, meta.slot_offsets, meta.block_tables, meta.context_lens, self.norm.weight)
        if cfg.mla:  # (the embedding and the rope rows in the call too: a torch op here costs tens of us)
            hidden, logits = self._latent_step().run(input_ids, kv_cache, positions, *slots[:4])
            self.step_logits = (hidden, logits)  # (the LM head as the last phase of the same call)
            return hidden
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.cos[positions], self.rotary.sin_signed[positions]
        return cpu_ops().decode_layers(
            x, self.decode_weights, kv_cache, cos, sin, *slots,
            self.num_heads, cfg.rms_norm_eps, self.layers[0].attn.scale,
            cfg.num_experts_per_tok, cfg.norm_topk_prob,
        )  # fmt: skip

    def _latent_step(self):
        """The kernels' LatentStep over `decode_weights`: the weights' checks once, not 16 tensors a layer
        through each call."""
        if self.latent_step is None:
            cfg = self.cfg
            dims = [self.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank]
            dims.append(cfg.v_head_dim)
            self.latent_step = torch.classes.kvferry_cpu.LatentStep(
                self.embed, self.decode_weights, self.rotary.cos, self.rotary.sin_signed,
                self.norm.weight, dims, cfg.rms_norm_eps, cfg.softmax_scale, cfg.num_experts_per_tok,
                cfg.norm_topk_prob, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, self.lm_head,
                self.lm_head.out_features,
            )  # fmt: skip
        return self.latent_step

    def decode_lists(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_blocks: list[int],
        slot_offsets: list[int],
        tables: list[list[int]],
        lens: list[int],
        kv_cache: torch.Tensor,
    ) -> torch.Tensor | None:
        """A step of decodes only (one token per sequence) straight from the scheduler's lists: `forward`'s
        one-call step without its metadata tensors (after a step has streamed the weights through the
        caches, each torch op around the call costs tens of microseconds). The final hidden states [T, H],
        their logits kept for `compute_logits`; None where this path does not serve: not the one-call MLA
        step, no sequence, or a layer hook. (It writes no MTP cache rows: a step that does takes `forward`.
        Not under `inference_mode`: nothing it takes requires grad; its outputs are plain tensors.)"""
        if not (self.cfg.mla and self.decode_weights and tables and self.after_layer is None):
            return None
        layers = self.cfg.num_layers  # (len(self.layers): nn.Module's __getattr__, slow here)
        kv_cache = kv_cache if kv_cache.shape[0] == layers else kv_cache[:layers]  # (an MTP layer's is last)
        flat, _ = padded_tables(tables)
        step = self._latent_step()
        hidden, logits, best = step.run_lists(
            input_ids, kv_cache, positions, slot_blocks, slot_offsets, flat, lens
        )
        self.step_logits, self.step_argmax = (hidden, logits), (logits, best)
        return hidden

    def decode_burst(
        self,
        input_ids: list[int],
        positions: list[int],
        tables: list[list[int]],
        lens: list[int],
        kv_cache: torch.Tensor,
        steps: int,
    ) -> list[list[int]] | None:
        """`steps` greedy decode steps in one call (`decode_lists`' path, `LatentStep.run_burst`): step j's
        tokens are step j - 1's argmax, each at the next position, its K/V in the slot its block table gives
        (`tables` must hold every position the call computes). Each step's tokens; None where that path does
        not serve (`ModelRunner.run_burst` then runs a forward pass a step)."""
        if not (self.cfg.mla and self.decode_weights and tables and self.after_layer is None):
            return None
        layers = self.cfg.num_layers
        kv_cache = kv_cache if kv_cache.shape[0] == layers else kv_cache[:layers]
        flat, _ = padded_tables(tables)
        counts = [len(table) for table in tables]
        tokens = self._latent_step().run_burst(input_ids, kv_cache, positions, flat, counts, lens, steps)
        self.step_logits, self.step_argmax = None, None
        width = len(input_ids)
        return [tokens[j * width : (j + 1) * width] for j in range(steps)]

    def _collect_decode_weights(self) -> list[torch.Tensor]:
        """The weights `decode_layers` takes, 9 per layer (`latent_decode_layers`: 16); empty where a layer
        is not one it runs (tensor or expert parallelism)."""
        cfg = self.cfg
        if self.parallel.tp.size > 1 or not all(
            isinstance(lyr.mlp, SparseMoeBlock | DenseMLP) for lyr in self.layers
        ):
            return []
        if cfg.mla:
            return self._collect_latent_decode_weights()
        if cfg.sigmoid_routing or cfg.n_shared_experts:
            return []
        out = []
        for layer in self.layers:
            attn, mlp = layer.attn, layer.mlp
            router = mlp.router if isinstance(mlp, SparseMoeBlock) else torch.empty(0)
            out += [layer.input_norm.weight, attn.qkv, *attn.qk_norm_weights(), attn.o]
            out += [layer.post_attn_norm.weight, router, mlp.w13, mlp.w2]
        return out

    def _collect_latent_decode_weights(self) -> list[torch.Tensor]:
        none, out = torch.empty(0), []
        for layer in self.layers:
            attn, mlp = layer.attn, layer.mlp
            lora = hasattr(attn, "q_a")
            out += [layer.input_norm.weight, attn.q_a if lora else none]
            out += [attn.q_a_norm.weight if lora else none, attn.q_b if lora else attn.q]
            out += [attn.kv_a, attn.kv_a_norm.weight, *attn.absorbed(), attn.o, layer.post_attn_norm.weight]
            if isinstance(mlp, SparseMoeBlock):
                shared = [mlp.shared.w13, mlp.shared.w2] if mlp.shared is not None else [none, none]
                out += [mlp.router, mlp.e_bias, mlp.w13, mlp.w2, *shared]
            else:
                out += [none, none, mlp.w13, mlp.w2, none, none]
        return out

    def compute_logits(self, hidden: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """hidden: [N, H] -> float32 logits [N, V], or those of `rows` only (every TP rank takes part; all
        get the logits)."""
        step, self.step_logits = self.step_logits, None
        if step is not None and step[0] is hidden:  # computed in the forward's call (once: the caller's now)
            return step[1] if rows is None else step[1][rows]
        with torch.inference_mode():
            local = linear(hidden if rows is None else hidden[rows], self.lm_head).float()
            if self.parallel.tp.size == 1:
                return local
            return torch.cat(self.parallel.tp.all_gather(local), dim=-1)[:, : self.cfg.vocab_size]

    def pack_weights(self, quantization: str | None = None) -> bool:
        """Switch to the C++ CPU kernels where they build: weights are repacked in place, so this is
        one-way. Returns whether the kernels now serve this model.

        A float32 model keeps float32 arithmetic. A bfloat16 model is served by the bf16 dot-product GEMM
        where the kernels have it (AVX512-BF16): matmul weights and inputs in bf16, float32 accumulation,
        and everything else (residual stream, norms, attention, KV cache) in float32, so the model's
        remaining tensors are widened to float32 (exactly); where the kernels' AMX path serves, prefill
        attention's products run in bf16 too (`bf16_products`). Elsewhere a bf16 model keeps the torch ops.
        `quantization="int8"`: the attention and MLP / expert GEMMs run W8A8 (`quant.py`) whatever the
        dtype; the LM head keeps the dtype's GEMM.
        """
        from kvferry.kernels import cpu

        dtype = self.embed.dtype
        on_cpu = self.embed.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        if self.cpu_kernels or not on_cpu:
            return self.cpu_kernels
        if not cpu.load() or (dtype == torch.bfloat16 and not cpu.bf16_dot()):
            return False
        bf16_dot = dtype == torch.bfloat16
        int8 = quantization == "int8"
        for module in self.modules():
            packed = getattr(module, "PACKED", ())
            for name, param in module.named_parameters(recurse=False):
                if name in packed:
                    setattr(module, name, pack(param, bf16_dot, int8=int8 and module is not self))
                elif param.dtype != torch.float32:
                    setattr(module, name, nn.Parameter(param.float(), requires_grad=False))
            if hasattr(module, "cpu_kernels"):
                module.cpu_kernels = True
            if hasattr(module, "bf16_products"):
                module.bf16_products = bf16_dot
        self.decode_weights, self.latent_step = self._collect_decode_weights(), None
        return True

    def quantize_weights(self) -> None:
        """`--quantization int8` where the CPU kernels do not serve (torch ops, Triton): the attention and
        MLP / expert weights become int8 with channel scales (`layers.quantize`), used W8A8 by `linear` and
        the experts. The LM head keeps the model's dtype."""
        for module in self.modules():
            if module is self:
                continue
            for name, param in module.named_parameters(recurse=False):
                if name in getattr(module, "PACKED", ()) and param.shape[-2] % 4 == 0:
                    setattr(module, name, quantize(param))

    def use_triton(self) -> None:
        """Switch attention and the MoE layers to the Triton kernels (`kernels.select`: on CUDA, or on
        CPU tensors under TRITON_INTERPRET=1). The weights stay as they are."""
        for module in self.modules():
            if hasattr(module, "triton"):
                module.triton = True

    @property
    def num_local_kv_heads(self) -> int:
        return len(self.shard.kv_heads)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = self.parallel.tp
        if tp.size == 1:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_first
        outside = (local < 0) | (local >= self.embed.shape[0])
        x = F.embedding(local.clamp(0, self.embed.shape[0] - 1), self.embed)
        return tp.all_reduce(x.masked_fill_(outside[:, None], 0))
