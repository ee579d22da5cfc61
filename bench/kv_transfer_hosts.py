"""`kv_transfer.py --hosts`: pool put/get between two emulated hosts vs raw gloo over the same link.

Emulated hosts (`kvferry.deploy.testhosts`), each with its own /dev/shm and a link shaped with tbf at
each rate: host 1 (core 0) runs the clients (a prefill worker's puts, a decode worker's gets), host 2
(core 1) the pool node, host 3 (not pinned) redis-server, as a cluster's head would. Every put and every
get crosses the link (the same-host slab cannot be mapped from host 1: its /dev/shm is private; the run
checks the clients did not map it). The
baseline is raw gloo between the same two namespaces over the same link: a pair group made the same
way, the same message size (one transfer's blocks) and count, preallocated buffers, no pool logic. Each
rate prints one JSON line; the link's byte counters show the KV crossed it.

The roles below run on the hosts as `python bench/kv_transfer_hosts.py --role ...`.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_result
from kv_transfer import measure_pool, raw_peer, raw_rank1

from kvferry.kvpool.client import PoolClient, wait_for_nodes
from kvferry.kvpool.metadata import MetadataStore
from kvferry.kvpool.transfer import BlockLayout, pack_blocks

SCRIPT = str(Path(__file__).resolve())
REDIS_PORT = 6379  # each host has its own network namespace: any port is free there
NODE_ID = "xfer-pool"


def host_store(host: str, port: int, size: int | None) -> dist.TCPStore:
    """Rank 0's TCPStore on host:port (0: any free port), listening on `host` only: torch's own
    listener would bind every interface, so the store gets a socket bound here instead."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        bound = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the descriptor from here on
    return dist.TCPStore(host, bound, size, is_master=True, wait_for_workers=False, master_listen_fd=fd)


def run_pool_client(args, layout: BlockLayout) -> dict:
    """On the clients' host: put every block into the remote node, get them back, best of the repeats."""
    meta = MetadataStore(args.redis_url)
    put, get = (PoolClient(meta, layout, peer_id=f"xfer-{r}", host=args.host) for r in ("put", "get"))
    if not wait_for_nodes(put, 1, 60):
        raise SystemExit("the pool node did not register")
    shape = (layout.num_layers, 2, layout.num_kv_heads, args.blocks, layout.block_size, layout.head_dim)
    src = torch.randn(shape, dtype=torch.float32).to(layout.torch_dtype)
    dst = torch.zeros(shape, dtype=layout.torch_dtype)
    warm = put.put("warm", [bytes([255]) * 16], pack_blocks(src, [0]), private=[True])
    get.get("warm", warm)

    best = (0.0, 0.0)
    for rep in range(args.repeats):
        rates = measure_pool(
            put, get, src, dst, args.batch_blocks, bytes([args.tag, rep]), tqdm(disable=True)
        )
        best = (max(best[0], rates[0]), max(best[1], rates[1]))
    mapped = any(node.shm is not None for c in (put, get) for node in c.nodes.values())
    for c in (put, get):
        c.close()
    return {"pool_put_gbps": best[0], "pool_get_gbps": best[1], "slab_mapped": mapped}


def run_raw(args) -> dict:
    """On the clients' host: rank 1 of the raw pair group (the peer on the pool's host is rank 0 and
    hosts the store)."""
    host, port = args.store.rsplit(":", 1)
    best = (0.0, 0.0)
    for rep in range(args.repeats):
        store = dist.PrefixStore(f"rep{rep}/", dist.TCPStore(host, int(port), is_master=False))
        rates = raw_rank1(store, args.host, args.nbytes, args.count)
        best = (max(best[0], rates[0]), max(best[1], rates[1]))
    return {"raw_send_gbps": best[0], "raw_recv_gbps": best[1]}


def run_raw_peer(args) -> None:
    store = host_store(args.host, 0, None)
    print(store.port, flush=True)
    for rep in range(args.repeats):
        raw_peer(dist.PrefixStore(f"rep{rep}/", store), args.host, args.nbytes, args.count)


