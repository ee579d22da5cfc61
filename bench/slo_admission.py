"""SLO-aware admission under overload: goodput with predictive admission against the fixed cap, the same
arrivals, one cluster; a mixed-priority run; and how close the predicted TTFT came to the actual.

Brings up the disaggregated cluster (`kvferry up`'s placement, `--model`), measures its capacity C (the
completion rate of a saturating burst), then for each overload factor (`--factors`, default 2 and 4) sends
the same open-loop Poisson arrivals at factor x C for `--duration` seconds three times:
- `cap`: requests without targets: only --max-inflight (256) refuses, the queue grows;
- `tuned_cap`: the same, with a cap tuned to this load (Little's law: C x (TTFT target + output tokens x
  the TPOT at capacity) in flight; the client refuses past it, as the router's cap would);
- `predictive`: the same requests carrying the SLO (`GenerateRequest.slo`): a request predicted to miss
  it is refused at once (router.slo).
Goodput: requests that met both targets (TTFT and TPOT, measured by this client) per second of arrivals;
a refused request counts as a miss that cost nothing. Then one more predictive run at the first factor
where `--high-share` of the requests have priority 0 and the rest priority 1: each class's attainment
(met / sent). Prediction accuracy: over the served requests of the predictive runs, the median of
predicted / actual TTFT (both as the router measures it, `Finished.timings`).

    python bench/slo_admission.py [--model bench] [--factors 2,4] [--duration 30] [--input-len 256]
                                  [--output-len 32] [--slo-ttft-ms 1000] [--slo-tpot-ms 100] [--out DIR]

Last line: one JSON object (capacity, per run: goodput and attainment, the ratios, the prediction's
accuracy); OUT gets result.json and requests.jsonl (one line per request of every run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result, reported_cpu_flags

from kvferry.deploy.config import ClusterConfig
from kvferry.deploy.local import LocalCluster
from kvferry.loadtest.arrivals import arrival_offsets
from kvferry.router.client import Client, build_request
from kvferry.router.config import RouterConfig
from kvferry.v1 import generate_pb2


@dataclass
class Outcome:
    run: str
    priority: int
    sent: float
    status: str = "OK"
    ttft_ms: float | None = None  # this client's: sent -> first token
    tpot_ms: float | None = None
    tokens: int = 0
    router_ttft_ms: float | None = None
    predicted_ttft_ms: float | None = None
    detail: str = ""  # a refusal's reason

    def met(self, ttft_ms: float, tpot_ms: float) -> bool:
        return (
            self.status == "OK"
            and self.ttft_ms is not None
            and self.ttft_ms <= ttft_ms
            and (self.tpot_ms is None or self.tpot_ms <= tpot_ms)
        )


def one(client: Client, request: generate_pb2.GenerateRequest, out: Outcome) -> Outcome:
    first = last = None
    try:
        for msg in client.stream(request, timeout=300):
            now = time.perf_counter()
            if msg.token_ids:
                first = first or now
                last = now
                out.tokens += len(msg.token_ids)
            if msg.HasField("finished"):
                t = msg.finished.timings
                out.router_ttft_ms = t.ttft_ms or None
                out.predicted_ttft_ms = t.predicted_ttft_ms or None
    except grpc.RpcError as err:
        out.status = err.code().name
        out.detail = err.details() or ""
    if first is not None:
        out.ttft_ms = (first - out.sent) * 1e3
        if out.tokens > 1:
            out.tpot_ms = (last - first) / (out.tokens - 1) * 1e3
    return out


def prompts(n: int, lengths: list[int], seed: int) -> list[list[int]]:
    """n random prompts, each of a length drawn from `lengths` (seeded: the same lengths for a seed)."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(lengths), (n,), generator=torch.Generator().manual_seed(len(lengths) * n))
    return [torch.randint(100, 8000, (lengths[int(i)],), generator=gen).tolist() for i in picks]


