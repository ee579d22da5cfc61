"""Prefix reuse: TTFT of a 2k-token prompt computed cold vs. served from a cached prefix, on the bench model.

Brings up a local cluster (LocalCluster: redis, a pool node, --prefill-replicas prefill workers, a decode
worker, the router) and, in each of --repeats rounds with fresh random prompts (nothing carries over
between rounds), calls the prefill workers' own `Prefill` RPC on the worker it picks (P, Q: the two
workers swap roles every round):
- cold: prompt A (--prompt-len tokens) on P: nothing cached anywhere; its KV goes to the pool;
- pool: A's first --shared-frac (90%) tokens, rounded down to whole blocks, + fresh tokens on Q: the
  prefix is pulled from the pool (another worker's KV);
- local: the same prefix + other fresh tokens on P: a hit in P's own prefix cache;
- identical: A again on P: every full block cached, only the last block's tokens are computed.
Then through the router's `Generate` (max_tokens 1, so TTFT = the call): a fresh prompt (router_cold)
and one sharing its prefix (router_shared; the router picks the worker, so that hit may be local or
pooled: `router_shared_pool_tokens` says which). Each call's TTFT is its wall time as the client sees
it (for a Prefill call: admission, prefix lookup and pull, compute, the KV write to the pool, the answer);
the workers' own split (queue, prefill compute incl. the pull, KV put) is reported too. Figures are
medians over the rounds; ratios are against the cold TTFT of the same run. Greedy first tokens are
checked: the identical repeat must give the cold run's token.

    python bench/prefix_reuse.py [--repeats 5] [--prompt-len 2048] [--shared-frac 0.9] [--prefill-replicas 2]

Last line: one JSON object (cold_ms, pool_ms, local_ms, identical_ms, router_*_ms, *_ratio, ...).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result

from kvferry import rpc
from kvferry.deploy.config import ClusterConfig, RouterSettings
from kvferry.deploy.local import LocalCluster
from kvferry.kvpool.metadata import MetadataStore
from kvferry.router.client import Client, build_request
from kvferry.v1 import generate_pb2, pool_pb2, pool_pb2_grpc, worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 16  # the cluster's default block size
GREEDY_ONE = generate_pb2.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
CASES = ("cold", "pool", "local", "identical")


class Prefills:
    """Stubs of the cluster's prefill workers and pool nodes (found in its Redis registry)."""

    def __init__(self, cluster: LocalCluster, count: int):
        meta = MetadataStore(cluster.redis_url, cluster.cfg.namespace)
        workers = sorted(meta.members("prefill").items())
        if len(workers) < count:
            raise SystemExit(f"expected {count} prefill workers, the registry lists {len(workers)}")
        self.channels = [rpc.channel(info["addr"]) for _, info in workers]
        self.workers = [worker_pb2_grpc.PrefillWorkerStub(c) for c in self.channels]
        pool_channels = [rpc.channel(info["addr"]) for info in meta.members("pool").values()]
        self.channels += pool_channels
        self.pools = [pool_pb2_grpc.KVPoolStub(c) for c in pool_channels]

    def prefill(self, worker: int, ids: list[int]) -> tuple[float, worker_pb2.PrefillResponse]:
        """(wall ms, reply) of one Prefill call; the private tail block it leaves is released after."""
        rid = f"bench-{uuid.uuid4().hex[:12]}"
        request = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=GREEDY_ONE)
        start = time.perf_counter()
        reply = self.workers[worker].Prefill(request, timeout=120)
        ms = (time.perf_counter() - start) * 1e3
        for pool in self.pools:
            pool.Release(pool_pb2.ReleaseRequest(request_id=rid), timeout=10)
        return ms, reply

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def router_ttft(client: Client, ids: list[int]) -> tuple[float, generate_pb2.Finished]:
    start = time.perf_counter()
    result = client.generate(build_request(prompt_token_ids=ids, max_tokens=1, temperature=0.0), timeout=120)
    return (time.perf_counter() - start) * 1e3, result.finished


def start_cluster(model: str, replicas: int, log_dir: Path) -> LocalCluster:
    router = RouterSettings(port=0, http_port=None)
    cfg = ClusterConfig(model=model, namespace="prefix-reuse", router=router)
    cfg = replace(cfg, prefill=replace(cfg.groups("prefill")[0], replicas=replicas))
    cluster = LocalCluster(cfg, log_dir=log_dir, quiet=True)
    cluster.start()
    return cluster


