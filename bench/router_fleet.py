"""One router against a fleet of two, on the same cluster and the same load, in one run.

Brings up a disaggregated cluster (`kvferry up`'s processes) with `--routers` router processes on one
shared port, then serves the same workload through 1 router (the others scaled away: `kvferry scale
--routers 1`) and through all of them. The workload: `--families` prompt families that share a
`--prefix-len`-token prefix (each prompt adds its own `--suffix-len` tokens), `--requests` requests at
`--concurrency` streams, each stream on a connection of its own (the kernel spreads them over the
routers), greedy, `--output-len` tokens. Each run uses fresh families, so neither finds the other's
prefixes cached.

Per run: requests/s, goodput (requests/s that met both SLOs: TTFT <= `--slo-ttft-ms`, TPOT <=
`--slo-tpot-ms`), router CPU per request (user + system time of every router process over the run),
the prefix-hit rate (cached / prompt tokens, from each request's `Finished`), and the TTFT prediction's
error (|actual - predicted| / actual, p50, from `Timings.predicted_ttft_ms`: the routers predict from
what every worker publishes, so a fleet should predict as well as one router). Last line: one JSON
object; `*_fleet_vs_one` are the fleet's figures over the single router's.

    python bench/router_fleet.py [--model bench] [--routers 2] [--requests 96] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result, reported_cpu_flags
from router_cpu import cpu_s

from kvferry.deploy.config import ClusterConfig, WorkerGroupSettings
from kvferry.deploy.local import LocalCluster
from kvferry.router.client import Client, build_request
from kvferry.router.config import RouterConfig


def workload(args, seed: int) -> list[list[int]]:
    """`args.requests` prompts of `args.families` families (a shared prefix, a suffix of their own)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(3, 8000, (n,), generator=gen).tolist()

    prefixes = [draw(args.prefix_len) for _ in range(args.families)]
    prompts = []
    for i in range(args.requests):
        prompts.append(prefixes[i % args.families] + draw(args.suffix_len))
    return prompts


def one(addr: str, prompt: list[int], output_len: int) -> dict:
    """One streamed request on a connection of its own: its TTFT, TPOT and Finished figures."""
    request = build_request(prompt_token_ids=prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    first = last = None
    tokens, finished = 0, None
    with Client(addr) as client:
        for msg in client.stream(request, timeout=600):
            now = time.perf_counter()
            if msg.token_ids and first is None:
                first = now
            last = now
            tokens += len(msg.token_ids)
            if msg.HasField("finished"):
                finished = msg.finished
    if finished is None or tokens != output_len:
        raise SystemExit(f"a stream ended early: {tokens} of {output_len} tokens")
    t = finished.timings
    return {
        "ttft_ms": (first - t0) * 1e3,
        "tpot_ms": (last - first) * 1e3 / max(1, tokens - 1),
        "prompt": finished.prompt_tokens,
        "cached": finished.cached_tokens,
        "predicted_ttft_ms": t.predicted_ttft_ms,
        "server_ttft_ms": t.ttft_ms,
    }


def run(cluster: LocalCluster, args, prompts: list[list[int]], desc: str) -> dict:
    pids = [c.proc.pid for c in cluster.live_routers()]
    before = sum(cpu_s(p) for p in pids)
    t0 = time.perf_counter()
    bar = tqdm(total=len(prompts), desc=desc, unit="req")
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        jobs = [pool.submit(one, cluster.router_addr, p, args.output_len) for p in prompts]
        results = []
        for job in jobs:
            results.append(job.result())
            bar.update(1)
    bar.close()
    wall = time.perf_counter() - t0
    cpu = sum(cpu_s(p) for p in pids) - before
    good = [r for r in results if r["ttft_ms"] <= args.slo_ttft_ms and r["tpot_ms"] <= args.slo_tpot_ms]
    errors = [
        abs(r["server_ttft_ms"] - r["predicted_ttft_ms"]) / r["server_ttft_ms"]
        for r in results
        if r["predicted_ttft_ms"] > 0 and r["server_ttft_ms"] > 0
    ]
    return {
        "routers": len(pids),
        "requests": len(results),
        "requests_per_s": round(len(results) / wall, 3),
        "goodput_rps": round(len(good) / wall, 3),
        "slo_attainment": round(len(good) / len(results), 3),
        "router_cpu_ms_per_request": round(cpu * 1e3 / len(results), 2),
        "prefix_hit_rate": round(sum(r["cached"] for r in results) / sum(r["prompt"] for r in results), 4),
        "ttft_p50_ms": round(statistics.median(r["ttft_ms"] for r in results), 1),
        "tpot_p50_ms": round(statistics.median(r["tpot_ms"] for r in results), 2),
        "ttft_prediction_error_p50": round(statistics.median(errors), 3) if errors else None,
        "predictions": len(errors),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--routers", type=int, default=2, help="the fleet's size")
    ap.add_argument("--requests", type=int, default=96, help="per run")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--families", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=192)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--prefill-replicas", type=int, default=2)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvferry-router-fleet-"))
    cfg = ClusterConfig(
        model=str(bench_model_dir(args.model)),
        namespace="router-fleet",
        prefill=WorkerGroupSettings(replicas=args.prefill_replicas),
        router=RouterConfig(
            port=0,
            http_port=None,
            max_inflight=4096,
            replicas=args.routers,
            slo_ttft_ms=args.slo_ttft_ms * 4,  # predictions are made and reported; nothing is refused
            admission="predictive",
            on_predicted_miss="deprioritize",
        ),
    )
    with LocalCluster(cfg, log_dir=work / "logs", quiet=True) as cluster:
        run(cluster, args, workload(args, 99)[: args.concurrency], "warm-up")
        cluster.scale(routers=1)
        single = run(cluster, args, workload(args, 1), "1 router")
        cluster.scale(routers=args.routers)
        fleet = run(cluster, args, workload(args, 2), f"{args.routers} routers")

    def ratio(key: str) -> float | None:
        a, b = fleet[key], single[key]
        return round(a / b, 3) if a is not None and b else None

    print_result(
        {
            "bench": "router_fleet",
            "model": args.model,
            "cpu_flags": reported_cpu_flags(),
            "one_router": single,
            "fleet": fleet,
            "requests_per_s_fleet_vs_one": ratio("requests_per_s"),
            "goodput_fleet_vs_one": ratio("goodput_rps"),
            "router_cpu_fleet_vs_one": ratio("router_cpu_ms_per_request"),
            "prefix_hit_rate_fleet_vs_one": ratio("prefix_hit_rate"),
            "ttft_prediction_error_fleet_vs_one": ratio("ttft_prediction_error_p50"),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
