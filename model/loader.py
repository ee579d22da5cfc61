"""Load a Hugging Face checkpoint directory of an architecture kvferry serves (`config.ARCHITECTURES`;
single-file or sharded safetensors)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvferry.model.config import ModelConfig, ModelConfigError
from kvferry.model.parallel import Parallel, ParallelConfigError, TPShard, check_ep, check_tp, expert_range
from kvferry.model.qwen3_moe import Qwen3MoeModel, rotary_of

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# parameters stored [in, out]: the transpose of HF's [out, in] nn.Linear weights
_INPUT_MAJOR = {"qkv", "o", "w13", "w2", "router", "lm_head", "q", "q_a", "q_b", "kv_a", "kv_b", "eh_proj"}
_FLOAT32 = {"e_bias"}  # kept in float32 whatever the dtype (as transformers keeps DeepSeek's)


class CheckpointReader:
    """Reads tensors by HF name from `model.safetensors` or the shards named in its index."""

    def __init__(self, model_dir: Path):
        index = model_dir / INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (model_dir / "model.safetensors").is_file():
            with safe_open(model_dir / "model.safetensors", framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise ModelConfigError(f"{model_dir} has neither model.safetensors nor {INDEX_FILE}")
        self.weight_map = weight_map
        self._files = {name: safe_open(model_dir / name, framework="pt") for name in set(weight_map.values())}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ModelConfigError(f"checkpoint has no tensor {name!r}")
        return self._files[self.weight_map[name]].get_tensor(name)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    parallel: Parallel | None = None,
) -> Qwen3MoeModel:
    """Load the checkpoint; with `parallel`, only this rank's shard of each tensor is materialised."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    parallel = parallel or Parallel.single()
    check_tp(cfg, parallel.tp_size)
    check_ep(cfg, parallel.ep_size)
    if parallel.tp_size > 1 and parallel.ep_size > 1:
        raise ParallelConfigError("a group is either tensor-parallel or expert-parallel, not both")
    reader = CheckpointReader(model_dir)
    # parameters start on the meta device and are materialised one at a time, straight in the target
    # dtype and device: peak memory is the model plus one tensor, not a float32 copy of everything
    with torch.device("meta"):
        model = Qwen3MoeModel(cfg, max_positions, parallel)
    model.rotary = rotary_of(cfg, max_positions)  # (real tables: the meta device held none)
    model.rotary.to(device)
    params = dict(model.named_parameters())
    split = _Split(cfg, parallel)
    for name, build in _weight_plan(cfg, reader).items():
        target = params.pop(name)
        leaf = name.split(".")[-1]
        tensor = split(name, build()).to(torch.float32 if leaf in _FLOAT32 else dtype)
        if leaf in _INPUT_MAJOR:
            tensor = tensor.mT
        if tensor.shape != target.shape:
            raise ModelConfigError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        owner._parameters[attr] = nn.Parameter(tensor.to(device).contiguous(), requires_grad=False)
    if params:
        raise ModelConfigError(f"no checkpoint tensors for {sorted(params)[:4]}")
    return model.eval()


class _Split:
    """This rank's part of a full HF-layout tensor (out-major, before the [in, out] transpose)."""

    def __init__(self, cfg: ModelConfig, parallel: Parallel):
        tp = parallel.tp
        self.cfg, self.tp_size, self.ep = cfg, tp.size, parallel.ep
        self.shard = TPShard(tp.rank, tp.size, cfg.num_heads, cfg.num_kv_heads)

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        leaf = name.split(".")[-1]
        ep_split = self.ep.size > 1 and not name.startswith("mtp.")  # (the MTP layer's experts: whole)
        if ep_split and leaf in ("w13", "w2") and t.dim() == 3:  # experts: this rank's range
            experts = expert_range(t.shape[0], self.ep.size, self.ep.rank)
            return t[experts.start : experts.stop]
        if self.tp_size == 1:
            return t
        s, cfg = self.shard, self.cfg
        if cfg.mla and leaf in ("q", "q_b", "kv_b", "o"):  # latent attention: by head
            heads = s.heads
            per = {"q": cfg.head_dim, "q_b": cfg.head_dim, "kv_b": cfg.qk_nope_head_dim + cfg.v_head_dim}
            if leaf == "o":
                return t[:, heads.start * cfg.v_head_dim : heads.stop * cfg.v_head_dim]
            return t[heads.start * per[leaf] : heads.stop * per[leaf]]
        if leaf in ("embed", "lm_head"):  # vocab rows, padded to an equal share per rank
            first, rows = s.vocab(cfg.vocab_size)
            part = t[first : first + rows]
            if part.shape[0] < rows:
                part = torch.cat((part, part.new_zeros(rows - part.shape[0], t.shape[1])))
            return part
        d = cfg.head_dim
        if leaf == "qkv":
            q, k, v = t.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            heads, kv = s.heads, s.kv_heads
            return torch.cat(
                (
                    q[heads.start * d : heads.stop * d],
                    k[kv.start * d : kv.stop * d],
                    v[kv.start * d : kv.stop * d],
                )
            )
        if leaf == "o":
            return t[:, s.heads.start * d : s.heads.stop * d]
        if leaf == "w13":  # [.., 2I, H]: gate rows then up rows, each split the same way
            gate, up = t.chunk(2, dim=-2)
            cols = s.columns(gate.shape[-2])
            return torch.cat((gate[..., cols, :], up[..., cols, :]), dim=-2)
        if leaf == "w2":  # [.., H, I]
            return t[..., s.columns(t.shape[-1])]
        return t  # norms, router: replicated


