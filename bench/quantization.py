"""int8 weights (`--quantization int8`) against the default dtype, in the same run: the prefill of a
256-token prompt and a decode step at batch 1 and 16, on the bench model through the engine; and with an
int8 KV cache too (`--kv-cache-dtype int8`), with the bytes the pool holds for one prompt's KV.

Three engines on one process (the dtype `auto` picks: bfloat16 where the CPU has AVX512-BF16, else
float32; the same with int8 weights; and with int8 weights and KV), settings interleaved over --rounds,
best of each. The prefill is one
engine step on a fresh 256-token prompt (no prefix hit: every prompt is new); a decode step is a step in
which every request of the batch decodes one token.

--isa avx2 runs the whole measurement again in a child process that sees this CPU as AVX2-only
(KVFERRY_CPU_ISA=avx2 for kvferry's kernels and dtype choice, ATEN_CPU_CAPABILITY=avx2 for torch's):
float32 by default, the AVX2 int8 loop, which is how an AVX2-only host is stood in for on an AVX-512 one.
Last line(s): one JSON object per ISA.

    python bench/quantization.py [--model bench] [--prompt-len 256] [--rounds 5] [--isa native,avx2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, full_batch_step_ms, print_result, reported_cpu_flags

from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.engine.request import SamplingParams
from kvferry.kernels import cpu
from kvferry.kvpool.transfer import BlockLayout


def prefill_ms(engine: LLMEngine, prompt_len: int, gen: torch.Generator) -> float:
    vocab = engine.model.cfg.vocab_size
    prompt = torch.randint(10, vocab, (prompt_len,), generator=gen).tolist()
    engine.add_request(params=SamplingParams(max_tokens=1, ignore_eos=True), prompt_token_ids=prompt)
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - t) * 1e3


def decode_step_ms(engine: LLMEngine, batch: int, tokens: int, gen: torch.Generator) -> float:
    """Median time of the steps in which every request of the batch decodes."""
    vocab = engine.model.cfg.vocab_size
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    prompts = [torch.randint(10, vocab, (64,), generator=gen).tolist() for _ in range(batch)]
    return full_batch_step_ms(engine, [(params, p) for p in prompts])


def measure(args) -> dict:
    model = str(bench_model_dir(args.model))
    settings = (("default", None, "auto"), ("int8", "int8", "auto"), ("int8_kv_int8", "int8", "int8"))
    engines = {
        name: LLMEngine(
            EngineConfig(
                model=model, dtype=args.dtype, max_model_len=1024, quantization=quant, kv_cache_dtype=kv
            )
        )
        for name, quant, kv in settings
    }
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, list[float]]] = {
        n: {"prefill": [], "decode_1": [], "decode_16": []} for n in engines
    }
    for engine in engines.values():  # warm-up: first calls allocate and fault in the weights
        prefill_ms(engine, args.prompt_len, gen)
        decode_step_ms(engine, 2, 4, gen)
    for r in range(args.rounds):
        for name, engine in engines.items():
            results[name]["prefill"].append(prefill_ms(engine, args.prompt_len, gen))
            results[name]["decode_1"].append(decode_step_ms(engine, 1, 24, gen))
            results[name]["decode_16"].append(decode_step_ms(engine, 16, 24, gen))
            print(
                f"round {r + 1} {name}: "
                + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in results[name].items()),
                file=sys.stderr,
                flush=True,
            )
    best = {name: {k: min(v) for k, v in runs.items()} for name, runs in results.items()}
    default = engines["default"]
    return {
        "bench": "quantization",
        "model": args.model,
        "cpu_flags": reported_cpu_flags(),
        "isa": os.environ.get(cpu.ISA_ENV) or "native",
        "kernels_isa": cpu.isa(),
        "int8_loop": "avx512_vnni" if cpu.int8_dot() else "avx2",
        "default_dtype": str(default.dtype),
        "kernels": default.kernel_backend,
        "prompt_len": args.prompt_len,
        "ms": {name: {k: round(v, 3) for k, v in b.items()} for name, b in best.items()},
        "prefill_speedup": round(best["default"]["prefill"] / best["int8"]["prefill"], 3),
        "decode_1_speedup": round(best["default"]["decode_1"] / best["int8"]["decode_1"], 3),
        "decode_16_speedup": round(best["default"]["decode_16"] / best["int8"]["decode_16"], 3),
        "target_prefill_speedup": 1.6,
        # what the pool stores (and a decode worker pulls) for one prompt's KV: its blocks in the layout
        "pool_bytes_per_prompt": {
            name: -(-args.prompt_len // e.cfg.block_size)
            * BlockLayout.for_model(e.model.cfg, e.cfg.block_size, e.kv_dtype).block_bytes
            for name, e in engines.items()
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--isa", default="native", help="comma-separated: native, avx2 (a child seeing AVX2 only)"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    for isa in args.isa.split(","):
        if isa == "native" or os.environ.get(cpu.ISA_ENV) == isa:
            print_result(measure(args), args.out)
            continue
        env = {**os.environ, cpu.ISA_ENV: isa, "ATEN_CPU_CAPABILITY": isa}
        argv = [
            sys.argv[0],
            "--model",
            args.model,
            "--dtype",
            args.dtype,
            "--prompt-len",
            str(args.prompt_len),
        ]
        argv += ["--rounds", str(args.rounds), "--isa", isa] + (["--out", str(args.out)] if args.out else [])
        rc = subprocess.call([sys.executable, *argv], env=env)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
