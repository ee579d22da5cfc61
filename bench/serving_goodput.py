"""Serving goodput, side by side in one run: kvferry disaggregated, kvferry colocated, and (with --vllm)
any OpenAI-compatible server, all measured by the same client over the same OpenAI HTTP API.

Brings up both kvferry clusters on this machine (`kvferry up` and `kvferry up --colocated`, each with
the launcher's thread placement), then for every target:
- c1: `--c1-requests` requests one at a time (streamed, greedy, ignore_eos): TTFT and TPOT medians;
- a `kvferry loadtest sweep` over `--rates` (open-loop Poisson arrivals, locust), SLO attainment and
  goodput (the highest rate with >= 90% of requests meeting both SLOs, interpolated).
OUT gets the sweep's summary.json, sweep.csv, attainment.png and latency.png with every target on
the same plots. Last line: one JSON object with each goodput, the ratios, and each c1 TPOT.

    python bench/serving_goodput.py [--vllm http://127.0.0.1:8100] [--rates 1,2,3,4,5] [--prefill-replicas N]
                                    [--quantization int8] [--kv-cache-dtype int8] [--isa avx2]
                                    [--baseline REV] [--out DIR]

`--baseline REV` brings up commit REV's disaggregated cluster too (a git worktree in its own venv) and
sweeps it as `before`, in the same run: `kvferry_vs_before` is this checkout's goodput over REV's.

`../shared/peers/README.md` says how vLLM's CPU wheel installs and starts beside kvferry.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    baseline_python,
    bench_model_dir,
    print_result,
    remove_worktree,
    reported_cpu_flags,
    start_up,
    stop_up,
)

from kvferry.deploy.config import ClusterConfig
from kvferry.deploy.local import LocalCluster
from kvferry.kernels.cpu import ISA_ENV
from kvferry.loadtest.sweep import add_sweep_args, run_sweep
from kvferry.router.config import RouterConfig


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


PHASES = ("queue_ms", "prefill_ms", "kv_transfer_ms", "first_decode_ms")  # kvferry's timings (TTFT's parts)


def stream_times(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float], dict]:
    """One streamed greedy completion (ignore_eos): when it was sent, when each token with text arrived
    (perf_counter seconds), and the server's per-phase timings where it sends them (kvferry: the last
    chunk's `timings`; {} for other servers)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    body |= {"temperature": 0, "stream": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    sent, times, phases = time.perf_counter(), [], {}
    with urllib.request.urlopen(request, timeout=300) as resp:
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
            phases = chunk.get("timings") or phases
    return sent, times, phases


def c1(url: str, input_len: int, output_len: int, requests: int) -> dict:
    """Requests one at a time, each a fresh prompt (no prefix-cache hits): TTFT and TPOT medians in ms
    (the first request is a warm-up, not counted), and where the server reports them (kvferry), the
    medians of TTFT's parts: queue, prefill, KV transfer, first decode step."""
    model = served_model(url)
    gen = torch.Generator().manual_seed(1234)
    ttfts, tpots, parts = [], [], {name: [] for name in PHASES}
    for i in range(requests + 1):
        prompt = torch.randint(100, 4000, (input_len,), generator=gen).tolist()
        sent, times, phases = stream_times(url, model, prompt, output_len)
        if i and len(times) > 1:
            ttfts.append((times[0] - sent) * 1e3)
            tpots.append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
            for name in PHASES:
                if name in phases:
                    parts[name].append(phases[name])
    out = {"ttft_ms": round(statistics.median(ttfts), 1), "tpot_ms": round(statistics.median(tpots), 2)}
    return out | {name: round(statistics.median(v), 1) for name, v in parts.items() if v}


def start(
    model: str, colocated: bool, log_dir: Path, prefill_replicas: int = 1, engine: dict | None = None
) -> LocalCluster:
    """`engine`: engine flags for every group (`kvferry up --quantization` / `--kv-cache-dtype`)."""
    router = RouterConfig(port=0, http_port=0)
    namespace = "colocated" if colocated else "disagg"
    cfg = ClusterConfig(model=model, namespace=namespace, router=router, colocated=colocated)
    cfg = cfg.with_overrides(**(engine or {}))
    if not colocated:
        cfg = replace(cfg, prefill=replace(cfg.groups("prefill")[0], replicas=prefill_replicas))
    cluster = LocalCluster(cfg, log_dir=log_dir, quiet=True)
    cluster.start()
    return cluster


