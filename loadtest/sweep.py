"""`kvferry loadtest sweep`: run locust headless once per request rate, then report SLO goodput.

For each target (the cluster, and each `--compare` target after it; a router's gRPC HOST:PORT, or
http://HOST:PORT of any OpenAI-compatible server) and each rate: one locust run of
`--duration` seconds of open-loop arrivals, its JSONL records kept in OUT/<label>/rate-<r>.jsonl.
Then per rate: TTFT/TPOT/ITL/E2EL p50/p90/p99, SLO attainment, throughput; per target: the goodput.
Written to OUT: sweep.csv (a row per target and rate), summary.json, attainment.png, latency.png.

`--api-key` (default: the first of $KVFERRY_API_KEY) is sent with every request, as `authorization:
Bearer` (it reaches locust in its environment, never on a command line). Each target is asked for its
model first: one that refuses (a missing or wrong key, a server that is down) stops the sweep at once
with the server's answer.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from kvferry.loadtest.metrics import RateSummary, Slo, goodput, read_records, span_s, summarize
from kvferry.settings import API_KEY_ENV, load_settings

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        required=True,
        help="router HOST:PORT (gRPC), or http://HOST:PORT of any OpenAI-compatible server (completions)",
    )
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        help="another target (either kind) swept the same way; repeatable",
    )
    p.add_argument("--labels", default="", help="names of the targets in the report, comma-separated")
    p.add_argument("--rates", default="0.5,1,2,4,8", help="requests per second, comma-separated")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-share", type=float, default=0.0, help="fraction of each prompt shared by all")
    p.add_argument("--slo-ttft", type=float, required=True, help="TTFT SLO, seconds")
    p.add_argument("--slo-tpot", type=float, required=True, help="TPOT SLO, seconds")
    p.add_argument("--users", type=int, default=0, help="locust users (default: enough for the rate)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vocab-size", type=int, default=0, help="for HTTP targets that report none (prompts are token ids)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"sent as 'authorization: Bearer KEY' to every target (default: the first of ${API_KEY_ENV})",
    )
    p.add_argument("--out", type=Path, required=True)


def api_key_of(args) -> str | None:
    """--api-key, else the first key of the environment's (as `kvferry up` reads its own)."""
    return args.api_key or load_settings().client_key


def probe(target: str, api_key: str | None) -> None:
    """Ask the target for its model, as the load test's first step will: SystemExit with the server's
    own answer when it refuses (rather than a sweep of requests that each fail the same way)."""
    if target.startswith(("http://", "https://")):
        import requests

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            reply = requests.get(target.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        except requests.RequestException as err:
            raise SystemExit(f"{target}: cannot reach it ({err})") from None
        if reply.status_code != 200:
            try:
                why = reply.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                why = reply.text[:300]
            raise SystemExit(f"{target} refused the load test (HTTP {reply.status_code}): {why}")
        return
    import grpc

    from kvferry.router.client import Client

    with Client(target, api_key=api_key) as client:
        try:
            client.model_info(timeout=30)
        except grpc.RpcError as err:
            raise SystemExit(f"{target} refused the load test ({err.code().name}): {err.details()}") from None


def users_for(rate: float, duration: float) -> int:
    """Enough users that arrivals never wait for a free one (each holds one request in flight)."""
    return max(8, min(2000, math.ceil(rate * min(duration, 60.0)) + 8))


def rate_seed(seed: int, rate: float) -> int:
    """The arrivals and prompts of one rate: the same for every target, different at every rate, so a
    server's prefix cache never serves a prompt it saw at an earlier rate of the sweep."""
    return seed * 1_000_003 + round(rate * 1000)


def user_class(target: str) -> str:
    """The locustfile's user for a target: OpenAI completions over HTTP, or the router's gRPC API."""
    return "OpenAIUser" if target.startswith(("http://", "https://")) else "GenerateUser"


def run_rate(args, target: str, rate: float, records: Path, bar: tqdm) -> float:
    """One locust run; returns its wall time. The bar's postfix follows the records as they land."""
    users = args.users or users_for(rate, args.duration)
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--only-summary",
        # a failed request is a record (a miss in the attainment), not a failed run: locust would
        # otherwise exit 1 whenever any request failed and the sweep would stop there
        "--exit-code-on-error",
        "0",
        "--loglevel",
        "WARNING",
        "-u",
        str(users),
        "-r",
        str(users),
        "-H",
        target,
        "--run-time",
        f"{int(args.duration + args.request_timeout + 30)}s",  # a cap: the run ends when all are done
        "--rate",
        str(rate),
        "--duration",
        str(args.duration),
        "--burstiness",
        str(args.burstiness),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--prefix-share",
        str(args.prefix_share),
        "--records",
        str(records),
        "--arrival-seed",
        str(rate_seed(args.seed, rate)),
        "--request-timeout",
        str(args.request_timeout),
        "--vocab-size",
        str(args.vocab_size),
        user_class(target),
    ]
    log = records.with_suffix(".log")
    started = time.monotonic()
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)
    if args.api_key_resolved:
        env[API_KEY_ENV] = args.api_key_resolved  # (locustfile.api_key reads it)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        expected = max(1, round(rate * args.duration))
        while proc.poll() is None:
            done = _count_lines(records)
            bar.set_postfix_str(
                f"rate {rate:g}/s: {done}/~{expected} requests, {time.monotonic() - started:.0f}s"
            )
            time.sleep(1.0)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"locust at rate {rate} exited with {proc.returncode}; {log}:\n{tail}")
    return time.monotonic() - started


