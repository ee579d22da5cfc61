"""`python -m kvferry.kvpool`: the command line that runs one pool node (`node.PoolNode`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kvferry.flags import add_config_args, config_from
from kvferry.kvpool.metadata import add_redis_url_arg
from kvferry.kvpool.node import PoolNode, PoolNodeConfig
from kvferry.kvpool.transfer import BlockLayout
from kvferry.rpc import hard_exit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvferry.kvpool", description="run one KV pool node")
    add_config_args(p, PoolNodeConfig, skip={"redis_url"})
    add_redis_url_arg(p)
    p.add_argument("--layout", required=True, help="num_layers,num_kv_heads,block_size,head_dim,dtype")
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
    cfg = config_from(args, PoolNodeConfig)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    PoolNode(cfg, layout).serve(stop)
    hard_exit(0)


if __name__ == "__main__":
    sys.exit(main())