def run_rounds(args, prefills: Prefills, client: Client) -> dict[str, list]:
    gen = torch.Generator().manual_seed(args.seed)
    vocab_hi = 8000

    def fresh(n: int) -> list[int]:
        return torch.randint(10, vocab_hi, (n,), generator=gen).tolist()

    shared = int(args.prompt_len * args.shared_frac) // BLOCK_SIZE * BLOCK_SIZE
    rows: dict[str, list] = {k: [] for k in ("ms", "reply", "router_ms", "router_finished")}
    prefills.prefill(0, fresh(64))  # warm-up: first-call costs (pair groups, allocations) on every path
    prefills.prefill(1, fresh(64))
    for r in tqdm(range(args.repeats), desc="rounds", unit="round"):
        p, q = r % 2, 1 - r % 2
        a = fresh(args.prompt_len)
        prompts = {
            "cold": (p, a),
            "pool": (q, a[:shared] + fresh(args.prompt_len - shared)),
            "local": (p, a[:shared] + fresh(args.prompt_len - shared)),
            "identical": (p, a),
        }
        round_ms, round_reply = {}, {}
        for case in CASES:
            round_ms[case], round_reply[case] = prefills.prefill(*prompts[case])
        if round_reply["identical"].first_token_id != round_reply["cold"].first_token_id:
            raise SystemExit(f"round {r}: the identical repeat's first token differs from the cold run's")
        d = fresh(args.prompt_len)
        cold_ms, cold_fin = router_ttft(client, d)
        shared_ms, shared_fin = router_ttft(client, d[:shared] + fresh(args.prompt_len - shared))
        rows["ms"].append(round_ms)
        rows["reply"].append(round_reply)
        rows["router_ms"].append({"cold": cold_ms, "shared": shared_ms})
        rows["router_finished"].append({"cold": cold_fin, "shared": shared_fin})
    return rows


def summarize(args, rows: dict[str, list]) -> dict:
    def med(values) -> float:
        return round(statistics.median(values), 1)

    out: dict = {"model": args.model, "prompt_len": args.prompt_len, "repeats": args.repeats}
    out["shared_tokens"] = int(args.prompt_len * args.shared_frac) // BLOCK_SIZE * BLOCK_SIZE
    for case in CASES:
        out[f"{case}_ms"] = med(m[case] for m in rows["ms"])
    for case in ("cold", "shared"):
        out[f"router_{case}_ms"] = med(m[case] for m in rows["router_ms"])
    cold = out["cold_ms"]
    for case in CASES[1:]:
        out[f"{case}_ratio"] = round(out[f"{case}_ms"] / cold, 3)
    out["router_shared_ratio"] = round(out["router_shared_ms"] / out["router_cold_ms"], 3)
    out["router_shared_pool_tokens"] = med(f["shared"].pool_cached_tokens for f in rows["router_finished"])
    for case in CASES:  # the worker's own split of each case
        replies = [rep[case] for rep in rows["reply"]]
        out[f"{case}_worker"] = {
            "queue_ms": med(x.queue_ms for x in replies),
            "prefill_ms": med(x.prefill_ms for x in replies),
            "kv_put_ms": med(x.kv_put_ms for x in replies),
            "computed_tokens": med(x.computed_tokens for x in replies),
            "pool_cached_tokens": med(x.pool_cached_tokens for x in replies),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--shared-frac", type=float, default=0.9)
    ap.add_argument("--prefill-replicas", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, default=None, help="the cluster's logs (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    args = ap.parse_args()
    if args.prefill_replicas < 2:
        ap.error("--prefill-replicas must be >= 2 (the pool case needs a second worker)")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvferry-prefix-reuse-"))
    cluster = start_cluster(str(bench_model_dir(args.model)), args.prefill_replicas, log_dir)
    prefills, client = Prefills(cluster, 2), Client(cluster.router_addr)
    try:
        rows = run_rounds(args, prefills, client)
    finally:
        client.close()
        prefills.close()
        cluster.stop()
    print_result(summarize(args, rows), args.out)


if __name__ == "__main__":
    main()
