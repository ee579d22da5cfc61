"""Engine flags: the EngineConfig fields as command-line options (`kvferry.flags`; shared by `kvferry
generate`, the workers and the launchers, which spell an EngineConfig back with `config_flags`)."""

from __future__ import annotations

import argparse

from kvferry.engine.engine import EngineConfig
from kvferry.flags import add_config_args, config_from


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p, EngineConfig)


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return config_from(args, EngineConfig)