def run(
    client: Client,
    label: str,
    offsets: list[float],
    args,
    slo: generate_pb2.Slo | None,
    priorities: list[int],
    seed: int,
    cap: int = 0,
) -> list[Outcome]:
    """The open-loop arrivals `offsets` (s), each request sent at its time by a pool thread. `cap` > 0:
    at most that many in flight, the rest refused on arrival (a fixed --max-inflight tuned to the load)."""
    texts = prompts(len(offsets), args.input_lens, seed)
    outcomes: list[Outcome] = []
    bar = tqdm(total=len(offsets), desc=label, unit="req", file=sys.stderr)
    lock = threading.Lock()
    seats = threading.BoundedSemaphore(cap) if cap else None

    def done(future):
        with lock:
            outcomes.append(future.result())
        if seats is not None:
            seats.release()
        bar.update(1)

    with ThreadPoolExecutor(max_workers=768) as pool:
        start = time.perf_counter()
        for i, offset in enumerate(offsets):
            wait = start + offset - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            request = build_request(
                prompt_token_ids=texts[i], max_tokens=args.output_len, temperature=0.0, ignore_eos=True
            )
            request.priority = priorities[i]
            if slo is not None:
                request.slo.CopyFrom(slo)
            out = Outcome(label, priorities[i], time.perf_counter())
            if seats is not None and not seats.acquire(blocking=False):
                out.status = "RESOURCE_EXHAUSTED"  # what the router's cap answers, without the round trip
                with lock:
                    outcomes.append(out)
                bar.update(1)
                continue
            pool.submit(one, client, request, out).add_done_callback(done)
    bar.close()
    return outcomes


def capacity(client: Client, args) -> tuple[float, float]:
    """Requests completed per second while a burst of `--burst` requests saturates the cluster, and their
    median TPOT (ms)."""
    outs = run(client, "capacity", [0.0] * args.burst, args, None, [0] * args.burst, seed=99)
    ends = [o.sent + (o.ttft_ms or 0) / 1e3 + (o.tpot_ms or 0) * (o.tokens - 1) / 1e3 for o in outs]
    ok = [o for o in outs if o.status == "OK"]
    span = max(ends) - min(o.sent for o in outs)
    return len(ok) / span, statistics.median(o.tpot_ms for o in ok if o.tpot_ms is not None)


