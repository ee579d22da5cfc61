"""Layer-wise KV streaming: the prefill's time to answer with and without it, at 1k and 4k-token prompts.

Brings up a local cluster on the bench model (redis, a pool node, a prefill and a decode worker) four
times: with `pool.stream_layers: on` (each layer of the blocks a step completes goes to the pool as soon
as that layer is computed) and `off` (the prompt's KV is written after its last layer), each through the
node's shared slab (same host: a memcpy) and through its pair group (`pool.shm: false`: loopback gloo, as
a worker on another host would reach it). In each, every
--repeats round calls the prefill worker's own `Prefill` RPC with fresh random prompts of each length
(nothing cached) and records its wall time (admission, chunked prefill, the KV write, the pool's answer:
what the router waits for before the decode can start) and the worker's own split (`prefill_ms`: the
compute, `kv_put_ms`: from the end of the compute to the pool's answer). The figures are medians; the
ratio is streaming / after-prefill in the same run and transport (< 1: streaming answers sooner).

    python bench/kv_streaming.py [--repeats 3] [--lengths 1024,4000]
    python bench/kv_streaming.py --hosts [--rates 1,10] [--tokens 4000]   # P and D on emulated hosts
                                                                        # (root; kv_streaming_hosts.py)

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result

from kvferry import rpc
from kvferry.deploy.config import ClusterConfig
from kvferry.deploy.local import LocalCluster
from kvferry.kvpool.config import PoolConfig
from kvferry.kvpool.metadata import MetadataStore
from kvferry.router.config import RouterConfig
from kvferry.v1 import generate_pb2, pool_pb2, pool_pb2_grpc, worker_pb2, worker_pb2_grpc

GREEDY_ONE = generate_pb2.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def release(pools, request_id: str) -> None:
    for channel in pools:
        pool_pb2_grpc.KVPoolStub(channel).Release(pool_pb2.ReleaseRequest(request_id=request_id), timeout=10)


def run_mode(args, model: str, shm: bool, stream: bool, log_dir: Path, bar: tqdm) -> dict[int, list[tuple]]:
    """{length: [(wall ms, prefill ms, kv put ms, blocks streamed)]} for one cluster."""
    name = f"{'shm' if shm else 'pair'}-{'stream' if stream else 'after'}"
    cfg = ClusterConfig(
        model=model,
        namespace=f"kv-streaming-{name}",
        router=RouterConfig(port=0, http_port=None),
        pool=PoolConfig(memory_gib=1.0, stream_layers="on" if stream else "off", shm=shm),
    )
    cluster = LocalCluster(cfg, log_dir=log_dir / name, quiet=True)
    cluster.start()
    meta = MetadataStore(cluster.redis_url, cfg.namespace)
    channels = [rpc.channel(info["addr"]) for info in meta.members("prefill").values()]
    pools = [rpc.channel(info["addr"]) for info in meta.members("pool").values()]
    worker = worker_pb2_grpc.PrefillWorkerStub(channels[0])
    rng = torch.Generator().manual_seed(args.seed + stream)
    rows: dict[int, list[tuple]] = {n: [] for n in args.lengths}
    try:
        for n in args.lengths:  # warm-up: the first call of each shape pays one-time costs
            warm = torch.randint(3, 8192, (n,), generator=rng).tolist()
            rid = f"warm-{n}"
            request = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=warm, sampling=GREEDY_ONE)
            worker.Prefill(request, timeout=300)
            release(pools, rid)  # its private tail block
        for _ in range(args.repeats):
            for n in args.lengths:
                before = worker.GetStats(worker_pb2.WorkerStatsRequest(), timeout=10).blocks_streamed
                ids = torch.randint(3, 8192, (n,), generator=rng).tolist()
                rid = f"bench-{uuid.uuid4().hex[:12]}"
                request = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=GREEDY_ONE)
                start = time.perf_counter()
                reply = worker.Prefill(request, timeout=300)
                wall = (time.perf_counter() - start) * 1e3
                streamed = (
                    worker.GetStats(worker_pb2.WorkerStatsRequest(), timeout=10).blocks_streamed - before
                )
                if reply.computed_tokens != n or len(reply.blocks) != -(-n // 16):
                    raise SystemExit(f"unexpected reply for a fresh {n}-token prompt: {reply}")
                rows[n].append((wall, reply.prefill_ms, reply.kv_put_ms, streamed))
                release(pools, rid)
                bar.update(1)
    finally:
        for channel in channels + pools:
            channel.close()
        cluster.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4000])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    ap.add_argument(
        "--hosts",
        action="store_true",
        help="the prefill and the decode on two emulated hosts (root; kv_streaming_hosts.py): TTFT and "
        "the second token through the router at each --rates link",
    )
    ap.add_argument("--rates", default="1,10", help="with --hosts: link rates in Gbit/s")
    ap.add_argument("--delay-ms", type=float, default=0.1, help="with --hosts: one-way link delay")
    ap.add_argument("--tokens", type=int, default=4000, help="with --hosts: the prompt's length")
    args = ap.parse_args()
    if args.hosts:
        from kv_streaming_hosts import run_hosts

        return run_hosts(args)
    model = str(bench_model_dir(args.model))
    log_dir = Path(tempfile.mkdtemp(prefix="kvferry-kv-streaming-"))
    transports = {"shm": True, "pair": False}
    bar = tqdm(total=4 * args.repeats * len(args.lengths), desc="prefills", unit="call")
    modes = {
        (t, stream): run_mode(args, model, shm, stream, log_dir, bar)
        for t, shm in transports.items()
        for stream in (True, False)
    }
    bar.close()
    med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
    result: dict = {"repeats": args.repeats, "logs": str(log_dir)}
    for t in transports:
        for n in args.lengths:
            on, off = modes[(t, True)][n], modes[(t, False)][n]
            p = f"{t}_{n}"
            result[f"{p}_stream_ms"] = round(med(on, 0), 1)
            result[f"{p}_after_ms"] = round(med(off, 0), 1)
            result[f"{p}_ratio"] = round(med(on, 0) / med(off, 0), 3)
            result[f"{p}_stream_kv_put_ms"] = round(med(on, 2), 1)
            result[f"{p}_after_kv_put_ms"] = round(med(off, 2), 1)
            result[f"{p}_stream_prefill_ms"] = round(med(on, 1), 1)
            result[f"{p}_after_prefill_ms"] = round(med(off, 1), 1)
            result[f"{p}_blocks_streamed"] = int(med(on, 3))
            print(
                f"{t:4s} {n:5d} tokens: streaming {result[f'{p}_stream_ms']:8.1f} ms (KV put after the "
                f"compute {result[f'{p}_stream_kv_put_ms']:.1f} ms), after-prefill "
                f"{result[f'{p}_after_ms']:8.1f} ms (KV put {result[f'{p}_after_kv_put_ms']:.1f} ms): "
                f"ratio {result[f'{p}_ratio']:.3f}",
                flush=True,
            )
    print_result(result, args.out)


if __name__ == "__main__":
    main()
