"""Helpers shared by the benchmarks: the bench model, memcpy bandwidth, a JSON result line."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from kvferry.model.config import ModelConfig
from kvferry.model.create import resolve_model
from kvferry.settings import load_settings


def bench_model_dir(model: str = "bench") -> Path:
    return resolve_model(model, load_settings().models_dir)


def memcpy_gbps(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Best-of-N copy bandwidth, counting bytes read + written."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def weight_bytes_per_step(cfg: ModelConfig, batch: int, itemsize: int) -> int:
    """Bytes of weights one decode step at `batch` touches: every dense weight, the experts hit, lm_head.

    A batch of B tokens hits on average E * (1 - (1 - k/E)^B) experts per MoE layer.
    """
    h = cfg.hidden_size
    attn = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    total = cfg.vocab_size * h  # lm_head
    for layer in range(cfg.num_layers):
        total += attn
        if cfg.is_moe_layer(layer):
            e, k = cfg.num_experts, cfg.num_experts_per_tok
            hit = e * (1 - (1 - k / e) ** batch)
            total += e * h + hit * 3 * h * cfg.moe_intermediate_size
        else:
            total += 3 * h * cfg.intermediate_size
    return int(total * itemsize)


def print_result(result: dict, out: Path | None = None) -> None:
    line = json.dumps(result, sort_keys=False)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(line + "\n")
    print(line, flush=True)


def rank_threads(size: int) -> int:
    """Intra-op threads per rank when `size` rank processes share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // size)


def rank_run(kind: str, size: int, threads: int = 0) -> tuple[int, str]:
    """(threads per rank, label) of a run of `size` rank processes: `threads` or the fair share."""
    threads = threads or rank_threads(size)
    return threads, f"{kind}{size}" + ("" if threads == rank_threads(size) else f" ({threads} thread)")


def add_rank_bench_args(ap, reference: str) -> None:
    """The flags the rank-process benchmarks share; `reference` names the 1-thread run's figure."""
    ap.add_argument("--model", default="bench")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--no-reference", action="store_true", help=f"skip the size-1 run with 1 thread ({reference})"
    )
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds to wait for the rank processes")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")


def bench_model(args) -> tuple[Path, ModelConfig, torch.dtype]:
    """The --model checkpoint, its config and the --dtype it runs in on CPU."""
    from kvferry.model.config import resolve_dtype

    model_dir = bench_model_dir(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    return model_dir, cfg, resolve_dtype(args.dtype, cfg, torch.device("cpu"))


class Timed:
    """Wraps callables (collectives of a Comm, module forwards) on their instances: wall seconds, calls,
    and the bytes of the first tensor argument (a collective's payload)."""

    def __init__(self, owner_attrs):
        self.seconds, self.calls, self.bytes = 0.0, 0, 0
        for owner, name in owner_attrs:
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
                if args and isinstance(args[0], torch.Tensor):
                    self.bytes += args[0].numel() * args[0].element_size()

        return timed
