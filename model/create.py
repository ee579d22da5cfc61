"""Deterministic default models: seeded weights in HF layout (Qwen3-MoE, or the dense Qwen3 / Llama and
the DeepSeek-V3 specs) and a locally trained BPE tokenizer.

`create_model("tiny", out)` writes config.json, generation_config.json, tokenizer.json,
tokenizer_config.json (with a ChatML chat template) and safetensors. The same spec, seed and Python
standard library give the same bytes. Like vLLM's `--load-format dummy`, this stands in for hub
downloads, which do not exist here. A spec with a `_train` block (`trained`) starts from the seeded
weights and is trained on the standard library's training split (`train.py`, a few minutes on 2 cores;
deterministic given the seed and thread count on one kind of CPU), and records the run in training.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvferry.model.chat_template import CHATML
from kvferry.model.config import ModelConfig, ModelConfigError

SPECS = (
    "tiny",
    "bench",
    "trained",
    "draft",
    "tiny-qwen3",
    "tiny-llama",
    "tiny-deepseek",
    "tiny-deepseek-nolora",
    "bench-qwen3",
    "bench-llama",
    "bench-deepseek",
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS_BYTES = 3_000_000
INDEX_FILE = "model.safetensors.index.json"


def load_spec(name: str) -> dict:
    """The built-in model's config.json fields."""
    return {k: v for k, v in _raw_spec(name).items() if not k.startswith("_")}


def training_spec(name: str) -> dict | None:
    """The built-in model's training settings (`train.TrainConfig` fields), None for a seeded model."""
    return _raw_spec(name).get("_train")


def _raw_spec(name: str) -> dict:
    if name not in SPECS:
        raise ModelConfigError(f"unknown built-in model {name!r}; choose one of {', '.join(SPECS)}")
    return json.loads(resources.files("kvferry.model").joinpath("specs", f"{name}.json").read_text())