def start_baseline(rev: str, model: str, work: Path, log_dir: Path) -> tuple[subprocess.Popen, str]:
    """`kvferry up` of commit `rev` (its own venv over this one's packages, bench.common.baseline_python),
    disaggregated with the launcher's defaults: (the process, its HTTP URL) once it serves."""
    return start_up(baseline_python(rev, work), model, log_dir, "baseline", f"the baseline cluster ({rev})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(ap)
    ap.set_defaults(target="", slo_ttft=1.0, slo_tpot=0.1, rates="1,2,3,4,5", duration=30.0)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--vllm", default="", help="http://HOST:PORT of a vLLM (or any OpenAI-compatible) server")
    ap.add_argument("--c1-requests", type=int, default=5)
    ap.add_argument(
        "--baseline",
        default="",
        help="a git revision whose disaggregated cluster is swept too, as `before` (before/after in one run)",
    )
    ap.add_argument(
        "--prefill-replicas",
        type=int,
        default=1,
        help="prefill workers of the disaggregated cluster (each gets cores // replicas threads)",
    )
    ap.add_argument(
        "--quantization", default=None, choices=["int8"], help="kvferry's weights (both clusters)"
    )
    ap.add_argument("--kv-cache-dtype", default=None, choices=["auto", "int8"], help="kvferry's KV cache")
    ap.add_argument(
        "--isa",
        default="native",
        choices=["native", "avx2"],
        help="avx2: kvferry's clusters see this CPU as AVX2-only (KVFERRY_CPU_ISA and ATEN_CPU_CAPABILITY; "
        "float32 by default), how an AVX2-only host is stood in for; start --vllm's server likewise",
    )
    for action in ap._actions:
        if action.dest in ("target", "slo_ttft", "slo_tpot", "out"):
            action.required = False
    args = ap.parse_args()
    args.out = args.out or Path("serving-goodput")
    model = str(bench_model_dir(args.model))
    logs = args.out / "logs"
    engine = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    if args.isa != "native":  # the clusters' processes inherit it
        os.environ[ISA_ENV] = os.environ["ATEN_CPU_CAPABILITY"] = args.isa
    clusters = [start(model, colocated, logs / name, args.prefill_replicas, engine) for name, colocated in
                (("disagg", False), ("colocated", True))]  # fmt: skip
    work, baseline = Path(tempfile.mkdtemp(prefix="kvferry-goodput-")), None
    try:
        urls = {"kvferry": clusters[0].http_url, "colocated": clusters[1].http_url}
        if args.baseline:
            baseline, urls["before"] = start_baseline(args.baseline, model, work, logs / "before")
        if args.vllm:
            urls["vllm"] = args.vllm.rstrip("/")
        single = {}
        for label, url in urls.items():
            single[label] = c1(url, args.input_len, args.output_len, args.c1_requests)
            print(f"{label} c1: {single[label]}", file=sys.stderr)
        args.target, *args.compare = urls.values()
        args.labels = ",".join(urls)
        report = run_sweep(args)
    finally:
        for cluster in clusters:
            cluster.stop()
        if baseline is not None:
            stop_up(baseline)
        remove_worktree(work)
        shutil.rmtree(work, ignore_errors=True)
    good = {label: report["targets"][label]["goodput"] for label in urls}
    result = {
        "model": Path(model).name,
        "cpu_flags": reported_cpu_flags(),
        "isa": args.isa,
        "prefill_replicas": args.prefill_replicas,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype or "auto",
        "slo": report["slo"],
        "rates": args.rates,
        "kvferry_goodput": good["kvferry"],
        "colocated_goodput": good["colocated"],
        "vllm_goodput": good.get("vllm"),
        "kvferry_vs_colocated": _ratio(good["kvferry"], good["colocated"]),
        "kvferry_vs_vllm": _ratio(good["kvferry"], good.get("vllm")),
        "baseline": args.baseline or None,
        "before_goodput": good.get("before"),
        "kvferry_vs_before": _ratio(good["kvferry"], good.get("before")),
        **{f"{label}_c1_tpot_ms": single[label]["tpot_ms"] for label in urls},
        **{f"{label}_c1_ttft_ms": single[label]["ttft_ms"] for label in urls},
        "c1_ttft_parts_ms": {
            label: {name: single[label][name] for name in PHASES if name in single[label]} for label in urls
        },
    }
    print_result(result, args.out / "result.json")


def _ratio(a: float, b: float | None) -> float | None:
    return round(a / b, 3) if b else None  # None: no baseline, or it met the SLOs at no swept rate


if __name__ == "__main__":
    main()
