"""Prefix reuse: TTFT of a 2k-token prompt computed cold vs. served from a cached prefix, on the bench model.

Brings up a local cluster (LocalCluster: redis, a pool node with a disk tier in a temp dir,
--prefill-replicas prefill workers, a decode worker, the router) and, in each of --repeats rounds with
fresh random prompts (nothing carries over between rounds), calls the prefill workers' own `Prefill` RPC
on the worker it picks (P, Q: the two workers swap roles every round):
- cold: prompt A (--prompt-len tokens) on P: nothing cached anywhere; its KV goes to the pool;
- pool: A's first --shared-frac (90%) tokens, rounded down to whole blocks, + fresh tokens on Q: the
  prefix is pulled from the pool (another worker's KV);
- local: the same prefix + other fresh tokens on P: a hit in P's own prefix cache;
- identical: A again on P: every full block cached, only the last block's tokens are computed.
Then through the router's `Generate` (max_tokens 1, so TTFT = the call): a fresh prompt (router_cold)
and one sharing its prefix (router_shared; the router picks the worker, so that hit may be local or
pooled: `router_shared_pool_tokens` says which). Last:
- disk: A's prefix pushed out of the pool's slab (SLAB_PROMPTS prompts' blocks, sized from the KV
  layout's block bytes) onto its disk tier by junk blocks put straight into the pool, FILL_BLOCKS at a time
  and each batch written before the next (the workers' own puts evict in bigger batches than the tier can
  stage, and the overflow is dropped), then out of both workers' caches (the fewest blocks the engine
  accepts) by `disk_flush_prompts` fresh prompts. Once the metadata names every block of the prefix on
  disk (`DISK_SLOT`), the prefix + other fresh tokens on P, checked to pull exactly the prefix from the
  pool, the pool's disk_hits up by as many blocks (a restore from disk, then the usual pull).
Each call's TTFT is its wall time as the client sees it (for a Prefill call: admission, prefix lookup and
pull, compute, the KV write to the pool, the answer); the workers' own split (queue, prefill compute incl.
the pull, KV put) is reported too. Figures are medians over the rounds; ratios are against the cold TTFT
of the same run. Greedy first tokens are checked: the identical repeat must give the cold run's token.

    python bench/prefix_reuse.py [--repeats 5] [--prompt-len 2048] [--shared-frac 0.9] [--prefill-replicas 2]

Last line: one JSON object (cold_ms, pool_ms, local_ms, identical_ms, disk_ms, router_*_ms, *_ratio, ...).
"""

from __future__ import annotations

import argparse
import shutil
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
from kvferry.deploy.config import ClusterConfig, cluster_layout
from kvferry.deploy.local import LocalCluster
from kvferry.kvpool.client import PoolClient
from kvferry.kvpool.config import PoolConfig
from kvferry.kvpool.metadata import DISK_SLOT, MetadataStore
from kvferry.kvpool.transfer import BlockLayout
from kvferry.model.config import ModelConfig
from kvferry.router.client import Client, build_request
from kvferry.router.config import RouterConfig
from kvferry.v1 import generate_pb2, pool_pb2, pool_pb2_grpc, worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 16  # the cluster's default block size
GREEDY_ONE = generate_pb2.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
CASES = ("cold", "pool", "local", "identical", "disk")
# the pool's slab holds this many prompts' blocks: a round's puts before the disk case (A, the fresh tails
# of pool and local, the router's two prompts: about 2.3 prompts) plus the workers' reserved slots, so
# that only the filler's paced puts evict A's blocks
SLAB_PROMPTS = 4
DISK_GIB = 2.0
# blocks per filler put (and per Reserve): at most the disk tier's 8 staging buffers, so no spill is dropped
FILL_BLOCKS = 4


class Prefills:
    """Stubs of the cluster's prefill workers and pool nodes (found in its Redis registry)."""

    def __init__(self, cluster: LocalCluster, count: int, layout: BlockLayout):
        self.meta = meta = MetadataStore(cluster.redis_url, cluster.cfg.namespace)
        self.filler = PoolClient(meta, layout, peer_id="bench-filler", reserve_blocks=FILL_BLOCKS)
        self.junk = torch.zeros(FILL_BLOCKS, *layout.shape, dtype=layout.torch_dtype)
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

    def disk_stat(self, name: str) -> int:
        """A disk tier counter (`PoolStats` field), summed over the pool nodes."""
        stats = (pool.GetStats(pool_pb2.PoolStatsRequest(), timeout=10) for pool in self.pools)
        return sum(getattr(s, name) for s in stats)

    def settle(self, timeout: float = 30.0) -> None:
        """Until every block evicted so far is written to disk or dropped (the tier's writer is idle). A
        block restored from disk and evicted again only refreshes its file, counted nowhere: at most once
        per disk hit."""
        deadline = time.monotonic() + timeout
        while True:
            stats = [pool.GetStats(pool_pb2.PoolStatsRequest(), timeout=10) for pool in self.pools]
            if all(s.disk_spills + s.disk_spill_drops + s.disk_hits >= s.evictions for s in stats):
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"the disk tier's writer is still behind after {timeout} s")
            time.sleep(0.02)

    def spill(self, keys: list[bytes], max_blocks: int) -> None:
        """Fill the slab with junk blocks until the metadata names every one of `keys` on disk. Puts of
        FILL_BLOCKS, each settled before the next, evict at most as many blocks at a time as the disk tier
        can stage: the workers' puts reserve slots in bigger batches, whose evictions mostly drop."""
        self.settle()
        for _ in range(0, max_blocks, FILL_BLOCKS):
            if all(loc is not None and loc.slot == DISK_SLOT for loc in self.meta.lookup(keys)):
                return
            self.filler.put("bench-filler", [uuid.uuid4().bytes for _ in range(FILL_BLOCKS)], self.junk)
            self.settle()
        found = self.meta.lookup(keys)
        kinds = "".join("-" if x is None else "d" if x.slot == DISK_SLOT else "m" for x in found)
        drops = self.disk_stat("disk_spill_drops")
        raise SystemExit(
            f"A's prefix is not on disk after {max_blocks} filler blocks ({kinds}, drops {drops})"
        )

    def close(self) -> None:
        self.filler.close()
        for channel in self.channels:
            channel.close()


