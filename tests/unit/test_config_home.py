"""Each component's config dataclass is the one declaration of its settings: a field added to it (and
nothing else edited) is a `kvferry up` flag, a cluster-file key and a flag in the launched process's
command line, which that process's own parser reads back. And every `--flag` a help text names exists
on that parser (help text and flags cannot drift apart)."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import field, make_dataclass

import pytest

from kvferry.deploy import config as deploy_config
from kvferry.deploy.config import cluster_config_from_dict, cluster_config_to_dict, up_settings
from kvferry.engine.engine import EngineConfig
from kvferry.flags import config_from, meta
from kvferry.kvpool.config import PoolConfig
from kvferry.kvpool.transfer import BlockLayout
from kvferry.router.config import RouterConfig


def grown(monkeypatch, cls, name: str, kind: type, default, help_text: str):
    """`cls` with one more field, bound wherever kvferry's modules name `cls` (what editing the class
    would do); `kvferry up`'s cached flag table is rebuilt."""
    sub = make_dataclass(
        cls.__name__,
        [(name, kind, field(default=default, metadata=meta(help_text)))],
        bases=(cls,),
        frozen=True,
    )
    sub.__module__ = cls.__module__
    for module in [m for n, m in sys.modules.items() if n.startswith("kvferry") and m is not None]:
        for attr, value in list(vars(module).items()):
            if value is cls:
                monkeypatch.setattr(module, attr, sub)
    up_settings.cache_clear()
    return sub


@pytest.fixture(autouse=True)
def fresh_up_table():
    up_settings.cache_clear()
    yield
    up_settings.cache_clear()


def up_values(argv: list[str]) -> dict:
    """`kvferry up ARGV` parsed by the CLI's own parser: the setting flags `_cmd_up` hands on."""
    from kvferry.cli import build_parser

    args = build_parser().parse_args(["up", *argv])
    return {dest: getattr(args, dest) for dest in up_settings()}


def test_a_router_field_is_a_flag_a_file_key_and_in_the_routers_argv(monkeypatch):
    from kvferry.deploy.local import router_argv
    from kvferry.router import server

    sub = grown(monkeypatch, RouterConfig, "queue_depth_x", int, 3, "a new router setting")
    cfg = cluster_config_from_dict({"router": {"queue_depth_x": 5, "port": 6000}})  # a cluster-file key
    assert (type(cfg.router), cfg.router.queue_depth_x) == (sub, 5)
    assert cluster_config_from_dict(cluster_config_to_dict(cfg)) == cfg
    cfg = cfg.with_overrides(**up_values(["--queue-depth-x", "7"]))  # a kvferry up flag (unprefixed)
    assert (cfg.router.queue_depth_x, cfg.router.port) == (7, 6000)
    argv = router_argv(cfg, "tiny", "127.0.0.1", 6000, None)  # the launched process's command line
    assert argv[argv.index("--queue-depth-x") + 1] == "7"
    monkeypatch.setenv("KVFERRY_REDIS_URL", "redis://h:1/0")
    back = config_from(server.parser().parse_args(argv[3:]), sub)
    assert back.queue_depth_x == 7 and back.http_port is None and back.port == 6000


def test_a_pool_field_is_a_flag_a_file_key_and_in_each_nodes_argv(monkeypatch):
    from kvferry.deploy.local import pool_argv
    from kvferry.kvpool import __main__ as pool_main

    sub = grown(monkeypatch, PoolConfig, "scrub_every_s", float, 1.5, "a new pool setting")
    cfg = cluster_config_from_dict({"pool": {"scrub_every_s": 2.5, "nodes": 2}})
    assert (type(cfg.pool), cfg.pool.scrub_every_s, cfg.pool.nodes) == (sub, 2.5, 2)
    assert cluster_config_from_dict(cluster_config_to_dict(cfg)) == cfg
    cfg = cfg.with_overrides(**up_values(["--pool-scrub-every-s", "4"]))  # under the pool's prefix
    assert cfg.pool.scrub_every_s == 4.0
    layout = BlockLayout(num_layers=2, num_kv_heads=2, block_size=16, head_dim=8, dtype="float32")
    argv = pool_argv(cfg, layout, "pool-1", "127.0.0.1")
    assert argv[argv.index("--scrub-every-s") + 1] == "4.0" and "--nodes" not in argv  # a cluster setting
    monkeypatch.setenv("KVFERRY_REDIS_URL", "redis://h:1/0")
    back = config_from(pool_main.parser().parse_args(argv[3:]), sub)
    assert (back.scrub_every_s, back.node_id) == (4.0, "pool-1")


