"""`vllm bench serve`, vLLM's own load generator (a client nobody here wrote), against `kvferry up`.

Brings up `kvferry up` on the bench model (the OpenAI API on a free port) and runs
`vllm bench serve --backend openai` on its random dataset at --request-rate for --num-prompts requests;
then again with `--logprobs 5` on fresh prompts (another seed), against the same cluster in the same
run, so the cost of logprobs under vLLM's own load is the ratio of the two. vLLM's CLI comes from
--vllm (default: `vllm` on PATH; ../shared/peers/README.md says how to install its CPU build in a venv
of its own). Every request must complete; the last line is one JSON object with vLLM's figures
(request throughput, TTFT and TPOT medians) of each run.

    python bench/vllm_bench_serve.py --vllm $PEERS/venv-vllm/bin/vllm [--request-rate 4] [--num-prompts 100]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result, reported_cpu_flags, start_up, stop_up

KEEP = ("completed", "failed", "request_throughput", "output_throughput", "median_ttft_ms", "median_tpot_ms")


def bench_serve(vllm: str, url: str, model: Path, args, out: Path, seed: int, extra: list[str]) -> dict:
    """One `vllm bench serve` run (its own `seed`: fresh prompts, no prefix-cache hits from another run):
    its result JSON's headline figures."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [vllm, "bench", "serve", "--backend", "openai", "--base-url", url, "--model", str(model)]
    argv += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    argv += ["--random-output-len", str(args.output_len), "--request-rate", str(args.request_rate)]
    argv += [
        "--num-prompts",
        str(args.num_prompts),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
    ]
    argv += ["--save-result", "--result-dir", str(out), "--result-filename", "result.json", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
    print(done.stdout[-4000:], file=sys.stderr)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads((out / "result.json").read_text())
    return {k: result.get(k) for k in KEEP}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", default=shutil.which("vllm"), help="vLLM's CLI")
    ap.add_argument("--model", default="bench")
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not args.vllm:
        raise SystemExit(
            "no `vllm` CLI: pass --vllm (see ../shared/peers/README.md to install vLLM's CPU build)"
        )
    model = bench_model_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="kvferry-vllm-bench-") as work:
        work = Path(work)
        proc, url = start_up(sys.executable, str(model), work / "logs", "vllm-bench")
        try:
            plain = bench_serve(args.vllm, url, model, args, work / "plain", 1, [])
            logprobs = bench_serve(args.vllm, url, model, args, work / "logprobs", 2, ["--logprobs", "5"])
        finally:
            stop_up(proc)
    for name, run in (("plain", plain), ("logprobs", logprobs)):
        if run["completed"] != args.num_prompts or run["failed"]:
            raise SystemExit(
                f"{name}: {run['completed']} of {args.num_prompts} completed, {run['failed']} failed"
            )
    result = {
        "bench": "vllm_bench_serve",
        "model": args.model,
        "cpu_flags": reported_cpu_flags(),
        "request_rate": args.request_rate,
        "num_prompts": args.num_prompts,
        "plain": plain,
        "logprobs5": logprobs,
        "logprobs_tpot_ratio": round(logprobs["median_tpot_ms"] / plain["median_tpot_ms"], 3),
    }
    print_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
