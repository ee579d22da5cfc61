"""Whether constrained requests can hurt everyone else: plain requests' TTFT alone, and beside a stream of
expensive constraints, on the same cluster in one run.

Brings up a disaggregated cluster (`kvferry up`'s processes) and sends plain greedy requests (fresh
`--input-len`-token prompts, `--output-len` tokens) at `--rate` per second, open-loop (Poisson), for
`--duration` seconds: first alone, then beside a stream of constrained requests at `--hostile-rate` per
second, each a regex no earlier request used (so no cache helps), of three kinds in turn: one whose
lexer explodes at its first masks (`(a{N}){N}`, N ~ 1000: refused at compile time, 400), one that
compiles in budget and passes it a few tokens in (`(b|c)(a{N}){N}`: an error mid-generation), and one
that is merely costly (`(a{M}){M}`, M ~ 300: tens of ms to compile, served). Before the budgets (issue
45) the first kind alone cost 2-13 s of engine thread each.

Per phase: the plain requests' TTFT p50 / p99 (ms) and how many were served; the constrained ones'
outcomes (refused / failed / served). Last line: one JSON object; `ttft_p99_beside_vs_alone` is the
figure the target is on (<= 1.5).

    python bench/grammar_isolation.py [--model bench] [--rate 3] [--hostile-rate 2] [--duration 30]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result, reported_cpu_flags

from kvferry.deploy.config import ClusterConfig
from kvferry.deploy.local import LocalCluster
from kvferry.router.client import Client, build_request
from kvferry.router.config import RouterConfig


def plain(addr: str, prompt: list[int], output_len: int) -> float | None:
    """One greedy streamed request: its TTFT in ms (None: it failed)."""
    request = build_request(prompt_token_ids=prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    first = None
    try:
        with Client(addr) as client:
            for message in client.stream(request, timeout=120):
                if first is None and message.token_ids:
                    first = (time.perf_counter() - t0) * 1e3
    except grpc.RpcError:
        return None
    return first


def hostile(addr: str, i: int, rng: random.Random) -> str:
    """One constrained request of kind i % 3 (a regex never sent before): 'refused', 'failed', 'served'
    or 'other' (an answer of none of those kinds)."""
    n = rng.randrange(900, 1200)
    kind = i % 3
    regex = {0: f"(a{{{n}}}){{{n}}}", 1: f"(b|c)(a{{{n}}}){{{n}}}", 2: f"(a{{{n // 3}}}){{{n // 3}}}"}[kind]
    request = build_request(prompt="x", max_tokens=16, temperature=0.0, ignore_eos=True)
    request.sampling.structured.regex = regex
    try:
        with Client(addr) as client:
            client.generate(request, timeout=120)
        return "served"
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.INVALID_ARGUMENT and "budget" in (err.details() or ""):
            return "refused"
        if err.code() == grpc.StatusCode.INTERNAL and "structured output failed" in (err.details() or ""):
            return "failed"
        return "other"


def open_loop(rate: float, duration: float, seed: int) -> list[float]:
    """Poisson arrival offsets (s) over `duration`."""
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def phase(args, addr: str, seed: int, with_hostile: bool, bar: tqdm) -> dict:
    gen = torch.Generator().manual_seed(seed)
    offsets = open_loop(args.rate, args.duration, seed)
    prompts = [torch.randint(3, 8000, (args.input_len,), generator=gen).tolist() for _ in offsets]
    hostile_offsets = open_loop(args.hostile_rate, args.duration, seed + 1) if with_hostile else []
    rng = random.Random(seed)
    start = time.perf_counter() + 0.5
    ttfts: list[float | None] = []
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def at(offset: float, job) -> None:
        time.sleep(max(0.0, start + offset - time.perf_counter()))
        job()

    def send_plain(prompt) -> None:
        ttft = plain(addr, prompt, args.output_len)
        with lock:
            ttfts.append(ttft)
        bar.update(1)

    def send_hostile(i: int) -> None:
        outcome = hostile(addr, i, rng)
        with lock:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    workers = len(offsets) + len(hostile_offsets)
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        jobs = [pool.submit(at, o, lambda p=p: send_plain(p)) for o, p in zip(offsets, prompts, strict=True)]
        jobs += [pool.submit(at, o, lambda i=i: send_hostile(i)) for i, o in enumerate(hostile_offsets)]
        for job in jobs:
            job.result()
    served = sorted(t for t in ttfts if t is not None)
    if not served:
        raise SystemExit("no plain request was served")
    return {
        "sent": len(ttfts),
        "served": len(served),
        "ttft_p50_ms": round(served[len(served) // 2], 1),
        "ttft_p99_ms": round(served[min(len(served) - 1, int(len(served) * 0.99))], 1),
        "constrained": outcomes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--rate", type=float, default=3.0, help="plain requests per second")
    ap.add_argument("--hostile-rate", type=float, default=2.0, help="constrained requests per second")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per phase")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cfg = ClusterConfig(
        model=str(bench_model_dir(args.model)),
        namespace="grammar-isolation",
        router=RouterConfig(port=0, http_port=None, max_inflight=4096),
    )
    work = Path(tempfile.mkdtemp(prefix="kvferry-grammar-"))
    cluster = LocalCluster(cfg, log_dir=work / "logs", quiet=True)
    try:
        cluster.start()
        addr = cluster.router_addr
        plain(addr, [5] * args.input_len, args.output_len)  # warm
        expected = 2 * round(args.rate * args.duration)
        with tqdm(total=expected, desc="plain requests", unit="req") as bar:
            alone = phase(args, addr, 1, False, bar)
            beside = phase(args, addr, 2, True, bar)
    finally:
        cluster.stop()
    result = {
        "model": args.model,
        "cpu": reported_cpu_flags(),
        "rate": args.rate,
        "hostile_rate": args.hostile_rate,
        "duration_s": args.duration,
        "alone": alone,
        "beside": beside,
        "ttft_p50_beside_vs_alone": round(beside["ttft_p50_ms"] / alone["ttft_p50_ms"], 3),
        "ttft_p99_beside_vs_alone": round(beside["ttft_p99_ms"] / alone["ttft_p99_ms"], 3),
    }
    print_result(result, args.out)


if __name__ == "__main__":
    main()