def test_an_engine_field_is_a_flag_a_group_key_and_in_every_workers_argv(monkeypatch):
    from kvferry.decode_worker.worker import ROLE
    from kvferry.deploy.local import worker_argv
    from kvferry.worker.runtime import worker_parser

    sub = grown(monkeypatch, EngineConfig, "warmup_steps_x", int, 0, "a new engine setting")
    cfg = cluster_config_from_dict({"decode": {"warmup_steps_x": 2}})  # a group's key
    assert (
        cfg.engine_config("decode").warmup_steps_x == 2 and cfg.engine_config("prefill").warmup_steps_x == 0
    )
    assert cluster_config_from_dict(cluster_config_to_dict(cfg)) == cfg
    over = cfg.with_overrides(**up_values(["--warmup-steps-x", "3"]))  # every group's
    assert [over.engine_config(r).warmup_steps_x for r in ("prefill", "decode")] == [3, 3]
    over = cfg.with_overrides(**up_values(["--warmup-steps-x", "3", "--prefill-warmup-steps-x", "5"]))
    assert [over.engine_config(r).warmup_steps_x for r in ("prefill", "decode")] == [5, 3]  # one role's
    argv = worker_argv(over, "decode", 0, "decode-0", "tiny", "127.0.0.1")
    assert argv[argv.index("--warmup-steps-x") + 1] == "3"
    monkeypatch.setenv("KVFERRY_REDIS_URL", "redis://h:1/0")
    assert config_from(worker_parser(ROLE).parse_args(argv[3:]), sub).warmup_steps_x == 3


def test_the_existing_up_flags_keep_their_names_and_meaning(tmp_path):
    cfg = cluster_config_from_dict({}).with_overrides(
        **up_values(
            [
                *("--served-model-name", "a", "b", "--max-inflight", "9", "--no-http", "--api-key", "k"),
                *("--prefill-replicas", "2", "--decode-expert-parallel-size", "2", "--speculative-config"),
                '{"method": "ngram", "num_speculative_tokens": 2}',
                *("--prefill-tensor-parallel-size", "2", "--kv-cache-dtype", "int8", "--autoscale"),
                *("--autoscale-prefill", "1:3", "--autoscale-cooldown-s", "5", "--on-predicted-miss"),
                *("deprioritize", "--pool-memory-gib", "0.5", "--restarts-max", "2", "--colocated"),
            ]
        )
    )
    router = cfg.router
    assert (router.served_model_name, router.max_inflight, router.http_port) == (("a", "b"), 9, None)
    assert (router.api_keys, router.on_predicted_miss) == (("k",), "deprioritize")
    assert (cfg.prefill.replicas, cfg.group_size("prefill"), cfg.group_size("decode")) == (2, 2, 2)
    assert "speculative_config" in cfg.decode.engine and "speculative_config" not in cfg.prefill.engine
    assert cfg.engine_config("prefill").kv_cache_dtype == cfg.engine_config("decode").kv_cache_dtype == "int8"
    assert (cfg.autoscale.enabled, cfg.autoscale.prefill, cfg.autoscale.cooldown_s) == (True, (1, 3), 5.0)
    assert (cfg.pool.memory_gib, cfg.restarts.max, cfg.colocated) == (0.5, 2, True)
    assert cluster_config_from_dict({}).with_overrides(**up_values([])) == cluster_config_from_dict({})


def _parsers():
    """Every command line kvferry has: each `kvferry` subcommand, and each process a launcher starts."""
    from kvferry.cli import build_parser
    from kvferry.decode_worker.worker import ROLE as DECODE
    from kvferry.kvpool import __main__ as pool_main
    from kvferry.prefill_worker.worker import ROLE as PREFILL
    from kvferry.router import server
    from kvferry.worker.runtime import worker_parser

    def walk(p: argparse.ArgumentParser, name: str):
        yield name, p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    yield from walk(sub, f"{name} {sub_name}")

    yield from walk(build_parser(), "kvferry")
    yield "router", server.parser()
    yield "pool node", pool_main.parser()
    yield "prefill worker", worker_parser(PREFILL)
    yield "decode worker", worker_parser(DECODE)


FLAG = re.compile(r"(?<![\w-])--[a-z0-9]+(?:-[a-z0-9]+)*(?![\w<-])")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


@pytest.mark.parametrize("name, parser", list(_parsers()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_flag_a_help_text_names_exists_on_its_parser(name, parser):
    options = _options(parser)
    if name == "kvferry":  # the overview of the subcommands names theirs
        options = set().union(*(_options(p) for n, p in _parsers() if n.startswith("kvferry")))
    texts = [parser.description or ""]
    texts += [g.description or "" for g in parser._action_groups]
    texts += [a.help for a in parser._actions if isinstance(a.help, str)]
    named = {m for text in texts for m in FLAG.findall(text)}
    assert named <= options, f"{name}: help names {sorted(named - options)}, which it does not have"


def test_each_section_is_read_from_its_fields_only():
    with pytest.raises(deploy_config.ClusterConfigError, match="redis_url"):  # a launcher's, not a key
        cluster_config_from_dict({"router": {"redis_url": "redis://x"}})
    with pytest.raises(deploy_config.ClusterConfigError, match="node_id"):
        cluster_config_from_dict({"pool": {"node_id": "p"}})
    assert cluster_config_from_dict({"router": {"served_model_name": "one"}}).router.served_model_name == (
        "one",
    )