def summary(outs: list[Outcome], duration: float, args) -> dict:
    met = [o for o in outs if o.met(args.slo_ttft_ms, args.slo_tpot_ms)]
    served = [o for o in outs if o.status == "OK"]
    return {
        "sent": len(outs),
        "served": len(served),
        "refused": sum(o.status == "RESOURCE_EXHAUSTED" for o in outs),
        "met": len(met),
        "attainment": round(len(met) / max(1, len(outs)), 3),
        "goodput": round(len(met) / duration, 3),
        "ttft_p50_ms": _median([o.ttft_ms for o in served]),
        "tpot_p50_ms": _median([o.tpot_ms for o in served if o.tpot_ms is not None]),
    }


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 1) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--factors", default="2,4", help="overload factors over the measured capacity")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals a run")
    ap.add_argument(
        "--input-len", default="256", help="prompt tokens; a comma list: each request draws one (mixed sizes)"
    )
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--burst", type=int, default=48, help="requests of the capacity burst")
    ap.add_argument("--high-share", type=float, default=0.3, help="share of priority-0 requests (mixed run)")
    ap.add_argument("--out", type=Path, default=Path("slo-admission"))
    args = ap.parse_args()
    factors = [float(f) for f in args.factors.split(",")]
    args.input_lens = [int(n) for n in args.input_len.split(",")]
    model = str(bench_model_dir(args.model))
    cfg = ClusterConfig(model=model, namespace="slo-bench", router=RouterConfig(port=0, http_port=0))
    slo = generate_pb2.Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    every: list[Outcome] = []
    with (
        LocalCluster(cfg, log_dir=args.out / "logs", quiet=True) as cluster,
        Client(cluster.router_addr) as client,
    ):
        run(client, "warm-up", [i * 0.2 for i in range(20)], args, None, [0] * 20, seed=98)  # fits the costs
        cap, tpot_ms = capacity(client, args)
        # a cap tuned to this load by Little's law: capacity x (the TTFT target + the decode at capacity)
        tuned = max(1, round(cap * (args.slo_ttft_ms + args.output_len * tpot_ms) / 1e3))
        print(f"capacity: {cap:.2f} req/s (TPOT {tpot_ms:.1f} ms); tuned cap {tuned}", file=sys.stderr)
        for factor in factors:
            offsets = arrival_offsets(factor * cap, args.duration, seed=int(factor * 1000))
            flat = [0] * len(offsets)
            for mode, target, seats in (("cap", None, 0), ("tuned_cap", None, tuned), ("predictive", slo, 0)):
                label = f"{mode}-{factor:g}x"
                # fresh prompts every run (no prefix-cache hit on an earlier run's), the same arrivals
                outs = run(client, label, offsets, args, target, flat, seed=len(runs) + 1, cap=seats)
                runs[label] = summary(outs, args.duration, args)
                every += outs
                print(f"{label}: {runs[label]}", file=sys.stderr)
                time.sleep(2.0)  # the last run's stragglers drained
        factor = factors[0]
        offsets = arrival_offsets(factor * cap, args.duration, seed=int(factor * 1000) + 1)
        gen = torch.Generator().manual_seed(7)
        classes = [0 if float(x) < args.high_share else 1 for x in torch.rand(len(offsets), generator=gen)]
        label = f"mixed-{factor:g}x"
        outs = run(client, label, offsets, args, slo, classes, seed=len(runs) + 1)
        every += outs
        runs[label] = {
            cls: summary([o for o in outs if o.priority == p], args.duration, args)
            for cls, p in (("high", 0), ("low", 1))
        }
        print(f"{label}: {runs[label]}", file=sys.stderr)
    with open(args.out / "requests.jsonl", "w") as f:
        for o in every:
            f.write(json.dumps(asdict(o)) + "\n")
    predicted = [
        o.predicted_ttft_ms / o.router_ttft_ms
        for o in every
        if o.run.startswith(("predictive", "mixed")) and o.predicted_ttft_ms and o.router_ttft_ms
    ]
    abs_err = [abs(r - 1.0) for r in predicted]
    result = {
        "bench": "slo_admission",
        "model": Path(model).name,
        "cpu_flags": reported_cpu_flags(),
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "input_len": args.input_len,
        "output_len": args.output_len,
        "capacity_rps": round(cap, 3),
        "tuned_cap": tuned,
        "runs": runs,
        **{
            f"predictive_vs_cap_{f:g}x": round(
                runs[f"predictive-{f:g}x"]["goodput"] / max(runs[f"cap-{f:g}x"]["goodput"], 1e-9), 3
            )
            for f in factors
        },
        **{
            f"predictive_vs_tuned_cap_{f:g}x": round(
                runs[f"predictive-{f:g}x"]["goodput"] / max(runs[f"tuned_cap-{f:g}x"]["goodput"], 1e-9), 3
            )
            for f in factors
        },
        "high_priority_attainment": runs[f"mixed-{factors[0]:g}x"]["high"]["attainment"],
        "low_priority_attainment": runs[f"mixed-{factors[0]:g}x"]["low"]["attainment"],
        "ttft_predicted_over_actual_p50": round(statistics.median(predicted), 3) if predicted else None,
        "ttft_prediction_abs_error_p50": round(statistics.median(abs_err), 3) if abs_err else None,
        "predictions": len(predicted),
    }
    print_result(result, args.out / "result.json")


if __name__ == "__main__":
    main()
