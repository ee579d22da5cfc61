"""KV hand-off bandwidth: prefill -> pool -> decode on the bench model's block layout.

Starts a redis-server and a pool node process, then in this process plays a prefill worker (a paged KV
cache whose blocks are packed and put into the pool in request-sized batches) and a decode worker (a
second client, getting the blocks back into its own paged cache with `pull_into_cache`), twice: over
the pair group (gloo; the clients told not to map the node's slab) and through the node's shared slab
(same host: memcpy, no socket). Puts are pipelined (put_async returns once the data is handed over);
gets are one at a time, as a decode worker pulls one request's blocks. In the same run it measures the
baselines on the same bytes: raw gloo send/recv to a helper process over a pair group made the same
way, one message per transfer (its batch of blocks), preallocated buffers both ends, no pool logic;
and memcpy of the whole cache. Every figure counts payload bytes once.

    python bench/kv_transfer.py [--total-mb 256] [--batch-blocks 64] [--repeats 3] [--block-size 16]
    python bench/kv_transfer.py --hosts [--rates 1,10,25]   # between emulated hosts (kv_transfer_hosts.py)

Last line JSON: pool_put_gbps, pool_get_gbps (gloo), shm_put_gbps, shm_get_gbps, raw_gloo_gbps,
memcpy_gbps, put_ratio, get_ratio (vs raw gloo), shm_put_ratio, shm_get_ratio (vs memcpy).
"""

from __future__ import annotations

import argparse
import contextlib
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
from kvferry.kvpool.transfer import BlockLayout, make_pair_group, pack_blocks, recv, send
from kvferry.model.config import ModelConfig
from kvferry.proc import free_port