def _weight_plan(cfg: ModelConfig, r: CheckpointReader) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter name -> how to build it from HF tensors (fusing q/k/v, gate/up and experts)."""
    plan: dict[str, Callable[[], torch.Tensor]] = {
        "embed": lambda: r.get("model.embed_tokens.weight"),
        "norm.weight": lambda: r.get("model.norm.weight"),
        "lm_head": lambda: r.get(
            "model.embed_tokens.weight"
            if cfg.tie_word_embeddings or "lm_head.weight" not in r
            else "lm_head.weight"
        ),
    }
    for i in range(cfg.num_layers):
        plan |= _layer_plan(cfg, r, i, f"model.layers.{i}.", f"layers.{i}.")
    if (
        cfg.num_mtp_layers
    ):  # DeepSeek's MTP module: the layer after the last (its embed / head are the model's)
        hf = f"model.layers.{cfg.num_layers}."
        plan |= _layer_plan(cfg, r, cfg.num_layers, hf, "mtp.block.")
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("head_norm", "shared_head.norm")):
            plan[f"mtp.{ours}.weight"] = lambda n=theirs: r.get(f"{hf}{n}.weight")
        plan["mtp.eh_proj"] = lambda: r.get(hf + "eh_proj.weight")
    return plan


def _layer_plan(
    cfg: ModelConfig, r: CheckpointReader, i: int, hf: str, ours: str
) -> dict[str, Callable[[], torch.Tensor]]:
    """Decoder layer `i`'s parameters (ours prefixed `ours`) from the HF tensors prefixed `hf`."""
    plan: dict[str, Callable[[], torch.Tensor]] = {}
    attn = hf + "self_attn."
    plan[ours + "input_norm.weight"] = lambda p=hf: r.get(p + "input_layernorm.weight")
    plan[ours + "post_attn_norm.weight"] = lambda p=hf: r.get(p + "post_attention_layernorm.weight")
    plan[ours + "attn.o"] = lambda p=attn: r.get(p + "o_proj.weight")
    if cfg.mla:
        plan |= _latent_attention_plan(cfg, r, attn, ours + "attn.")
    else:
        plan[ours + "attn.qkv"] = lambda p=attn: torch.cat([r.get(p + f"{n}_proj.weight") for n in "qkv"])
    if cfg.qk_norm:
        plan[ours + "attn.q_norm.weight"] = lambda p=attn: r.get(p + "q_norm.weight")
        plan[ours + "attn.k_norm.weight"] = lambda p=attn: r.get(p + "k_norm.weight")
    mlp = hf + "mlp."
    if cfg.is_moe_layer(i):
        plan[ours + "mlp.router"] = lambda p=mlp: r.get(p + "gate.weight")
        plan[ours + "mlp.w13"] = lambda p=mlp: _experts_w13(r, p, cfg.num_experts)
        plan[ours + "mlp.w2"] = lambda p=mlp: _experts_w2(r, p, cfg.num_experts)
        if cfg.sigmoid_routing:
            plan[ours + "mlp.e_bias"] = lambda p=mlp: r.get(p + "gate.e_score_correction_bias")
        if cfg.n_shared_experts:
            shared = mlp + "shared_experts."
            plan[ours + "mlp.shared.w13"] = lambda p=shared: torch.cat(
                [r.get(p + "gate_proj.weight"), r.get(p + "up_proj.weight")]
            )
            plan[ours + "mlp.shared.w2"] = lambda p=shared: r.get(p + "down_proj.weight")
    else:
        plan[ours + "mlp.w13"] = lambda p=mlp: torch.cat(
            [r.get(p + "gate_proj.weight"), r.get(p + "up_proj.weight")]
        )
        plan[ours + "mlp.w2"] = lambda p=mlp: r.get(p + "down_proj.weight")
    return plan