def _json_of(done: subprocess.CompletedProcess) -> dict:
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_hosts(args, layout: BlockLayout, n_blocks: int) -> None:
    """The driver (see the module docstring): one JSON line per rate in `args.rates` (Gbit/s)."""
    import tempfile

    from kvferry.deploy.redis_server import (
        new_password,
        redis_server_argv,
        wait_for_redis,
        write_redis_config,
    )
    from kvferry.deploy.testhosts import LinkShape, TestHosts

    py, common = (
        sys.executable,
        ["--layout", ",".join(map(str, layout.to_list())), "--repeats", str(args.repeats)],
    )
    nbytes, count = args.batch_blocks * layout.block_bytes, n_blocks // args.batch_blocks
    with (
        TestHosts(3, ["0", "1", ""], prefix="kvxfer", subnet=7) as hosts,
        tempfile.TemporaryDirectory(dir="/var/tmp") as tmp,
    ):
        clients, pool, head = hosts[1], hosts[2], hosts[3]
        password = new_password()  # off loopback, redis admits only clients with its password
        # (the config in /var/tmp: each host has its own /tmp)
        conf, _ = write_redis_config(Path(tmp) / "redis.conf", password)
        head.popen(redis_server_argv(head.address, REDIS_PORT, config=conf), stdout=subprocess.DEVNULL)
        url = wait_for_redis(head.address, REDIS_PORT, time.monotonic() + 20, password=password)
        pool.popen(
            [
                py,
                "-m",
                "kvferry.kvpool",
                "--node-id",
                NODE_ID,
                "--host",
                pool.address,
                "--redis-url",
                url,
                "--layout",
                common[1],
                "--num-slots",
                str(n_blocks + 1024),
            ],
        )
        for i, gbit in enumerate(float(r) for r in args.rates.split(",")):
            for h in hosts.hosts:
                hosts.shape(h, LinkShape(rate_mbit=gbit * 1000))
            sent0, recv0 = clients.counters()
            peer = pool.popen(
                [
                    py,
                    SCRIPT,
                    "--role",
                    "raw-peer",
                    "--host",
                    pool.address,
                    "--nbytes",
                    str(nbytes),
                    "--count",
                    str(count),
                    *common,
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            store = f"{pool.address}:{int(peer.stdout.readline())}"
            raw = _json_of(
                clients.run(
                    [
                        py,
                        SCRIPT,
                        "--role",
                        "raw",
                        "--host",
                        clients.address,
                        "--store",
                        store,
                        "--nbytes",
                        str(nbytes),
                        "--count",
                        str(count),
                        *common,
                    ],
                    timeout=900,
                )
            )
            peer.wait(60)
            got = _json_of(
                clients.run(
                    [
                        py,
                        SCRIPT,
                        "--role",
                        "pool-client",
                        "--host",
                        clients.address,
                        "--redis-url",
                        url,
                        "--blocks",
                        str(n_blocks),
                        "--batch-blocks",
                        str(args.batch_blocks),
                        "--tag",
                        str(i),
                        *common,
                    ],
                    timeout=900,
                )
            )
            sent1, recv1 = clients.counters()
            raw_gbps = max(raw["raw_send_gbps"], raw["raw_recv_gbps"])
            print_result(
                {
                    "link_gbit": gbit,
                    "hosts": "clients on host 1 (core 0), the pool node on host 2 (core 1), redis on host 3",
                    "total_mb": round(n_blocks * layout.block_bytes / 2**20),
                    "batch_blocks": args.batch_blocks,
                    "pool_put_gbps": round(got["pool_put_gbps"], 3),
                    "pool_get_gbps": round(got["pool_get_gbps"], 3),
                    "raw_gloo_send_gbps": round(raw["raw_send_gbps"], 3),
                    "raw_gloo_recv_gbps": round(raw["raw_recv_gbps"], 3),
                    "put_ratio": round(got["pool_put_gbps"] / raw["raw_send_gbps"], 3),
                    "get_ratio": round(got["pool_get_gbps"] / raw["raw_recv_gbps"], 3),
                    "raw_vs_line_rate": round(raw_gbps / (gbit / 8), 3),
                    "link_mb_sent": round((sent1 - sent0) / 2**20),
                    "link_mb_received": round((recv1 - recv0) / 2**20),
                    "slab_mapped_across_hosts": got["slab_mapped"],
                }
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["pool-client", "raw", "raw-peer"], required=True)
    ap.add_argument("--host", required=True, help="this host's address")
    ap.add_argument("--layout", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--redis-url", default="")
    ap.add_argument("--blocks", type=int, default=0)
    ap.add_argument("--batch-blocks", type=int, default=64)
    ap.add_argument("--tag", type=int, default=0)
    ap.add_argument("--store", default="")
    ap.add_argument("--nbytes", type=int, default=0)
    ap.add_argument("--count", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core per host
    layout = BlockLayout.from_list(args.layout.split(","))
    if args.role == "raw-peer":
        run_raw_peer(args)
    elif args.role == "raw":
        print(json.dumps(run_raw(args)))
    else:
        print(json.dumps(run_pool_client(args, layout)))


if __name__ == "__main__":
    main()
