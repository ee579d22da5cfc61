"""Training a built-in Qwen3-MoE model on the standard library's training split (`corpus.py`).

The seeded models (`tiny`, `bench`) prove the arithmetic but say nothing about quality; a model that
has learned something is needed to judge what changes numerics or guesses tokens (int8 weights and KV,
speculative decoding). A spec with a `_train` block (`specs/trained.json`) is trained here when it is
created: next-token loss on random windows of the training split's token stream, AdamW with warm-up
and a cosine decay, Switch-style load balancing for the routers, a progress bar while it runs.

Not on the serving path: only `create.create_from_spec` imports this module, for a spec that asks for
training. The network here is a plain differentiable form of HF `Qwen3MoeForCausalLM` (the parameters
keep HF's names and are saved as they are); the serving runtime loads the result like any checkpoint.
Deterministic given the seed and thread count (`threads`, set for the run) on one kind of CPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvferry.model.config import ModelConfig
from kvferry.model.corpus import token_stream


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01  # the routers' load-balancing loss (Switch Transformer's)
    threads: int = 2
    eval_windows: int = 16  # held-out windows scored at the end (recorded in training.json)
    max_train_tokens: int | None = None  # read only the first this many tokens of the training split

    @classmethod
    def from_dict(cls, raw: dict) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"unknown training settings: {', '.join(sorted(unknown))}")
        return cls(**raw)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def moe(h: torch.Tensor, w: dict[str, torch.Tensor], p: str, cfg: ModelConfig):
    """Top-k routed experts over h [N, H] (HF's softmax-then-top-k, renormalised if norm_topk_prob);
    returns (output, the load-balancing loss)."""
    probs = (h @ w[p + "mlp.gate.weight"].T).softmax(-1)
    weights, chosen = probs.topk(cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for e in range(cfg.num_experts):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        q = f"{p}mlp.experts.{e}."
        x = h[rows]
        y = (F.silu(x @ w[q + "gate_proj.weight"].T) * (x @ w[q + "up_proj.weight"].T)) @ w[
            q + "down_proj.weight"
        ].T
        out = out.index_add(0, rows, y * weights[rows, slot].unsqueeze(-1))
    routed = F.one_hot(chosen, cfg.num_experts).sum((0, 1)).float() / chosen.numel()
    balance = cfg.num_experts * (routed * probs.mean(0)).sum()
    return out, balance


def forward(w: dict[str, torch.Tensor], cfg: ModelConfig, ids: torch.Tensor, rope) -> tuple:
    """Logits [B, T, V] of token ids [B, T], and the summed load-balancing loss."""
    b, t = ids.shape
    hq, hkv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    cos, sin = rope[0][:t], rope[1][:t]
    x = F.embedding(ids, w["model.embed_tokens.weight"])
    balance = x.new_zeros(())
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = rms_norm((h @ w[a + "q_proj.weight"].T).view(b, t, hq, d), w[a + "q_norm.weight"], eps)
        k = rms_norm((h @ w[a + "k_proj.weight"].T).view(b, t, hkv, d), w[a + "k_norm.weight"], eps)
        v = (h @ w[a + "v_proj.weight"].T).view(b, t, hkv, d)
        q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
        att = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=True)
        x = x + att.transpose(1, 2).reshape(b, t, hq * d) @ w[a + "o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if cfg.is_moe_layer(i):
            out, bal = moe(h.reshape(b * t, -1), w, p, cfg)
            x = x + out.view(b, t, -1)
            balance = balance + bal
        else:
            m = p + "mlp."
            x = (
                x
                + (F.silu(h @ w[m + "gate_proj.weight"].T) * (h @ w[m + "up_proj.weight"].T))
                @ w[m + "down_proj.weight"].T
            )
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])  # tied embeddings have no lm_head
    return x @ head.T, balance


def _lr(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    done = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done)))


def _windows(stream: torch.Tensor, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (count,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def heldout_loss(w, cfg: ModelConfig, stream: torch.Tensor, tc: TrainConfig, rope) -> float:
    """Mean next-token loss over the first `eval_windows` consecutive windows of the held-out stream."""
    span = tc.seq_len + 1
    count = min(tc.eval_windows, stream.numel() // span)
    if count == 0:
        return float("nan")
    batch = stream[: count * span].view(count, span)
    with torch.no_grad():
        logits, _ = forward(w, cfg, batch[:, :-1], rope)
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def train_weights(
    cfg: ModelConfig, init: dict[str, torch.Tensor], tokenizer, eos_id: int, tc: TrainConfig, seed: int
) -> tuple[dict[str, torch.Tensor], dict]:
    """Train `init` (float32 tensors in HF names) on the training split; returns the trained tensors and
    a record of the run (losses, tokens, wall time) for the checkpoint's training.json."""
    threads = torch.get_num_threads()
    torch.set_num_threads(tc.threads)
    try:
        return _train(cfg, init, tokenizer, eos_id, tc, seed)
    finally:
        torch.set_num_threads(threads)


def _train(cfg, init, tokenizer, eos_id, tc: TrainConfig, seed: int):
    t0 = time.perf_counter()
    train = torch.tensor(token_stream(tokenizer, "train", eos_id, tc.max_train_tokens), dtype=torch.long)
    heldout = torch.tensor(
        token_stream(tokenizer, "heldout", eos_id, max_tokens=tc.eval_windows * (tc.seq_len + 1)),
        dtype=torch.long,
    )
    w = {name: t.detach().float().clone().requires_grad_(True) for name, t in init.items()}
    decay = [t for t in w.values() if t.dim() == 2]
    no_decay = [t for t in w.values() if t.dim() != 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    gen = torch.Generator().manual_seed(seed)
    rope = rope_tables(cfg.head_dim, tc.seq_len, cfg.rope_theta)
    losses = []
    bar = tqdm(range(tc.steps), desc="training", unit="step", leave=False)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr(step, tc)
        batch = _windows(train, tc.batch_size, tc.seq_len + 1, gen)
        logits, balance = forward(w, cfg, batch[:, :-1], rope)
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        (loss + tc.aux_loss_coef * balance).backward()
        torch.nn.utils.clip_grad_norm_(list(w.values()), tc.grad_clip, foreach=False)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", refresh=False)
    bar.close()
    trained = {name: t.detach() for name, t in w.items()}
    record = {
        "steps": tc.steps,
        "batch_size": tc.batch_size,
        "seq_len": tc.seq_len,
        "threads": tc.threads,
        "seed": seed,
        "train_tokens": train.numel(),
        "tokens_seen": tc.steps * tc.batch_size * tc.seq_len,
        "first_loss": round(losses[0], 4) if losses else None,
        "final_train_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4),
        "heldout_loss": round(heldout_loss(trained, cfg, heldout, tc, rope), 4),
        "train_seconds": round(time.perf_counter() - t0, 1),
    }
    return trained, record
