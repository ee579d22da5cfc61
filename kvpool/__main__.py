"""`python -m kvferry.kvpool`: the command line that runs one pool node (`node.PoolNode`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kvferry.kvpool.metadata import add_redis_url_arg
from kvferry.kvpool.node import PoolNode, PoolNodeConfig
from kvferry.kvpool.transfer import BlockLayout
from kvferry.rpc import hard_exit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvferry.kvpool", description="run one KV pool node")
    p.add_argument("--node-id", default="")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--store-port", type=int, default=0)
    p.add_argument("--num-slots", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    add_redis_url_arg(p)
    p.add_argument("--namespace", default="default")
    p.add_argument("--layout", required=True, help="num_layers,num_kv_heads,block_size,head_dim,dtype")
    p.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=PoolNodeConfig.transfer_timeout_s,
        help="the longest wait on a peer's transfer (a client that died or hangs)",
    )
    p.add_argument(
        "--private-ttl-s",
        type=float,
        default=PoolNodeConfig.private_ttl_s,
        help="free a request's private tail block this long after it was written if nobody read or "
        "released it (its router died before the decode started)",
    )
    p.add_argument(
        "--no-shm",
        action="store_true",
        help="keep the slab in private memory: clients on this host then use the pair group too",
    )
    p.add_argument(
        "--reserve-ttl-s",
        type=float,
        default=PoolNodeConfig.reserve_ttl_s,
        help="slots a client reserved go back to the pool this long after its last reserve or put",
    )
    p.add_argument(
        "--disk-dir",
        default="",
        help="spill evicted blocks to files here (one directory per node; kept across restarts)",
    )
    p.add_argument("--disk-max-gib", type=float, default=0.0, help="the disk tier's size (with --disk-dir)")
    p.add_argument(
        "--hot-reads",
        type=int,
        default=PoolNodeConfig.hot_reads,
        help="a block read over the network this many times within --hot-window-s is copied to other "
        "nodes (0: never)",
    )
    p.add_argument("--hot-window-s", type=float, default=PoolNodeConfig.hot_window_s)
    p.add_argument(
        "--hot-replicas", type=int, default=PoolNodeConfig.hot_replicas, help="copies a hot block gets"
    )
    args = p.parse_args(argv)
    if bool(args.disk_dir) != (args.disk_max_gib != 0):
        p.error("--disk-dir and --disk-max-gib go together")
    if args.disk_dir and args.disk_max_gib <= 0:
        p.error("--disk-max-gib must be > 0")
    if args.hot_reads < 0 or args.hot_window_s <= 0 or args.hot_replicas < 1:
        p.error("--hot-reads must be >= 0, --hot-window-s > 0 and --hot-replicas >= 1")
    if args.private_ttl_s <= 0:
        p.error("--private-ttl-s must be > 0")
    if args.reserve_ttl_s <= 2 * args.transfer_timeout_s:
        p.error(
            "--reserve-ttl-s must exceed twice --transfer-timeout-s (a client writes only in its first half)"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pool %(levelname)s %(message)s")
    layout = BlockLayout.from_list(args.layout.split(","))
    cfg = PoolNodeConfig(
        node_id=args.node_id,
        host=args.host,
        port=args.port,
        store_port=args.store_port,
        num_slots=args.num_slots,
        device=args.device,
        redis_url=args.redis_url,
        namespace=args.namespace,
        transfer_timeout_s=args.transfer_timeout_s,
        private_ttl_s=args.private_ttl_s,
        reserve_ttl_s=args.reserve_ttl_s,
        shm=not args.no_shm,
        disk_dir=args.disk_dir,
        disk_max_gib=args.disk_max_gib,
        hot_reads=args.hot_reads,
        hot_window_s=args.hot_window_s,
        hot_replicas=args.hot_replicas,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    PoolNode(cfg, layout).serve(stop)
    hard_exit(0)


if __name__ == "__main__":
    sys.exit(main())
