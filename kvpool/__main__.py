"""`python -m kvferry.kvpool`: the command line that runs one pool node (`node.PoolNode`); its flags are
the fields of `config.PoolConfig` (`kvferry.flags`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kvferry.flags import ConfigError, add_config_args, config_from
from kvferry.kvpool.config import PoolConfig
from kvferry.kvpool.metadata import add_redis_url_arg
from kvferry.kvpool.node import PoolNode
from kvferry.kvpool.transfer import BlockLayout
from kvferry.rpc import hard_exit


def parser() -> argparse.ArgumentParser:
    """A pool node's command line: PoolConfig's fields (`kvferry.flags`), the Redis URL and the layout."""
    p = argparse.ArgumentParser(prog="python -m kvferry.kvpool", description="run one KV pool node")
    add_config_args(p, PoolConfig)
    add_redis_url_arg(p)
    p.add_argument("--layout", required=True, help="num_layers,num_kv_heads,block_size,head_dim,dtype")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        cfg = config_from(args, PoolConfig)
    except ConfigError as err:
        p.error(str(err))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pool %(levelname)s %(message)s")
    layout = BlockLayout.from_list(args.layout.split(","))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    PoolNode(cfg, layout).serve(stop)
    hard_exit(0)


if __name__ == "__main__":
    sys.exit(main())
