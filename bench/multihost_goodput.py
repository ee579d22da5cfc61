"""Disaggregated vs colocated goodput where each phase owns its cores (DistServe's setting), across hosts.

Three emulated hosts (`kvferry.deploy.testhosts`) on one Ray cluster (`kvferry.deploy.testray`): host 1
is the frontend (Ray's head, the router, redis-server and the load client; not pinned), hosts 2 and 3
are single-core workers (core 0, core 1). Every link is shaped (default 10 Gbit/s, 0.1 ms one way).
Two clusters in turn behind the same frontend:
- disaggregated: the prefill worker on host 2, the decode worker on host 3, a pool node on each;
- colocated: one colocated instance (prefill and decode in one engine) on each of hosts 2 and 3.
Each gets the c1 figures (one request at a time) and a `kvferry loadtest sweep` over `--rates` run on
the frontend host, with the client and SLO rule of `serving_goodput.py` (OpenAI HTTP, Poisson arrivals,
goodput = the highest rate at which >= 90% of requests meet both SLOs). Goodput is read at two SLOs from
the same requests (the sweep keeps each one's TTFT and TPOT):
- `serving_goodput.py`'s: TTFT <= 1 s, TPOT <= 100 ms (25x this model's single-request TPOT: no
  decode stall can miss it, so prefill capacity alone decides);
- DistServe's kind: each SLO `--slo-scale` (5) times the colocated baseline's own c1 latency measured
  in the same run (DistServe sets SLOs as multiples of a single request's latency), so a prefill that
  stalls a running decode batch can miss it, as it would for a user.
Last line: one JSON object with both goodputs at both SLOs and their ratios; OUT/sweep-<mode>/ holds
each sweep's CSV, JSON and plots.

    python bench/multihost_goodput.py [--rates 1,2,3,4,6] [--duration 30] [--link-gbit 10]
                                      [--delay-ms 0.1] [--model bench] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result
from serving_goodput import c1

from kvferry.deploy.testhosts import LinkShape, TestHosts
from kvferry.deploy.testray import RayNode, RayOnHosts
from kvferry.kernels.cpu import cpu_flags
from kvferry.loadtest.metrics import Slo, goodput, read_records, span_s, summarize

HTTP_PORT = 8000


def cluster_file(model: Path, mode: str, shared: Path) -> Path:
    """The cluster: `disagg` (P on host 2, D on host 3, a pool node each) or `colocated` (an instance
    on each), pinned by the hosts' Ray resources."""
    config = {
        "model": str(model),
        "namespace": mode,
        "router": {"host": "0.0.0.0", "port": 50051, "http_port": HTTP_PORT},
        "ray": {"max_restarts": 1, "log_dir": str(shared / "logs" / mode)},
    }
    if mode == "disagg":
        config |= {
            "prefill": {"replicas": 1, "resources": {"CPU": 1, "prefill_host": 1}},
            "decode": {"replicas": 1, "resources": {"CPU": 1, "decode_host": 1}},
            "pool": {"per_ray_node": False, "nodes": 2, "memory_gib": 2.0, "resources": {"pool_host": 1}},
        }
    else:
        config |= {"colocated": True, "decode": {"replicas": 2, "resources": {"CPU": 1, "colo_host": 1}}}
    path = shared / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def goodput_at(sweep_dir: Path, label: str, slo: Slo) -> float:
    """Goodput at `slo` from the requests a sweep recorded (OUT/<label>/rate-R.jsonl)."""
    rates, attainments = [], []
    for path in sorted((sweep_dir / label).glob("rate-*.jsonl"), key=lambda p: float(p.stem[5:])):
        records = read_records(path)
        rates.append(float(path.stem[5:]))
        attainments.append(summarize(records, rates[-1], slo, span_s(records)).attainment)
    return goodput(rates, attainments)


def cpu_label() -> str:
    flags = cpu_flags()
    return "avx512_bf16" if "avx512_bf16" in flags else "avx512f" if "avx512f" in flags else "avx2"


