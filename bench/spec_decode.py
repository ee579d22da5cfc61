"""Speculative decoding at concurrency 1: TPOT with each proposer (n-gram prompt lookup, the draft model)
against without, in the same run.

The trained built-in model (made on first use) decodes greedy continuations of code from the held-out
split of the standard library sources (prompts of --prompt-len tokens, cut at file starts; each prompt
once per setting, settings interleaved). Reported per setting: TPOT (decode time per output token after
the first), the acceptance rate (accepted / proposed drafts) and the mean tokens per decode step; and
whether the greedy outputs are identical (they must be). Last line: one JSON object.

The draft model is the built-in `draft` (trained on first use, about a minute).

    python bench/spec_decode.py [--proposers ngram,draft] [--prompts 8] [--max-tokens 128] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_result, reported_cpu_flags

from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.engine.request import SamplingParams
from kvferry.model.corpus import corpus_files


def decode(engine: LLMEngine, ids: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """Greedy continuation of `ids`: (tokens, seconds after the first token, decode steps)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, first, steps = [], None, engine.num_steps
    for out in engine.stream(params=params, prompt_token_ids=ids):
        tokens += out.new_token_ids
        if first is None:
            first, steps = time.perf_counter(), engine.num_steps
    return tokens, time.perf_counter() - first, engine.num_steps - steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="trained")
    ap.add_argument("--draft-model", default="draft", help="the draft_model proposer's model")
    ap.add_argument("--proposers", default="ngram,draft", help="comma-separated: ngram, draft")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    configs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4},
        "draft": {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k},
    }
    names = ["plain", *args.proposers.split(",")]
    engines = {
        name: LLMEngine(
            EngineConfig(
                model=args.model,
                dtype=args.dtype,
                speculative_config=json.dumps(configs[name]) if name != "plain" else None,
            )
        )
        for name in names
    }
    tok = engines["plain"].tokenizer
    prompts = []
    for path in corpus_files("heldout"):
        ids = tok.encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= args.prompt_len:
            prompts.append(ids[: args.prompt_len])
        if len(prompts) == args.prompts:
            break
    for engine in engines.values():  # warm-up (first-call costs), not counted
        decode(engine, prompts[0], 8)
    tpot: dict[str, list[float]] = {name: [] for name in engines}
    per_step: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    start = {name: (e.spec_proposed, e.spec_accepted) for name, e in engines.items()}
    for ids in prompts:
        for name, engine in engines.items():
            tokens, seconds, steps = decode(engine, ids, args.max_tokens)
            outputs[name].append(tokens)
            tpot[name].append(seconds * 1e3 / (len(tokens) - 1))
            per_step[name].append((len(tokens) - 1) / max(1, steps))
        print(", ".join(f"{n} {tpot[n][-1]:.2f} ms" for n in names), file=sys.stderr)
    plain = engines["plain"]
    result = {
        "bench": "spec_decode",
        "model": args.model,
        "dtype": str(plain.dtype).removeprefix("torch."),
        "kernels": plain.kernel_backend,
        "cpu_flags": reported_cpu_flags(),
        "prompts": len(prompts),
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "k": args.k,
        "plain_tpot_ms": round(statistics.median(tpot["plain"]), 3),
    }
    for name in names[1:]:
        engine = engines[name]
        proposed = engine.spec_proposed - start[name][0]
        accepted = engine.spec_accepted - start[name][1]
        result[f"{name}_tpot_ms"] = round(statistics.median(tpot[name]), 3)
        result[f"{name}_tpot_speedup"] = round(
            statistics.median(tpot["plain"]) / statistics.median(tpot[name]), 3
        )
        result[f"{name}_acceptance_rate"] = round(accepted / max(1, proposed), 3)
        result[f"{name}_tokens_per_step"] = round(statistics.mean(per_step[name]), 3)
    result["identical_greedy"] = all(outputs[n] == outputs["plain"] for n in names[1:])
    print_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
