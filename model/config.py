"""Model configuration, read from a Hugging Face `config.json`: the architectures kvferry serves
(`ARCHITECTURES`) share one decoder (`qwen3_moe.py`) that differs by what the config says: experts or
a dense MLP per layer, RMS norms on q and k (Qwen3) or none (Llama), Llama 3's or YaRN's RoPE scaling,
and DeepSeek-V3's Multi-head Latent Attention, shared experts and grouped sigmoid routing."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch


class ModelConfigError(ValueError):
    """The checkpoint's config.json is missing a field or asks for something kvferry does not support."""


# HF `architectures` name -> whether its attention normalizes q and k per head (Qwen3's q_norm/k_norm)
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": True,
    "Qwen3ForCausalLM": True,
    "LlamaForCausalLM": False,
    "DeepseekV3ForCausalLM": False,
}
# a config.json without `architectures`: its `model_type` names it
MODEL_TYPES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
DEEPSEEK = "DeepseekV3ForCausalLM"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    name: str = "model"
    architecture: str = "Qwen3MoeForCausalLM"
    qk_norm: bool = True  # q_norm / k_norm on every head (Qwen3); Llama has none
    # Llama 3's RoPE scaling: (factor, low_freq_factor, high_freq_factor, original max positions); ()
    rope_llama3: tuple[float, ...] = ()
    # YaRN (`layers.yarn_inv_freq`): (factor, original max positions, beta_fast, beta_slow, attention
    # factor (cos/sin are scaled by it), mscale_all_dim, truncate); ()
    rope_yarn: tuple[float, ...] = ()
    # DeepSeek-V3's Multi-head Latent Attention (kv_lora_rank > 0): one latent row per token is cached,
    # kv_lora_rank values (normalised) then qk_rope_head_dim (rotated); q through a LoRA when q_lora_rank
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rope dims' pairs interleaved (the loader de-interleaves them)
    # DeepSeek-V3's MoE: shared experts beside the routed ones; `noaux_tc` routing: sigmoid scores, a
    # correction bias that only chooses, the best `topk_group` of `n_group` groups, weights scaled
    n_shared_experts: int = 0
    sigmoid_routing: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_mtp_layers: int = 0  # the checkpoint's multi-token-prediction layers (DeepSeek-V3's `nextn`)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def mla(self) -> bool:
        """Multi-head Latent Attention (DeepSeek-V3): the cache holds one latent row per token."""
        return self.kv_lora_rank > 0

    @property
    def num_cache_layers(self) -> int:
        """Layers of the KV cache (and of a pool block): the decoder's, then the multi-token-prediction
        layer's (DeepSeek-V3's MTP; its KV travels with the sequence like every other layer's)."""
        return self.num_layers + min(self.num_mtp_layers, 1)

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE rotates: a head's (MLA: its rope part)."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values of one cached row of one KV head and plane. The cache has two planes per layer: K and V,
        or (MLA, one "head") a latent row's first and second halves, so that a latent block is the same
        object as any other to the cache, the pool and every transfer."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) // 2 if self.mla else self.head_dim

    @property
    def softmax_scale(self) -> float:
        """Attention's scale: 1/sqrt(the q.k width), times YaRN's mscale(factor, mscale_all_dim)^2 where
        an MLA config asks for it (as DeepSeek's code and transformers do)."""
        if not self.mla:
            return self.head_dim**-0.5
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope_yarn and self.rope_yarn[5]:
            m = yarn_mscale(self.rope_yarn[0], self.rope_yarn[5])
            scale *= m * m
        return scale

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict, name: str = "model") -> ModelConfig:
        arch = _architecture(raw)
        if raw.get("mlp_bias", False):
            raise ModelConfigError("mlp_bias=true is not supported (no architecture kvferry serves has it)")
        sliding = raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ())
        if sliding:
            raise ModelConfigError("use_sliding_window / sliding_attention layers are not supported")
        if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ModelConfigError(f"partial_rotary_factor={raw['partial_rotary_factor']} is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act={raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("attention_bias", False):
            raise ModelConfigError(f"attention_bias=true is not supported ({arch} in kvferry has none)")
        if raw.get("quantization_config"):
            method = raw["quantization_config"].get("quant_method", "?")
            raise ModelConfigError(
                f"quantization_config ({method}) is not supported: kvferry loads bf16/fp16/fp32 weights "
                "(convert the checkpoint, e.g. DeepSeek-V3's fp8 release, to bf16 first)"
            )
        theta, llama3, yarn = _rope(raw)
        try:
            heads = raw["num_attention_heads"]
            num_experts = raw.get("num_experts", raw.get("num_local_experts", 0))
            eos = raw.get("eos_token_id")
            extra = _deepseek(raw) if arch == DEEPSEEK else {}
            if arch == DEEPSEEK:
                num_experts = raw.get("n_routed_experts") or 0
            fields = dict(
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                num_layers=raw["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=raw.get("num_key_value_heads", heads),
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                intermediate_size=raw["intermediate_size"],
                num_experts=num_experts,
                num_experts_per_tok=raw.get("num_experts_per_tok", 0),
                moe_intermediate_size=raw.get("moe_intermediate_size", raw["intermediate_size"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                decoder_sparse_step=raw.get("decoder_sparse_step", 1) or 1,
                mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
                rope_theta=theta,
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                max_position_embeddings=raw.get("max_position_embeddings", 32768),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or "bfloat16",
                eos_token_ids=_token_ids(eos),
                name=name,
                architecture=arch,
                qk_norm=ARCHITECTURES[arch],
                rope_llama3=llama3,
                rope_yarn=yarn,
            )
            return cls(**(fields | extra))
        except KeyError as missing:
            raise ModelConfigError(f"config.json has no {missing.args[0]!r}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{path} does not exist")
        cfg = cls.from_dict(json.loads(path.read_text()), name=Path(model_dir).name)
        if cfg.num_mtp_layers and not _has_tensor(
            Path(model_dir), f"model.layers.{cfg.num_layers}.eh_proj.weight"
        ):
            # a checkpoint whose config names MTP layers it does not ship (many conversions drop them)
            cfg = dataclasses.replace(cfg, num_mtp_layers=0)
        return cfg


def _has_tensor(model_dir: Path, name: str) -> bool:
    """Whether the checkpoint in `model_dir` holds tensor `name` (its index, else its one file's header)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return name in json.loads(index.read_text()).get("weight_map", {})
    single = model_dir / "model.safetensors"
    if not single.is_file():
        return False
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return name in set(f.keys())


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json (real Qwen3 checkpoints list extra stop tokens there)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    return _token_ids(json.loads(path.read_text()).get("eos_token_id"))


GENERATION_DEFAULTS = {  # generation_config.json field -> the sampling field it is the default of
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(model_dir: str | Path, source: str = "auto") -> dict:
    """vLLM's --generation-config: the sampling defaults for fields a request leaves unset, from the
    model's generation_config.json (`auto`), none (`vllm`), or the one in directory `source`."""
    if source == "vllm":
        return {}
    folder = Path(model_dir) if source == "auto" else Path(source)
    path = folder / "generation_config.json"
    if source != "auto" and not path.is_file():
        raise ModelConfigError(f"--generation-config {source}: no generation_config.json there")
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelConfigError(f"{path}: {err}") from None
    out = {}
    for name, field in GENERATION_DEFAULTS.items():
        value = raw.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    return out


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """An HF `eos_token_id` field (one id, a list, or absent) as a tuple."""
    return tuple(value if isinstance(value, list) else [] if value is None else [value])


def _architecture(raw: dict) -> str:
    """The config's architecture (`architectures`, else what `model_type` names), one kvferry serves."""
    archs = raw.get("architectures")
    if archs:
        arch = archs[0] if isinstance(archs, list) else archs
    elif raw.get("model_type") in MODEL_TYPES:
        arch = MODEL_TYPES[raw["model_type"]]
    elif raw.get("model_type") is not None:
        raise ModelConfigError(
            f"model_type={raw['model_type']!r} is not supported; kvferry serves {', '.join(MODEL_TYPES)}"
        )
    else:
        arch = "Qwen3MoeForCausalLM"  # (kvferry's own early checkpoints named neither)
    if arch not in ARCHITECTURES:
        raise ModelConfigError(
            f"architectures={arch!r} is not supported; kvferry serves {', '.join(ARCHITECTURES)}"
        )
    return arch


def _rope(raw: dict) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """(rope_theta, Llama 3's scaling parameters or (), YaRN's or ()) from `rope_parameters` /
    `rope_scaling`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, (), ()
    if rope_type not in ("llama3", "yarn"):
        raise ModelConfigError(f"rope_type={rope_type!r} is not supported (default RoPE, llama3 or yarn)")
    try:
        if rope_type == "llama3":
            names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            return theta, tuple(float(params[n]) for n in names), ()
        factor = float(params["factor"])
        original = float(params["original_max_position_embeddings"])
    except KeyError as missing:
        raise ModelConfigError(
            f"rope_scaling / rope_parameters ({rope_type}) has no {missing.args[0]!r}"
        ) from None
    # as transformers' _compute_yarn_parameters: cos/sin scaled by the attention factor
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention = params.get("attention_factor")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
    yarn = (
        factor,
        original,
        float(params.get("beta_fast") or 32),
        float(params.get("beta_slow") or 1),
        float(attention),
        float(mscale_all_dim or 0),
        float(bool(params.get("truncate", True))),
    )
    return theta, (), yarn


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _deepseek(raw: dict) -> dict:
    """DeepSeek-V3's fields (MLA, shared experts, `noaux_tc` routing), refusing what kvferry would ignore."""
    method = raw.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ModelConfigError(f"topk_method={method!r} is not supported (DeepSeek-V3's noaux_tc only)")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise ModelConfigError(f"scoring_func={raw['scoring_func']!r} is not supported (noaux_tc: sigmoid)")
    if raw.get("moe_layer_freq", 1) != 1:
        raise ModelConfigError(
            f"moe_layer_freq={raw['moe_layer_freq']} is not supported (every layer past "
            "first_k_dense_replace is MoE, as in DeepSeek-V3)"
        )
    if not raw.get("kv_lora_rank"):
        raise ModelConfigError("kv_lora_rank must be > 0 (DeepSeek-V3's attention is MLA)")
    if (raw["kv_lora_rank"] + raw["qk_rope_head_dim"]) % 2:
        raise ModelConfigError(
            "kv_lora_rank + qk_rope_head_dim must be even (a latent row is cached in halves)"
        )
    experts, groups = raw.get("n_routed_experts") or 0, raw.get("n_group") or 1
    if experts % groups:
        raise ModelConfigError(f"n_group={groups} does not divide n_routed_experts={experts}")
    if not 1 <= (raw.get("topk_group") or 1) <= groups:
        raise ModelConfigError(f"topk_group={raw.get('topk_group')} must be in [1, n_group={groups}]")
    per_group = experts // groups
    if experts and per_group < 2:
        raise ModelConfigError(
            f"n_routed_experts={experts} / n_group={groups}: a group needs 2 experts (it scores by its top 2)"
        )
    top_k, kept = raw.get("num_experts_per_tok", 8), (raw.get("topk_group") or 1) * per_group
    if experts and not 1 <= top_k <= kept:
        raise ModelConfigError(
            f"num_experts_per_tok={top_k} must be in [1, topk_group x n_routed_experts / n_group = {kept}]"
        )
    return {
        "kv_lora_rank": raw["kv_lora_rank"],
        "q_lora_rank": raw.get("q_lora_rank") or 0,
        "qk_nope_head_dim": raw["qk_nope_head_dim"],
        "qk_rope_head_dim": raw["qk_rope_head_dim"],
        "v_head_dim": raw["v_head_dim"],
        "n_shared_experts": raw.get("n_shared_experts") or 0,
        "sigmoid_routing": True,
        "n_group": groups,
        "topk_group": raw.get("topk_group") or 1,
        "routed_scaling_factor": float(raw.get("routed_scaling_factor", 1.0)),
        "num_mtp_layers": raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0,
        "num_kv_heads": 1,  # the latent: one row shared by every head
        "head_dim": raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"],
        "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
        "num_experts_per_tok": raw.get("num_experts_per_tok", 8),
        "mlp_only_layers": tuple(range(raw.get("first_k_dense_replace", 0) or 0)),
        "decoder_sparse_step": 1,
        "rope_interleave": bool(raw.get("rope_interleave", True)),
    }


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); elsewhere bf16 is emulated."""
    from kvferry.kernels.cpu import cpu_flags

    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_dtype(requested: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto` picks the checkpoint's dtype, except on CPUs that emulate bf16, where float32 is faster."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise ModelConfigError(f"--dtype {requested!r} is not one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[requested]
    native = _DTYPES.get(config.torch_dtype, torch.bfloat16)
    if device.type == "cpu" and native != torch.float32 and not cpu_has_native_bf16():
        return torch.float32
    return native


def runs_cpu_kernels(dtype: torch.dtype, device: torch.device, kernels: str = "auto") -> bool:
    """Whether a model of `dtype` on `device` is served by the C++ CPU kernels (`--kernels auto`): float32
    where they build, bfloat16 where they also have the bf16 dot product (AVX512-BF16)."""
    from kvferry.kernels.select import choose

    return kernels == "auto" and choose(device, dtype, kernels) == "cpu"


def kv_cache_dtype(
    dtype: torch.dtype, device: torch.device, kernels: str = "auto", cache_dtype: str = "auto"
) -> torch.dtype:
    """The KV cache's dtype: int8 for `--kv-cache-dtype int8`; else the activations' dtype, float32 under
    the CPU kernels (a bf16 model there keeps its residual stream and KV in float32), else the model's
    dtype. The pool's block layout uses it."""
    if cache_dtype == "int8":
        return torch.int8
    return torch.float32 if runs_cpu_kernels(dtype, device, kernels) else dtype
