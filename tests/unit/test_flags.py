"""Flags derived from config dataclasses (kvferry/flags.py): every field is a flag with the field's default,
and a config spelled as flags parses back into the same config (the router's and the pool node's)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace

import pytest

from kvferry.flags import add_config_args, config_flags, config_from
from kvferry.kvpool.node import PoolNodeConfig
from kvferry.router.server import RouterConfig


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


@pytest.mark.parametrize("cls", [RouterConfig, PoolNodeConfig])
def test_the_router_and_pool_node_configs_round_trip(cls):
    skip = {"redis_url"}  # its flag comes from add_redis_url_arg (the environment's URL by default)
    changed = {}
    for f in fields(cls):
        value = getattr(cls(), f.name)
        if f.name in skip:
            continue
        if isinstance(value, bool):
            changed[f.name] = not value
        elif isinstance(value, (int, float)) and f.name != "http_port":
            changed[f.name] = value + 1
    config = replace(cls(), **changed)
    assert config_from(parse(cls, config_flags(config, skip), skip), cls) == config


def test_the_router_event_loop_flag():
    uvloop = pytest.importorskip("uvloop")  # a base dependency: installed wherever kvferry is
    from kvferry.router.server import loop_factory

    assert config_from(parse(RouterConfig, ["--event-loop", "asyncio"]), RouterConfig).event_loop == "asyncio"
    with pytest.raises(argparse.ArgumentError):
        parse(RouterConfig, ["--event-loop", "trio"])
    assert loop_factory("asyncio") is None  # asyncio's own loop
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("auto") is uvloop.new_event_loop
