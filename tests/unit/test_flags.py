"""Flags derived from config dataclasses (kvferry/flags.py): every field is a flag with the field's default,
and a config spelled as flags parses back into the same config (the router's and the pool node's)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace

import pytest

from kvferry.flags import add_config_args, config_flags, config_from
from kvferry.kvpool.config import PoolConfig
from kvferry.router.config import RouterConfig


@dataclass(frozen=True)
class Sample:
    name: str = "x"
    count: int = 3
    ratio: float = 0.5
    on: bool = True
    limit: int | None = None
    tags: tuple[str, ...] = ()
    mode: str = field(default="a", metadata={"choices": ("a", "b"), "help": "which", "flag": "the-mode"})


def parse(cls, argv: list[str], skip=()):
    p = argparse.ArgumentParser(exit_on_error=False)
    add_config_args(p, cls, skip)
    return p.parse_args(argv)


def test_defaults_types_and_the_round_trip():
    assert config_from(parse(Sample, []), Sample) == Sample()
    got = config_from(
        parse(
            Sample,
            ["--count", "7", "--no-on", "--limit", "4", "--tags", "p", "--tags", "q", "--the-mode", "b"],
        ),
        Sample,
    )
    assert got == Sample(count=7, on=False, limit=4, tags=("p", "q"), mode="b")
    assert config_from(parse(Sample, config_flags(got)), Sample) == got
    assert "--limit" not in config_flags(Sample())  # None: left out
    with pytest.raises(argparse.ArgumentError):
        parse(Sample, ["--the-mode", "c"])  # choices hold
    with pytest.raises(argparse.ArgumentError):
        parse(Sample, ["--count", "many"])  # types hold


@pytest.mark.parametrize("cls", [RouterConfig, PoolConfig])
def test_the_router_and_pool_node_configs_round_trip(cls):
    # redis_url's flag comes from add_redis_url_arg (the environment's URL by default): never spelled
    changed = {}
    for f in fields(cls):
        value = getattr(cls(), f.name)
        if f.name == "redis_url" or f.metadata.get("cluster"):  # not a flag of the process
            continue
        if isinstance(value, bool):
            changed[f.name] = not value
        elif isinstance(value, (int, float)) and f.name != "http_port":
            changed[f.name] = value + 1
    if cls is PoolConfig:
        changed |= {"disk_dir": "/d", "num_slots": 64, "reserve_ttl_s": 99.0}  # None by default: given here
    config = replace(cls(), **changed)
    assert config_from(parse(cls, config_flags(config)), cls) == config
    if cls is RouterConfig:  # None = off has a flag of its own
        off = replace(config, http_port=None)
        assert "--no-http" in config_flags(off)
        assert config_from(parse(cls, config_flags(off)), cls) == off


def test_the_router_event_loop_flag():
    uvloop = pytest.importorskip("uvloop")  # a base dependency: installed wherever kvferry is
    from kvferry.router.server import loop_factory

    assert config_from(parse(RouterConfig, ["--event-loop", "asyncio"]), RouterConfig).event_loop == "asyncio"
    with pytest.raises(argparse.ArgumentError):
        parse(RouterConfig, ["--event-loop", "trio"])
    assert loop_factory("asyncio") is None  # asyncio's own loop
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("auto") is uvloop.new_event_loop