def resolve_model(model: str, models_dir: Path) -> Path:
    """Checkpoint directory for `model`: a path with config.json or a built-in name (made on first use)."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if model in SPECS:
        target = models_dir / model
        if not (target / "config.json").is_file():
            create_model(model, target)
        return target
    raise ModelConfigError(
        f"--model {model!r} is neither a checkpoint directory nor one of {', '.join(SPECS)}"
    )


def create_model(name: str, out: Path, seed: int = 0, max_shard_bytes: int = 2**31) -> Path:
    """Write the built-in model `name` to `out` atomically (a temp dir renamed into place)."""
    return create_from_spec(
        load_spec(name), out, seed=seed, max_shard_bytes=max_shard_bytes, training=training_spec(name)
    )


def create_from_spec(
    spec: dict, out: Path, seed: int = 0, max_shard_bytes: int = 2**31, training: dict | None = None
) -> Path:
    """`training`: train the seeded weights with these `train.TrainConfig` settings before saving."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tokenizer = train_tokenizer(spec["vocab_size"])
        tokenizer.save(str(tmp / "tokenizer.json"))
        config = dict(spec, eos_token_id=tokenizer.token_to_id(SPECIAL_TOKENS[0]), bos_token_id=None)
        config.setdefault("hidden_act", "silu")
        config.setdefault("attention_bias", False)
        _write_json(tmp / "config.json", config)
        # chat turns end with <|im_end|> (as in Qwen's generation_config), text with <|endoftext|>
        chat_eos = [config["eos_token_id"], tokenizer.token_to_id("<|im_end|>")]
        _write_json(tmp / "generation_config.json", {"eos_token_id": chat_eos})
        _write_json(
            tmp / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": SPECIAL_TOKENS[0],
                "pad_token": SPECIAL_TOKENS[0],
                "model_max_length": spec.get("max_position_embeddings", 4096),
                "chat_template": CHATML,
            },
        )
        dtype = getattr(torch, spec.get("torch_dtype", "bfloat16"))
        model_cfg = ModelConfig.from_dict(config)
        if training is not None and (not model_cfg.qk_norm or model_cfg.rope_llama3):
            raise ModelConfigError("a trained spec must be Qwen3 (train.py has q/k norms and plain RoPE)")
        if training is None:
            tensors = random_weights(model_cfg, seed, dtype)
        else:
            tensors = _trained_weights(model_cfg, tokenizer, config["eos_token_id"], training, seed, tmp)
            tensors = {name: t.to(dtype) for name, t in tensors.items()}
        save_sharded(tensors, tmp, max_shard_bytes)
        if out.exists():  # someone else finished first; theirs is byte-identical
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded tensors named as in HF (Qwen3-MoE, Qwen3, Llama, DeepSeek-V3); each has its own seed from its
    name."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[tuple[int, ...], float]] = {
        "model.embed_tokens.weight": ((cfg.vocab_size, h), 1.0),
        "model.norm.weight": ((h,), 0.0),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = ((cfg.vocab_size, h), 4.0 / h**0.5)  # peaked logits, few near-ties
    for i in range(cfg.num_layers):
        shapes |= _layer_shapes(cfg, i, f"model.layers.{i}.")
    if cfg.num_mtp_layers:  # DeepSeek's MTP module, as its checkpoints name it (embed and head: the model's)
        p = f"model.layers.{cfg.num_layers}."
        shapes |= _layer_shapes(cfg, cfg.num_layers, p)
        shapes |= {p + n: ((h,), 0.0) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
        shapes[p + "eh_proj.weight"] = ((h, 2 * h), 0.02)
    return {name: _seeded(name, shape, std, seed).to(dtype) for name, (shape, std) in shapes.items()}


def _layer_shapes(cfg: ModelConfig, i: int, p: str) -> dict[str, tuple[tuple[int, ...], float]]:
    """Decoder layer `i`'s tensors (HF names under `p`, shapes, std)."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[tuple[int, ...], float]] = {}
    shapes |= {
        p + "input_layernorm.weight": ((h,), 0.0),
        p + "post_attention_layernorm.weight": ((h,), 0.0),
    }
    if cfg.mla:
        shapes |= _latent_attention_shapes(cfg, p + "self_attn.")
    else:
        shapes |= {
            p + "self_attn.q_proj.weight": ((cfg.q_size, h), 0.02),
            p + "self_attn.k_proj.weight": ((cfg.kv_size, h), 0.02),
            p + "self_attn.v_proj.weight": ((cfg.kv_size, h), 0.02),
            p + "self_attn.o_proj.weight": ((h, cfg.q_size), 0.02),
        }
    if cfg.qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = ((d,), 0.0)
        shapes[p + "self_attn.k_norm.weight"] = ((d,), 0.0)
    if cfg.is_moe_layer(i):
        inter = cfg.moe_intermediate_size
        shapes[p + "mlp.gate.weight"] = ((cfg.num_experts, h), 1.0 / h**0.5)
        for e in range(cfg.num_experts):
            q = f"{p}mlp.experts.{e}."
            shapes |= {
                q + "gate_proj.weight": ((inter, h), 0.02),
                q + "up_proj.weight": ((inter, h), 0.02),
                q + "down_proj.weight": ((h, inter), 0.02),
            }
        if cfg.sigmoid_routing:  # a correction bias that changes some choices
            shapes[p + "mlp.gate.e_score_correction_bias"] = ((cfg.num_experts,), 0.1)
        if cfg.n_shared_experts:
            q, shared = p + "mlp.shared_experts.", inter * cfg.n_shared_experts
            shapes |= {
                q + "gate_proj.weight": ((shared, h), 0.02),
                q + "up_proj.weight": ((shared, h), 0.02),
                q + "down_proj.weight": ((h, shared), 0.02),
            }
    else:
        inter = cfg.intermediate_size
        shapes |= {
            p + "mlp.gate_proj.weight": ((inter, h), 0.02),
            p + "mlp.up_proj.weight": ((inter, h), 0.02),
            p + "mlp.down_proj.weight": ((h, inter), 0.02),
        }
    return shapes


def _latent_attention_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[tuple[int, ...], float]]:
    """DeepSeek-V3's attention tensors (HF names, shapes, std)."""
    h, heads = cfg.hidden_size, cfg.num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    shapes = {
        p + "kv_a_proj_with_mqa.weight": ((cfg.kv_lora_rank + cfg.qk_rope_head_dim, h), 0.02),
        p + "kv_a_layernorm.weight": ((cfg.kv_lora_rank,), 0.0),
        p + "kv_b_proj.weight": ((heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), 0.05),
        p + "o_proj.weight": ((h, heads * cfg.v_head_dim), 0.02),
    }
    if cfg.q_lora_rank:
        shapes |= {
            p + "q_a_proj.weight": ((cfg.q_lora_rank, h), 0.02),
            p + "q_a_layernorm.weight": ((cfg.q_lora_rank,), 0.0),
            p + "q_b_proj.weight": ((heads * qk, cfg.q_lora_rank), 0.05),
        }
    else:
        shapes[p + "q_proj.weight"] = ((heads * qk, h), 0.02)
    return shapes


def _trained_weights(cfg: ModelConfig, tokenizer, eos_id: int, training: dict, seed: int, out: Path):
    from kvferry.model.train import TrainConfig, train_weights  # training is off the serving path

    init = random_weights(cfg, seed, torch.float32)
    # logits near zero at the start (the seeded models' lm_head is scaled for peaked logits)
    init["lm_head.weight"] = _seeded("lm_head.weight", tuple(init["lm_head.weight"].shape), 0.02, seed)
    print("training the model on the Python standard library (once; then cached)", file=sys.stderr)
    tensors, record = train_weights(cfg, init, tokenizer, eos_id, TrainConfig.from_dict(training), seed)
    _write_json(out / "training.json", record)
    return tensors


def _seeded(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    if std == 0.0:  # norm weights start at one, as in HF
        return torch.ones(shape)
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return torch.randn(shape, generator=gen) * std


def save_sharded(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name].contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def train_tokenizer(vocab_size: int):
    """Byte-level BPE trained on the Python standard library sources (sorted, first CORPUS_BYTES bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def _corpus():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    budget = CORPUS_BYTES
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        yield from text.splitlines(keepends=True)
        budget -= len(text)
        if budget <= 0:
            return
    if budget == CORPUS_BYTES:
        print("warning: no Python standard library sources found for the tokenizer corpus", file=sys.stderr)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
