"""Where a prefill step's time goes: one 256-token prompt through the engine under torch's profiler.

The bench model (the dtype `auto` picks, or --dtype; --quantization int8 for int8 weights), one engine
in this process: a warm-up prefill, then --rounds prefills of fresh prompts, each a single engine step,
timed plainly (best and median) and once more under `torch.profiler` (CPU activities). The profiled
step's self time is grouped by what the op does:

- dense projections: QKV, O and the LM head (`kvferry_cpu::packed_linear`, `aten::linear`/`mm`/`addmm`);
- MoE experts and routing (`kvferry_cpu::moe_experts`, the router's softmax/top-k);
- attention (`kvferry_cpu::prefill_attention`, sdpa), norms/RoPE/KV store;
- the engine's own Python (scheduling, block tables, sampling): the step's wall time not inside any op.

Prints the table (ms and share of the step) on stderr; last line: one JSON object with each group's
ms, the plain step times and the CPU flags.

    python bench/prefill_profile.py [--model bench] [--prompt-len 256] [--rounds 5] [--quantization int8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result, reported_cpu_flags

from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.engine.request import SamplingParams
from kvferry.kernels import cpu

# (group, substrings of the op's name); the first group that matches takes the op
GROUPS = (
    ("dense projections", ("packed_linear", "aten::linear", "aten::mm", "aten::addmm", "aten::matmul")),
    ("MoE experts", ("moe_experts", "moe_chunk", "aten::topk", "aten::softmax", "aten::bmm")),
    ("attention", ("prefill_attention", "paged", "scaled_dot_product", "attention")),
    ("norms, RoPE, KV store", ("rms_norm", "qk_norm_rope", "rope", "aten::pow", "aten::rsqrt")),
    ("sampling", ("argmax", "sample", "aten::sort", "multinomial")),
)


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(key in name for key in keys):
            return group
    return "other ops"


def one_prefill(engine: LLMEngine, prompt: list[int]) -> float:
    engine.add_request(params=SamplingParams(max_tokens=1, ignore_eos=True), prompt_token_ids=prompt)
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=["int8"])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    cfg = EngineConfig(
        model=str(bench_model_dir(args.model)),
        dtype=args.dtype,
        max_model_len=max(1024, args.prompt_len + 16),
        max_num_batched_tokens=max(512, args.prompt_len),
        quantization=args.quantization,
    )
    engine = LLMEngine(cfg)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.cfg.vocab_size

    def fresh() -> list[int]:
        return torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist()

    one_prefill(engine, fresh())  # warm-up: first-use allocations, kernel dispatch
    plain = [one_prefill(engine, fresh()) for _ in range(args.rounds)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = one_prefill(engine, fresh())
    self_ms: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        self_ms[group_of(event.key)] += event.self_cpu_time_total / 1e3
    in_ops = sum(self_ms.values())
    # the profiler sums the self time of every thread; the engine thread's wall time is the step's
    scale = min(1.0, profiled / in_ops) if in_ops else 1.0
    table = {group: ms * scale for group, ms in sorted(self_ms.items(), key=lambda kv: -kv[1])}
    table["engine Python (outside ops)"] = max(0.0, profiled - in_ops * scale)
    print(f"prefill of {args.prompt_len} tokens, profiled step {profiled:.1f} ms:", file=sys.stderr)
    for group, ms in table.items():
        print(f"  {group:<30} {ms:8.2f} ms  {100 * ms / profiled:5.1f}%", file=sys.stderr)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    print("top ops by self time:", file=sys.stderr)
    for event in top:
        print(f"  {event.key:<45} {event.self_cpu_time_total / 1e3:8.2f} ms x{event.count}", file=sys.stderr)
    print_result(
        {
            "bench": "prefill_profile",
            "model": args.model,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": args.quantization,
            "kernels": engine.kernel_backend,
            "isa": cpu.isa() if cpu.supported() else "none",
            "cpu_flags": reported_cpu_flags(),
            "threads": torch.get_num_threads(),
            "prompt_len": args.prompt_len,
            "prefill_ms_best": round(min(plain), 2),
            "prefill_ms_median": round(statistics.median(plain), 2),
            "profiled_ms": round(profiled, 2),
            "profile_ms": {group: round(ms, 2) for group, ms in table.items()},
            "top_ops_ms": {e.key: round(e.self_cpu_time_total / 1e3, 2) for e in top},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