def _latent_attention_plan(
    cfg: ModelConfig, r: CheckpointReader, hf: str, ours: str
) -> dict[str, Callable[[], torch.Tensor]]:
    """DeepSeek-V3's attention tensors. Where the checkpoint interleaves its rope dimensions
    (`rope_interleave`, DeepSeek's own layout), the rows that make q's and the latent's rope parts are
    put in rotate-half order here, once: the rotation is then the one every other model uses, with the
    same result."""
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))

    def q_rows(t: torch.Tensor) -> torch.Tensor:  # [H * (nope + rope), in]
        if not cfg.rope_interleave:
            return t
        heads = t.view(cfg.num_heads, nope + rope, -1)
        return torch.cat((heads[:, :nope], heads[:, nope:][:, order]), dim=1).view_as(t)

    def latent_rows(t: torch.Tensor) -> torch.Tensor:  # [rank + rope, in]
        if not cfg.rope_interleave:
            return t
        return torch.cat((t[: cfg.kv_lora_rank], t[cfg.kv_lora_rank :][order]))

    plan: dict[str, Callable[[], torch.Tensor]] = {
        ours + "kv_a": lambda: latent_rows(r.get(hf + "kv_a_proj_with_mqa.weight")),
        ours + "kv_a_norm.weight": lambda: r.get(hf + "kv_a_layernorm.weight"),
        ours + "kv_b": lambda: r.get(hf + "kv_b_proj.weight"),
    }
    if cfg.q_lora_rank:
        plan[ours + "q_a"] = lambda: r.get(hf + "q_a_proj.weight")
        plan[ours + "q_a_norm.weight"] = lambda: r.get(hf + "q_a_layernorm.weight")
        plan[ours + "q_b"] = lambda: q_rows(r.get(hf + "q_b_proj.weight"))
    else:
        plan[ours + "q"] = lambda: q_rows(r.get(hf + "q_proj.weight"))
    return plan


def _experts_w13(r: CheckpointReader, prefix: str, num_experts: int) -> torch.Tensor:
    """[E, 2I, H] from per-expert gate/up (original HF layout) or a fused `experts.gate_up_proj`."""
    if prefix + "experts.gate_up_proj" in r:
        return r.get(prefix + "experts.gate_up_proj")
    return torch.stack(
        [
            torch.cat(
                [r.get(f"{prefix}experts.{e}.gate_proj.weight"), r.get(f"{prefix}experts.{e}.up_proj.weight")]
            )
            for e in range(num_experts)
        ]
    )


def _experts_w2(r: CheckpointReader, prefix: str, num_experts: int) -> torch.Tensor:
    if prefix + "experts.down_proj" in r:
        return r.get(prefix + "experts.down_proj")
    return torch.stack([r.get(f"{prefix}experts.{e}.down_proj.weight") for e in range(num_experts)])


DIGEST_CACHE = ".kvferry-digest.json"  # beside the checkpoint: the full-content hash, once per content
_HASH_CHUNK = 8 << 20


def checkpoint_digest(model_dir: Path) -> str:
    """The checkpoint's content identity, stable across processes and hosts (hex): a hash of config.json
    and every byte of every safetensors file (names included).

    Hashing every byte is what makes two checkpoints with the same shapes but different weights (another
    seed, a fine-tune that touched only middle tensors) never share KV blocks. It costs one read of the
    weights, once: the result is cached beside the checkpoint in `DIGEST_CACHE`, keyed by each file's
    size and modification time, so later loads (every worker of the cluster) only stat the files. The
    first process to hash takes a lock on the cache; the others wait for its result. A read-only model
    directory is hashed at every load (logged).
    """
    import fcntl

    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    cache = model_dir / DIGEST_CACHE
    try:
        lock = open(model_dir / (DIGEST_CACHE + ".lock"), "a+")  # noqa: SIM115 (held until the end)
    except OSError:
        log.warning("model directory %s is read-only: hashing its weights at every load", model_dir)
        return _hash_files(files)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process hashes; the others read its result
        try:
            cached = json.loads(cache.read_text())
            if cached.get("files") == stamp:
                return str(cached["digest"])
        except (OSError, ValueError, KeyError, AttributeError):
            pass
        digest = _hash_files(files)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"digest": digest, "files": stamp}))
            os.replace(tmp, cache)
        except OSError as err:
            log.warning("cannot cache the checkpoint digest in %s: %s", cache, err)
        return digest


def _hash_files(files: list[Path]) -> str:
    import hashlib

    from tqdm import tqdm

    h = hashlib.blake2b(digest_size=16)
    total = sum(p.stat().st_size for p in files)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="hashing checkpoint", disable=total < 1 << 30
    ) as bar:
        for path in files:
            h.update(f"{path.name}:{path.stat().st_size}".encode())
            with path.open("rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    h.update(chunk)
                    bar.update(len(chunk))
    return h.hexdigest()