def _count_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def sweep_target(args, target: str, label: str, rates: list[float], slo: Slo, bar: tqdm) -> list[RateSummary]:
    out_dir = args.out / label
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = []
    for rate in rates:
        path = out_dir / f"rate-{rate:g}.jsonl"
        run_rate(args, target, rate, path, bar)
        records = read_records(path)
        if not records:
            raise RuntimeError(f"no requests were recorded at rate {rate} (see {path.with_suffix('.log')})")
        summaries.append(summarize(records, rate, slo, span_s(records)))
        bar.update(1)
        s = summaries[-1]
        bar.write(
            f"{label} rate {rate:g}/s: attainment {s.attainment:.0%} ({s.good}/{s.sent}, {s.errors} errors), "
            f"TTFT p90 {_ms(s.ttft_ms['p90'])}, TPOT p90 {_ms(s.tpot_ms['p90'])}"
        )
    return summaries


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def run_sweep(args) -> dict:
    if importlib.util.find_spec("locust") is None:
        raise SystemExit("kvferry loadtest needs locust and matplotlib: pip install -e '.[loadtest]'")
    rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
    if not rates or min(rates) <= 0:
        raise SystemExit("--rates must list positive request rates")
    slo = Slo(args.slo_ttft, args.slo_tpot)
    targets = [args.target, *args.compare]
    labels = [x for x in args.labels.split(",") if x] or ["target"] + [
        f"compare{i}" for i in range(len(args.compare))
    ]
    if len(labels) != len(targets):
        raise SystemExit(f"--labels names {len(labels)} targets, there are {len(targets)}")
    args.api_key_resolved = api_key_of(args)
    for target in targets:
        probe(target, args.api_key_resolved)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tqdm(total=len(rates) * len(targets), desc="sweep", unit="rate") as bar:
        for target, label in zip(targets, labels, strict=True):
            summaries = sweep_target(args, target, label, rates, slo, bar)
            results[label] = {
                "target": target,
                "goodput": goodput([s.rate for s in summaries], [s.attainment for s in summaries]),
                "rates": [asdict(s) for s in summaries],
            }
    report = {
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment_target": 0.9},
        "workload": {
            "duration_s": args.duration,
            "burstiness": args.burstiness,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "prefix_share": args.prefix_share,
        },
        "targets": results,
    }
    (args.out / "summary.json").write_text(json.dumps(report, indent=2))
    write_csv(args.out / "sweep.csv", results)
    plot(args.out, report)
    return report


def write_csv(path: Path, results: dict) -> None:
    rows = []
    for label, result in results.items():
        for rate in result["rates"]:
            flat = RateSummary(**rate).flat()
            rows.append({"target": label, **flat, "goodput": result["goodput"]})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(out: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = report["slo"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, result in report["targets"].items():
        rates = [r["rate"] for r in result["rates"]]
        ax.plot(
            rates,
            [r["attainment"] for r in result["rates"]],
            "o-",
            label=f"{label} (goodput {result['goodput']:.2f}/s)",
        )
    ax.axhline(slo["attainment_target"], color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment", ylim=(0, 1.05))
    ax.set_title(f"TTFT <= {slo['ttft_s']:g}s and TPOT <= {slo['tpot_s'] * 1e3:g}ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "attainment.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, limit in ((axes[0], "ttft_ms", slo["ttft_s"]), (axes[1], "tpot_ms", slo["tpot_s"])):
        for label, result in report["targets"].items():
            rates = [r["rate"] for r in result["rates"]]
            for p, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
                values = [r[metric][p] for r in result["rates"]]
                ax.plot(rates, [math.nan if v is None else v for v in values], style, label=f"{label} {p}")
        ax.axhline(limit * 1e3, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel="request rate (req/s)", ylabel=f"{metric.split('_')[0].upper()} (ms)", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=120)
    plt.close(fig)
