"""n sequences of one prompt: prefilled once, against n separate requests in the same run.

Brings up a local cluster (redis, a pool node, one prefill and one decode worker, the router) on the bench
model and, in each of --repeats rounds with a fresh random prompt of --prompt-len tokens:
- n: one gRPC request with sampling.n = --n (temperature 1), its sequences streamed together;
- separate: the same prompt (fresh again) sent as --n concurrent requests of one sequence each.
Each side's prompt tokens computed by the prefill worker (its `prompt_tokens_computed`), the decode
worker's recomputed tokens (a sibling whose leader's private tail block was gone), and the wall time
until the last sequence finished. The target: n computes the prompt once (prefill ratio 1.0).

    python bench/n_sequences.py [--n 4] [--prompt-len 500] [--max-tokens 32] [--repeats 3]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result, reported_cpu_flags

from kvferry.deploy.config import ClusterConfig
from kvferry.deploy.local import LocalCluster
from kvferry.kvpool.metadata import MetadataStore
from kvferry.router.client import Client, build_request
from kvferry.router.config import RouterConfig
from kvferry.rpc import channel
from kvferry.v1 import worker_pb2, worker_pb2_grpc


def counters(cluster: LocalCluster) -> dict[str, int]:
    """Prompt tokens the prefill workers computed, and tokens the decode workers recomputed."""
    meta = MetadataStore(cluster.redis_url, cluster.cfg.namespace)
    out = {"prefill": 0, "decode": 0}
    for role, stub_cls in (
        ("prefill", worker_pb2_grpc.PrefillWorkerStub),
        ("decode", worker_pb2_grpc.DecodeWorkerStub),
    ):
        for info in (meta.members(role) or {}).values():
            with channel(info["addr"]) as ch:
                stats = stub_cls(ch).GetStats(worker_pb2.WorkerStatsRequest(), timeout=10)
            out[role] += stats.prompt_tokens_computed if role == "prefill" else stats.recomputed_tokens
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows: dict[str, list] = {"n": [], "separate": []}
    with tempfile.TemporaryDirectory(prefix="kvferry-n-") as logs:
        cfg = ClusterConfig(
            model=str(bench_model_dir(args.model)),
            namespace="n-sequences",
            router=RouterConfig(port=0, http_port=None),
        )
        with (
            LocalCluster(cfg, log_dir=Path(logs), quiet=True) as cluster,
            Client(cluster.router_addr) as client,
        ):

            def request(ids, n: int):
                return build_request(
                    prompt_token_ids=ids, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True, n=n
                )

            def measure(kind: str, send) -> None:
                ids = torch.randint(10, 8000, (args.prompt_len,), generator=gen).tolist()
                before = counters(cluster)
                t = time.perf_counter()
                tokens = send(ids)
                elapsed = time.perf_counter() - t
                after = counters(cluster)
                assert tokens == args.n * args.max_tokens, tokens
                rows[kind].append(
                    {
                        "prefill_ratio": (after["prefill"] - before["prefill"]) / args.prompt_len,
                        "decode_recomputed": after["decode"] - before["decode"],
                        "ms": elapsed * 1e3,
                    }
                )
                print(f"{kind}: {rows[kind][-1]}", file=sys.stderr, flush=True)

            def as_n(ids) -> int:
                return sum(len(m.token_ids) for m in client.stream(request(ids, args.n), timeout=600))

            def separate(ids) -> int:
                with ThreadPoolExecutor(args.n) as pool:
                    done = list(
                        pool.map(lambda _: client.generate(request(ids, 1), timeout=600), range(args.n))
                    )
                return sum(len(d.token_ids) for d in done)

            measure("n", as_n)  # warm-up (first-call costs on every path), not counted
            rows["n"].clear()
            for _ in range(args.repeats):
                measure("n", as_n)
                measure("separate", separate)

    def median(kind: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rows[kind]), 3)

    result = {
        "bench": "n_sequences",
        "model": args.model,
        "cpu_flags": reported_cpu_flags(),
        "n": args.n,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "n_prefill_ratio": median("n", "prefill_ratio"),
        "separate_prefill_ratio": median("separate", "prefill_ratio"),
        "n_decode_recomputed_tokens": median("n", "decode_recomputed"),
        "separate_decode_recomputed_tokens": median("separate", "decode_recomputed"),
        "n_ms": median("n", "ms"),
        "separate_ms": median("separate", "ms"),
        "speedup": round(median("separate", "ms") / median("n", "ms"), 3),
    }
    print_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
