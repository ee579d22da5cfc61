"""What logprobs and a structured output cost a decode step, against plain sampling in the same run.

A batch of 16 requests decodes on the engine (the bench model, the dtype `auto` picks); the steps where
all 16 decode are timed. Three settings, interleaved over --rounds so drift hits each alike:
- plain: greedy, nothing asked;
- logprobs: greedy with the top 5 logprobs of every token;
- json: temperature 1 under a JSON schema (llguidance: a mask per row per step), against `sampled`,
  temperature 1 without one (the fair baseline: a constraint's cost is the mask, not the draw).
The overheads are (setting - its baseline) / baseline step time; the issue's target is <= 10% each at
batch 16. Last line: one JSON object (CPU flags included).

    python bench/sampling_overhead.py [--model bench] [--batch 16] [--tokens 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, full_batch_step_ms, print_result, reported_cpu_flags

from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.engine.request import SamplingParams
from kvferry.model.config import cpu_has_native_bf16

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}

SETTINGS = {
    "plain": {"temperature": 0.0},
    "logprobs": {"temperature": 0.0, "logprobs": 5},
    "sampled": {"temperature": 1.0},
    "json": {"temperature": 1.0, "structured": ("json_schema", json.dumps(SCHEMA))},
}


def decode_step_ms(engine: LLMEngine, batch: int, tokens: int, settings: dict, seed: int) -> float:
    """Median time of the steps in which every request of the batch decodes."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model.cfg.vocab_size
    requests = [
        (
            SamplingParams(max_tokens=tokens, ignore_eos=True, seed=seed * 1000 + i, **settings),
            torch.randint(10, vocab, (64,), generator=gen).tolist(),
        )
        for i in range(batch)
    ]
    return full_batch_step_ms(engine, requests)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    engine = LLMEngine(
        EngineConfig(model=str(bench_model_dir(args.model)), dtype=args.dtype, max_model_len=512)
    )
    engine.grammars.check(*SETTINGS["json"]["structured"])  # compiled once, before the clock
    decode_step_ms(engine, args.batch, 4, SETTINGS["plain"], 0)  # warm-up
    runs: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name, settings in SETTINGS.items():
            runs[name].append(decode_step_ms(engine, args.batch, args.tokens, settings, seed=r + 1))
            print(f"round {r + 1} {name}: {runs[name][-1]:.2f} ms/step", file=sys.stderr, flush=True)
    best = {name: min(values) for name, values in runs.items()}
    result = {
        "bench": "sampling_overhead",
        "model": args.model,
        "dtype": str(engine.dtype),
        "kernels": engine.kernel_backend,
        "cpu_flags": reported_cpu_flags(),
        "native_bf16": cpu_has_native_bf16(),
        "batch": args.batch,
        "step_ms": {name: round(v, 3) for name, v in best.items()},
        "logprobs_top5_overhead": round(best["logprobs"] / best["plain"] - 1, 4),
        "json_schema_overhead": round(best["json"] / best["sampled"] - 1, 4),
        "target": 0.10,
    }
    print_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