def raw_peer(store: dist.Store, host: str, nbytes: int, count: int) -> None:
    """Rank 0 of a pair group: receives `count` messages of `nbytes`, then echoes them."""
    group = make_pair_group(store, "raw", 0, "gloo", host, 120)
    buf = torch.empty(nbytes // 4, dtype=torch.float32)
    for i in range(count):
        recv(group, buf, 1, i)
    for i in range(count):
        send(group, buf, 1, count + i)


def raw_rank1(store: dist.Store, host: str, nbytes: int, count: int) -> tuple[float, float]:
    """(send GB/s, recv GB/s) to `raw_peer`: one message per transfer, preallocated buffers."""
    group = make_pair_group(store, "raw", 1, "gloo", host, 120)
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    t = time.perf_counter()
    for i in range(count):
        send(group, buf, 0, i)
    t_send = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(count):
        recv(group, buf, 0, count + i)
    t_recv = time.perf_counter() - t
    return nbytes * count / t_send / 1e9, nbytes * count / t_recv / 1e9


def measure_raw_gloo(nbytes: int, count: int) -> tuple[float, float]:
    """(send GB/s, recv GB/s) to a helper process on this host, same message size and count as the pool."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import kv_transfer as k; "
        "import torch.distributed as dist; "
        f"store = dist.TCPStore('127.0.0.1', {store.port}, is_master=False); "
        f"k.raw_peer(store, '127.0.0.1', {nbytes}, {count})"
    )
    peer = subprocess.Popen([sys.executable, "-c", code])
    result = raw_rank1(store, "127.0.0.1", nbytes, count)
    peer.wait(60)
    return result


def measure_pool(
    prefill, decode, src_cache, dst_cache, batch_blocks: int, tag: bytes, bar
) -> tuple[float, float]:
    """(put GB/s, get GB/s) of every block of `src_cache` through the pool into `dst_cache` (checked)."""
    n_blocks = src_cache.shape[3]
    total = src_cache.numel() * src_cache.element_size()
    ids = list(range(n_blocks))
    batches = [ids[b : b + batch_blocks] for b in range(0, n_blocks, batch_blocks)]
    keys = [tag + i.to_bytes(14, "little") for i in ids]
    pending = []
    t = time.perf_counter()
    for chunk in batches:  # pipelined: the next put starts while earlier answers are on their way

        def fill(first: int, count: int, out: torch.Tensor, chunk=chunk) -> None:
            pack_blocks(src_cache, chunk[first : first + count], out=out)

        pending.append(prefill.put_async("put", [keys[i] for i in chunk], fill))
        bar.update()
    locations = [loc for p in pending for loc in p.result()]
    put_gbps = total / (time.perf_counter() - t) / 1e9
    assert all(loc is not None for loc in locations), "the pool refused blocks"
    dst_cache.zero_()
    t = time.perf_counter()
    for chunk in batches:
        served = decode.pull_into_cache("get", locations[chunk[0] : chunk[-1] + 1], dst_cache, chunk)
        assert served == len(chunk), f"{served} of {len(chunk)} blocks served"
        bar.update()
    get_gbps = total / (time.perf_counter() - t) / 1e9
    if not torch.equal(dst_cache, src_cache):
        raise SystemExit("KV read back from the pool differs from what was written")
    return put_gbps, get_gbps


@contextlib.contextmanager
def pool_node(layout: BlockLayout, num_slots: int):
    """A redis-server and one pool node of `layout` with `num_slots` blocks; yields the Redis URL."""
    redis_port = free_port()
    procs = [subprocess.Popen(redis_server_argv("127.0.0.1", redis_port), stdout=subprocess.DEVNULL)]
    try:
        url = wait_for_redis("127.0.0.1", redis_port, time.monotonic() + 20)
        node = [sys.executable, "-m", "kvferry.kvpool", "--node-id", "bench-pool", "--redis-url", url]
        node += ["--layout", ",".join(map(str, layout.to_list())), "--num-slots", str(num_slots)]
        procs.append(subprocess.Popen(node))
        yield url
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total-mb", type=int, default=256)
    ap.add_argument(
        "--batch-blocks", type=int, default=64, help="blocks per put/get (64 = a 1024-token prompt)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (the pool's per-block work)")
    ap.add_argument(
        "--hosts",
        action="store_true",
        help="between two emulated hosts (root; kv_transfer_hosts.py): one JSON line per --rates link",
    )
    ap.add_argument("--rates", default="1,10,25", help="with --hosts: link rates in Gbit/s")
    args = ap.parse_args()

    cfg = ModelConfig.from_dir(bench_model_dir())
    layout = BlockLayout(cfg.num_layers, cfg.num_kv_heads, args.block_size, cfg.head_dim, args.dtype)
    n_blocks = args.total_mb * 2**20 // layout.block_bytes
    n_blocks -= n_blocks % args.batch_blocks
    total = n_blocks * layout.block_bytes
    batches = n_blocks // args.batch_blocks
    print(
        f"{n_blocks} blocks x {layout.block_bytes} B = {total / 2**20:.0f} MiB in {batches} transfers "
        f"of {args.batch_blocks} blocks",
        file=sys.stderr,
    )
    if args.hosts:
        from kv_transfer_hosts import run_hosts

        run_hosts(args, layout, n_blocks)
        return

    with pool_node(layout, n_blocks + 1024) as url:  # a rep's blocks and the clients' reservations
        clients = {}
        for transport in ("gloo", "shm"):
            shm = transport == "shm"
            meta = MetadataStore(url)
            clients[transport] = [
                PoolClient(meta, layout, peer_id=f"bench-{role}-{transport}", shm=shm)
                for role in ("put", "get")
            ]
        if not wait_for_nodes(clients["gloo"][0], 1, 60):
            raise SystemExit("the pool node did not register")
        dt = layout.torch_dtype
        shape = (layout.num_layers, 2, layout.num_kv_heads, n_blocks, layout.block_size, layout.head_dim)
        src_cache = torch.randn(shape, dtype=torch.float32).to(dt)
        dst_cache = torch.zeros(shape, dtype=dt)
        best = {}
        bar = tqdm(total=args.repeats * 4 * batches, desc="transfers", unit="batch", file=sys.stderr)
        for rep in range(args.repeats):
            for i, (transport, (prefill, decode)) in enumerate(clients.items()):
                if rep == 0:  # connection set-up and the first reservation are not bandwidth
                    warm = prefill.put(
                        "warm", [bytes([255, i]) * 8], pack_blocks(src_cache, [0]), private=[True]
                    )
                    decode.get("warm", warm)
                tag = bytes([rep, i])
                put_gbps, get_gbps = measure_pool(
                    prefill, decode, src_cache, dst_cache, args.batch_blocks, tag, bar
                )
                old = best.get(transport, (0.0, 0.0))
                best[transport] = (max(old[0], put_gbps), max(old[1], get_gbps))
            dst_cache.zero_()
            t = time.perf_counter()
            dst_cache.copy_(src_cache)
            best["memcpy"] = max(best.get("memcpy", 0.0), total / (time.perf_counter() - t) / 1e9)
        bar.close()
        raw = 0.0
        for _ in range(args.repeats):  # the same bytes, one message per transfer
            raw = max(raw, *measure_raw_gloo(args.batch_blocks * layout.block_bytes, batches))
        for pair in clients.values():
            for c in pair:
                c.close()
    (put, get), (shm_put, shm_get), memcpy = best["gloo"], best["shm"], best["memcpy"]
    print_result(
        {
            "total_mb": round(total / 2**20),
            "batch_blocks": args.batch_blocks,
            "block_bytes": layout.block_bytes,
            "pool_put_gbps": round(put, 3),
            "pool_get_gbps": round(get, 3),
            "shm_put_gbps": round(shm_put, 3),
            "shm_get_gbps": round(shm_get, 3),
            "raw_gloo_gbps": round(raw, 3),
            "memcpy_gbps": round(memcpy, 3),
            "put_ratio": round(put / raw, 3),
            "get_ratio": round(get / raw, 3),
            "shm_put_ratio": round(shm_put / memcpy, 3),
            "shm_get_ratio": round(shm_get / memcpy, 3),
        }
    )


if __name__ == "__main__":
    main()
