"""Held-out perplexity through the engine: the trained model in each numerics against the seeded one.

The `trained` built-in model (trained here on the standard library's training split; made on first use,
a few minutes) and the seeded `bench` model (same tokenizer, random weights) are scored on the same
held-out tokens (`kvferry eval`'s path: prompt logprobs in windows of --context tokens). Each engine
setting in --settings is one `dtype[:kernels][+int8][+kv-int8]` (e.g. `bfloat16`, `float32:torch`,
`bfloat16+int8`: int8 weights, `bfloat16+kv-int8`: an int8 KV cache); the JSON line has the perplexity
of each, their ratio to the first, and the seeded model's perplexity (what "learned something" is
measured against).

    python bench/perplexity.py [--settings bfloat16,bfloat16+int8,bfloat16+kv-int8,float32] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_result, reported_cpu_flags

from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.evaluate import heldout_tokens, perplexity


def score(model: str, setting: str, tokens: list[int] | None, args) -> tuple[dict, list[int]]:
    numerics, *extras = setting.split("+")
    dtype, _, kernels = numerics.partition(":")
    unknown = set(extras) - {"int8", "kv-int8"}
    if unknown:
        raise SystemExit(f"unknown setting part(s) {sorted(unknown)} in {setting!r}: use +int8, +kv-int8")
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=dtype,
            kernels=kernels or "auto",
            quantization="int8" if "int8" in extras else None,
            kv_cache_dtype="int8" if "kv-int8" in extras else "auto",
        )
    )
    tokens = tokens if tokens is not None else heldout_tokens(engine, args.tokens)
    result = perplexity(engine, tokens, args.context, progress=True)
    print(f"{model} {setting} ({engine.kernel_backend}): {result}", file=sys.stderr)
    return result, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="trained")
    ap.add_argument("--baseline-model", default="bench", help="the seeded model on the same tokenizer")
    ap.add_argument(
        "--settings",
        default="bfloat16,bfloat16+int8,bfloat16+kv-int8,bfloat16+int8+kv-int8,float32",
        help="comma-separated dtype[:kernels][+int8][+kv-int8]",
    )
    ap.add_argument("--tokens", type=int, default=32768, help="held-out tokens scored")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    settings = args.settings.split(",")
    result: dict = {"model": args.model, "cpu": reported_cpu_flags(), "context": args.context}
    tokens = None
    first = None
    for setting in settings:
        found, tokens = score(args.model, setting, tokens, args)
        first = first or found["perplexity"]
        result[f"{setting}_perplexity"] = found["perplexity"]
        result[f"{setting}_ratio"] = round(found["perplexity"] / first, 4)
    result["tokens_scored"] = found["tokens_scored"]
    seeded, _ = score(args.baseline_model, settings[0], tokens, args)
    result[f"{args.baseline_model}_seeded_perplexity"] = seeded["perplexity"]
    print_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
