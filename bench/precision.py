"""Weight precision paths on this CPU: the matmuls of one decode step of the bench model at several row
counts, each way the weights can be stored and multiplied, against float32 `torch.mm` in the same run.

Paths: float32 `x @ w` (MKL/oneDNN), kvferry's packed float32 kernel, kvferry's packed kernel on
bf16-stored weights (widened exactly in registers: float32 products), on CPUs with AVX512-BF16 kvferry's
bf16 dot-product kernel (activations rounded to bf16, vdpbf16ps), torch bfloat16 `x @ w` (native
on CPUs with AVX512-BF16/AMX, emulated elsewhere), and torch's int8 weight-only kernel
(`_weight_int8pack_mm`, per-channel scales). The weights of all 8 layers (attention projections and
the two experts a token picks, plus lm_head) are distinct tensors, larger together than the cache, so
M=1 reads them from memory as decode does. Last line: one JSON object, ms per step and the speedup of
each path over float32 `torch.mm` per row count.

    python bench/precision.py [--rows 1,8,64,256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_result

from kvferry.kernels import cpu
from kvferry.model.layers import linear, pack

# [K, N] of the matmuls one decode step of the bench model runs: 8 x (qkv, o, 2 experts' w13 and w2), lm_head
SHAPES = [(512, 768), (512, 512), (512, 1024), (512, 512), (512, 1024), (512, 512)] * 8 + [(512, 8192)]


def int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of [K, N] -> ([N, K] int8, [N] scales), as the kernel wants."""
    scale = w.abs().amax(0).clamp(min=1e-8) / 127
    return (w / scale).round().clamp(-127, 127).to(torch.int8).t().contiguous(), scale


def paths(weights: list[torch.Tensor]) -> dict:
    out = {"float32 mm": (weights, lambda x, w: x @ w)}
    bf16 = [w.bfloat16() for w in weights]
    out["bfloat16 mm"] = (bf16, lambda x, w: x.bfloat16() @ w)
    int8 = [int8_weight(w) for w in weights]
    out["int8 weight-only"] = (int8, lambda x, w: torch._weight_int8pack_mm(x, *w))
    if cpu.load():
        out["kvferry float32"] = ([pack(w) for w in weights], linear)
        out["kvferry bf16-stored"] = ([pack(w.bfloat16().float()) for w in weights], linear)
    if cpu.bf16_dot():
        out["kvferry bf16 dot"] = ([pack(w, bf16_dot=True) for w in weights], linear)
    return out


def step_ms(fn, weights, x: torch.Tensor, repeats: int) -> float:
    def run():
        for w in weights:  # every K is 512: the same activations feed each
            fn(x, w)

    run()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(k, n, generator=gen) * 0.05 for k, n in SHAPES]
    table = paths(weights)
    result = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 512, generator=gen)
        times = {name: step_ms(fn, ws, x, args.repeats) for name, (ws, fn) in table.items()}
        base = times["float32 mm"]
        result[f"m{rows}"] = {
            name: {"ms": round(ms, 3), "speedup": round(base / ms, 2)} for name, ms in times.items()
        }
        print(f"rows {rows}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()), file=sys.stderr)
    print_result(result)


if __name__ == "__main__":
    main()