def run(args) -> dict:
    model = bench_model_dir(args.model)  # under $HOME: every host sees it (each has its own /tmp)
    shared = Path(tempfile.mkdtemp(prefix="kvferry-mhg-", dir="/var/tmp"))
    link = LinkShape(rate_mbit=args.link_gbit * 1000, delay_ms=args.delay_ms)
    results = {}
    with TestHosts(3, ["", "0", "1"], prefix="kvmhg", subnet=3) as hosts:
        for host in hosts.hosts:
            hosts.shape(host, link)
        ray = RayOnHosts(hosts, shared, head=1)
        try:
            ray.start({
                1: RayNode(2, {}),
                2: RayNode(1, {"prefill_host": 1, "pool_host": 1, "colo_host": 1}),
                3: RayNode(1, {"decode_host": 1, "pool_host": 1, "colo_host": 1}),
            })  # fmt: skip
            for mode in ("disagg", "colocated"):
                router = ray.kvferry_up(cluster_file(model, mode, shared), timeout=900)
                url = f"http://{router.rsplit(':', 1)[0]}:{HTTP_PORT}"
                single = c1(url, args.input_len, args.output_len, args.c1_requests)
                print(f"{mode} c1: {single}", file=sys.stderr, flush=True)
                out = shared / f"sweep-{mode}"
                sweep = ["kvferry", "loadtest", "sweep", "--target", url, "--labels", mode, "--out", str(out)]
                for flag in ("rates", "duration", "input_len", "output_len", "slo_ttft", "slo_tpot"):
                    sweep += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
                ray.run(1, sweep, timeout=len(args.rates.split(",")) * (args.duration + 120) + 300)
                report = json.loads((out / "summary.json").read_text())
                results[mode] = {"c1": single, "report": report}
                ray.kvferry("down", "--ray", "--namespace", mode, timeout=600)
                shutil.copytree(out, args.out / f"sweep-{mode}", dirs_exist_ok=True)
        finally:
            ray.stop()
            shutil.rmtree(shared, ignore_errors=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--rates", default="1,2,3,4,6")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--slo-ttft", type=float, default=1.0)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    ap.add_argument("--c1-requests", type=int, default=5)
    ap.add_argument(
        "--slo-scale", type=float, default=5.0, help="the second SLO: this x colocated c1 latency"
    )
    ap.add_argument("--link-gbit", type=float, default=10.0)
    ap.add_argument("--delay-ms", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=Path("multihost-goodput"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = run(args)
    good = {mode: r["report"]["targets"][mode]["goodput"] for mode, r in results.items()}
    base = results["colocated"]["c1"]
    scaled = Slo(args.slo_scale * base["ttft_ms"] / 1e3, args.slo_scale * base["tpot_ms"] / 1e3)
    tight = {mode: goodput_at(args.out / f"sweep-{mode}", mode, scaled) for mode in results}
    print_result(
        {
            "model": args.model,
            "cpu": cpu_label(),
            "hosts": "frontend (router, redis, client; unpinned) + 2 single-core workers",
            "link": f"{args.link_gbit:g} Gbit/s, {args.delay_ms:g} ms",
            "slo": results["disagg"]["report"]["slo"],
            "rates": args.rates,
            "disagg_goodput": good["disagg"],
            "colocated_goodput": good["colocated"],
            "disagg_vs_colocated": _ratio(good["disagg"], good["colocated"]),
            "slo_scaled": {
                "ttft_s": round(scaled.ttft_s, 3),
                "tpot_s": round(scaled.tpot_s, 4),
                "x_colocated_c1": args.slo_scale,
            },
            "disagg_goodput_scaled_slo": tight["disagg"],
            "colocated_goodput_scaled_slo": tight["colocated"],
            "disagg_vs_colocated_scaled_slo": _ratio(tight["disagg"], tight["colocated"]),
            **{f"{mode}_c1_ttft_ms": r["c1"]["ttft_ms"] for mode, r in results.items()},
            **{f"{mode}_c1_tpot_ms": r["c1"]["tpot_ms"] for mode, r in results.items()},
            "wall_s": round(time.monotonic() - t0),
        },
        args.out / "result.json",
    )


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


if __name__ == "__main__":
    main()
