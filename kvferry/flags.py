"""Command-line flags derived from a config dataclass, so each setting is spelled once: its field (name,
type, default) and, in the field's metadata, its help text, its choices, and another flag name.

- `add_config_args(parser, Config)`: one flag per field, `--field-name` (or `metadata["flag"]`); a bool
  is `--x/--no-x`, a tuple a repeatable flag, `T | None` a flag of type T whose absence means None.
- `config_from(args, Config, **overrides)`: the parsed flags back into the dataclass.
- `config_flags(config)`: the flags that parse back into `config` (how a launcher spells it).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Collection
from dataclasses import MISSING, fields


def _kind(hint) -> type:
    """The flag's value type of a field's type hint: int for `int | None`, tuple for `tuple[str, ...]`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return typing.get_origin(hint) or hint


def _default(f):
    return f.default_factory() if f.default is MISSING else f.default


def _flag(f) -> str:
    return "--" + f.metadata.get("flag", f.name.replace("_", "-"))


def add_config_args(p: argparse.ArgumentParser, cls, skip: Collection[str] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        kind = _kind(hints[f.name])
        kw: dict = {"dest": f.name, "default": _default(f), "help": f.metadata.get("help")}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif kind is tuple:
            kw |= {"action": "append", "default": None}
        else:
            kw["type"] = kind
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        p.add_argument(_flag(f), **kw)


def config_from(args: argparse.Namespace, cls, **overrides):
    """`cls` from the flags `add_config_args` added (fields it skipped keep their defaults unless given
    in `overrides`)."""
    values = {}
    for f in fields(cls):
        if f.name in overrides or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if isinstance(value, list):  # a repeated flag
            value = tuple(value)
        elif value is None and isinstance(_default(f), tuple):  # never given
            value = _default(f)
        values[f.name] = value
    return cls(**values, **overrides)


def config_flags(config, skip: Collection[str] = ()) -> list[str]:
    """The flags that `add_config_args` parses back into `config` (fields at None are left out)."""
    out: list[str] = []
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in skip or value is None:
            continue
        flag = _flag(f)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return out