def router_ttft(client: Client, ids: list[int]) -> tuple[float, generate_pb2.Finished]:
    start = time.perf_counter()
    result = client.generate(build_request(prompt_token_ids=ids, max_tokens=1, temperature=0.0), timeout=120)
    return (time.perf_counter() - start) * 1e3, result.finished


def start_cluster(args, model: str, log_dir: Path, disk_dir: Path) -> tuple[LocalCluster, BlockLayout, int]:
    """The cluster, its KV block layout, and `flush`: how many fresh prompts evict an older one from a
    prefill worker's cache. The slab holds SLAB_PROMPTS prompts' blocks."""
    model_cfg = ModelConfig.from_dir(Path(model))
    prompt_blocks = -(-args.prompt_len // BLOCK_SIZE)
    # the fewest blocks the engine accepts (max_model_len tokens), and at least two prompts
    local_blocks = max(-(-model_cfg.max_position_embeddings // BLOCK_SIZE), 2 * prompt_blocks)
    router = RouterConfig(port=0, http_port=None)
    cfg = ClusterConfig(model=model, namespace="prefix-reuse", router=router)
    group = cfg.groups("prefill")[0]
    engine = {**group.engine, "num_kv_blocks": local_blocks}
    cfg = replace(cfg, prefill=replace(group, replicas=args.prefill_replicas, engine=engine))
    layout = cluster_layout(cfg, model_cfg)
    slab_gib = SLAB_PROMPTS * prompt_blocks * layout.block_bytes / 2**30
    cfg = replace(cfg, pool=PoolConfig(memory_gib=slab_gib, disk_dir=str(disk_dir), disk_max_gib=DISK_GIB))
    cluster = LocalCluster(cfg, log_dir=log_dir, quiet=True)
    cluster.start()
    return cluster, layout, local_blocks // prompt_blocks + 1


def run_rounds(args, prefills: Prefills, client: Client, flush: int, slots: int) -> dict[str, list]:
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
        for case in CASES[:-1]:
            round_ms[case], round_reply[case] = prefills.prefill(*prompts[case])
        if round_reply["identical"].first_token_id != round_reply["cold"].first_token_id:
            raise SystemExit(f"round {r}: the identical repeat's first token differs from the cold run's")
        d = fresh(args.prompt_len)
        cold_ms, cold_fin = router_ttft(client, d)
        shared_ms, shared_fin = router_ttft(client, d[:shared] + fresh(args.prompt_len - shared))
        prefills.spill([b.key for b in round_reply["cold"].blocks[: shared // BLOCK_SIZE]], 2 * slots)
        for i in range(2 * flush):  # A out of both workers' caches (its disk copy stays: the tier's LRU)
            prefills.prefill(i % 2, fresh(args.prompt_len))
        prefills.settle()  # the writer idle while the disk case runs
        hits = prefills.disk_stat("disk_hits")
        disk_prompt = a[:shared] + fresh(args.prompt_len - shared)
        round_ms["disk"], round_reply["disk"] = prefills.prefill(p, disk_prompt)
        restored = prefills.disk_stat("disk_hits") - hits
        if round_reply["disk"].pool_cached_tokens != shared or restored != shared // BLOCK_SIZE:
            raise SystemExit(
                f"round {r}: the disk case pulled {round_reply['disk'].pool_cached_tokens} of {shared} "
                f"prefix tokens from the pool, {restored} blocks from disk"
            )
        rows["ms"].append(round_ms)
        rows["reply"].append(round_reply)
        rows["router_ms"].append({"cold": cold_ms, "shared": shared_ms})
        rows["router_finished"].append({"cold": cold_fin, "shared": shared_fin})
    return rows


def summarize(args, rows: dict[str, list], flush: int) -> dict:
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
    out["disk_flush_prompts"] = 2 * flush
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
    disk_dir = Path(tempfile.mkdtemp(prefix="kvferry-prefix-reuse-disk-"))
    try:
        cluster, layout, flush = start_cluster(args, str(bench_model_dir(args.model)), log_dir, disk_dir)
        prefills, client = Prefills(cluster, 2, layout), Client(cluster.router_addr)
        try:
            slots = SLAB_PROMPTS * -(-args.prompt_len // BLOCK_SIZE)
            rows = run_rounds(args, prefills, client, flush, slots)
        finally:
            client.close()
            prefills.close()
            cluster.stop()
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    print_result(summarize(args, rows, flush), args.out)


if __name__ == "__main__":
    main()
