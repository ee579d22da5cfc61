"""KV hand-off bandwidth: prefill -> pool -> decode on the bench model's block layout.

Starts a redis-server and a pool node process, then in this process plays a prefill worker (a paged KV
cache whose blocks are packed and put into the pool in request-sized batches) and a decode worker (a
second client with its own pair group, getting the blocks back and unpacking them into its own paged
cache). Puts are pipelined (put_async: the next transfer's RPC goes out while earlier data is on the
wire); gets are one at a time, as a decode worker pulls one request's blocks. In the same run it
measures the baselines on the same bytes: raw gloo send/recv to a helper process over a pair group
made the same way, in messages of the pool's message size (min(batch, CHUNK_BYTES)), preallocated
buffers both ends, no pool logic; and memcpy. Every figure counts payload bytes once.

    python bench/kv_transfer.py [--total-mb 256] [--batch-blocks 64] [--repeats 3]

Last line JSON: pool_put_gbps, pool_get_gbps, raw_gloo_gbps, memcpy_gbps, put_ratio, get_ratio.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result

from kvferry.deploy.local import redis_server_argv, wait_for_redis
from kvferry.kvpool.client import PoolClient, wait_for_nodes
from kvferry.kvpool.metadata import MetadataStore
from kvferry.kvpool.transfer import (
    CHUNK_BYTES,
    BlockLayout,
    make_pair_group,
    pack_blocks,
    recv,
    send,
    unpack_blocks,
)
from kvferry.model.config import ModelConfig
from kvferry.proc import free_port


def raw_peer(store_port: int, nbytes: int, count: int) -> None:
    """Helper process: rank 0 of a pair group; receives `count` messages of `nbytes`, then echoes them."""
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    group = make_pair_group(store, "raw", 0, "gloo", "127.0.0.1", 120)
    buf = torch.empty(nbytes // 4, dtype=torch.float32)
    for i in range(count):
        recv(group, buf, 1, i)
    for i in range(count):
        send(group, buf, 1, count + i)


def measure_raw_gloo(nbytes: int, count: int) -> tuple[float, float]:
    """(send GB/s, recv GB/s) to a helper process, same message size and count as the pool runs."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import kv_transfer as k; "
        f"k.raw_peer({store.port}, {nbytes}, {count})"
    )
    peer = subprocess.Popen([sys.executable, "-c", code])
    group = make_pair_group(store, "raw", 1, "gloo", "127.0.0.1", 120)
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    t = time.perf_counter()
    for i in range(count):
        send(group, buf, 0, i)
    t_send = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(count):
        recv(group, buf, 0, count + i)
    t_recv = time.perf_counter() - t
    peer.wait(60)
    return nbytes * count / t_send / 1e9, nbytes * count / t_recv / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total-mb", type=int, default=256)
    ap.add_argument(
        "--batch-blocks", type=int, default=64, help="blocks per put/get (64 = a 1024-token prompt)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    cfg = ModelConfig.from_dir(bench_model_dir())
    layout = BlockLayout(cfg.num_layers, cfg.num_kv_heads, 16, cfg.head_dim, args.dtype)
    n_blocks = args.total_mb * 2**20 // layout.block_bytes
    n_blocks -= n_blocks % args.batch_blocks
    total = n_blocks * layout.block_bytes
    batches = n_blocks // args.batch_blocks
    print(
        f"{n_blocks} blocks x {layout.block_bytes} B = {total / 2**20:.0f} MiB in {batches} transfers "
        f"of {args.batch_blocks} blocks",
        file=sys.stderr,
    )

    redis_port = free_port()
    procs = [subprocess.Popen(redis_server_argv("127.0.0.1", redis_port), stdout=subprocess.DEVNULL)]
    url = wait_for_redis("127.0.0.1", redis_port, time.monotonic() + 20)
    procs.append(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvferry.kvpool",
                "--node-id",
                "bench-pool",
                "--redis-url",
                url,
                "--layout",
                ",".join(map(str, layout.to_list())),
                "--num-slots",
                str(n_blocks + 16),
            ]
        )
    )
    try:
        prefill = PoolClient(MetadataStore(url), layout, peer_id="bench-prefill")
        decode = PoolClient(MetadataStore(url), layout, peer_id="bench-decode")
        if not wait_for_nodes(prefill, 1, 60):
            raise SystemExit("the pool node did not register")
        dt = layout.torch_dtype
        shape = (layout.num_layers, 2, layout.num_kv_heads, n_blocks, layout.block_size, layout.head_dim)
        src_cache = torch.randn(shape, dtype=torch.float32).to(dt)
        dst_cache = torch.zeros(shape, dtype=dt)
        ids = list(range(n_blocks))
        # warm up both pair groups (connection set-up is not bandwidth)
        warm = prefill.put("warm", [b"w" * 16], pack_blocks(src_cache, [0]), private=[True])
        decode.get("warm", warm)
        put_best = get_best = memcpy_best = 0.0
        bar = tqdm(total=args.repeats * 2 * batches, desc="transfers", unit="batch", file=sys.stderr)
        for rep in range(args.repeats):
            keys = [bytes([rep]) + i.to_bytes(15, "little") for i in ids]
            pending = []
            t = time.perf_counter()
            for b in range(batches):  # puts are pipelined: the next starts while a reply is in flight
                chunk = ids[b * args.batch_blocks : (b + 1) * args.batch_blocks]
                pending.append(
                    prefill.put_async(
                        f"put-{rep}",
                        [keys[i] for i in chunk],
                        lambda first, count, out, chunk=chunk: pack_blocks(
                            src_cache, chunk[first : first + count], out=out
                        ),
                    )
                )
                bar.update()
            locations = [loc for p in pending for loc in p.result()]
            put_best = max(put_best, total / (time.perf_counter() - t) / 1e9)
            assert all(loc is not None for loc in locations), "the pool refused blocks"
            t = time.perf_counter()
            for b in range(batches):
                chunk = ids[b * args.batch_blocks : (b + 1) * args.batch_blocks]
                decode.get_into(
                    f"get-{rep}",
                    locations[chunk[0] : chunk[-1] + 1],
                    lambda first, data, chunk=chunk: unpack_blocks(
                        dst_cache, chunk[first : first + data.shape[0]], data
                    ),
                )
                bar.update()
            get_best = max(get_best, total / (time.perf_counter() - t) / 1e9)
            if not torch.equal(dst_cache, src_cache):
                raise SystemExit("KV read back from the pool differs from what was written")
            dst_cache.zero_()
            t = time.perf_counter()
            dst_cache.copy_(src_cache)
            memcpy_best = max(memcpy_best, total / (time.perf_counter() - t) / 1e9)
        bar.close()
        # the pool moves a transfer in messages of at most CHUNK_BYTES: the baseline sends the same bytes
        # in messages of the same size
        message_blocks = min(args.batch_blocks, max(1, CHUNK_BYTES // layout.block_bytes))
        raw = 0.0
        for _ in range(args.repeats):
            raw = max(raw, *measure_raw_gloo(message_blocks * layout.block_bytes, n_blocks // message_blocks))
        prefill.close()
        decode.close()
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    print_result(
        {
            "total_mb": round(total / 2**20),
            "batch_blocks": args.batch_blocks,
            "block_bytes": layout.block_bytes,
            "pool_put_gbps": round(put_best, 3),
            "pool_get_gbps": round(get_best, 3),
            "raw_gloo_gbps": round(raw, 3),
            "memcpy_gbps": round(memcpy_best, 3),
            "put_ratio": round(put_best / raw, 3),
            "get_ratio": round(get_best / raw, 3),
        }
    )


if __name__ == "__main__":
    main()
