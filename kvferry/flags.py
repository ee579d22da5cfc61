"""Command-line flags derived from a config dataclass, so each setting is spelled once: its field (name,
type, default) and, in the field's metadata, its help text, its choices, and another flag name.

- `add_config_args(parser, Config)`: one flag per field, `--field-name` (or `metadata["flag"]`); a bool
  is `--x/--no-x`, a tuple a repeatable flag that takes one value or several, `T | None` a flag of type T
  whose absence means None.
- `config_from(args, Config, **overrides)`: the parsed flags back into the dataclass.
- `config_flags(config)`: the flags that parse back into `config` (how a launcher spells it; a mapping
  value as JSON).

One config serves three audiences: the component's own process (its flags), the cluster file (a section
whose keys are the fields: `section`, `section_dict`) and `kvferry up` (the same fields as flags, under a
prefix such as `--pool-`, that override the file: `unset=True` parsers, whose flags default to None = not
given; see `deploy.config.add_up_args`). Field metadata says where a field goes:

- `help`, `choices`, `metavar`: the flag's; `flag`: its name without `--` (a name that starts with `--`
  is taken whole, never prefixed); `flag: None`: no flag at all.
- `parse` / `spell`: a value's text and back, for a field no plain type converts (`MIN:MAX` bounds).
- `none_flag`, `none_help`: the flag that sets a `T | None` field to None (`--no-http`: the router's
  http_port), and its help.
- `LAUNCHER`: set per process by the launcher (a process's id, its port, the cluster's model): a flag of
  the process, but neither a cluster-file key nor a `kvferry up` flag (the cluster-level one is).
- `CLUSTER`: a cluster-level setting (the cluster file and `kvferry up`) that the component's process
  does not take (how many pool nodes run).
- `SECRET`: never spelled on a command line (`ps` shows it): the launcher hands it on in the environment.
- `roles`: an engine setting only these worker roles take (`kvferry up` applies it to their groups).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Collection
from dataclasses import MISSING, fields

LAUNCHER = "launcher"
CLUSTER = "cluster"
SECRET = "secret"

PROCESS = "process"  # the component's own command line: every field but CLUSTER ones
SETTINGS = "settings"  # the cluster file and `kvferry up`: every field but LAUNCHER ones


class ConfigError(ValueError):
    """A setting that is missing, unknown or out of range (the message names it)."""


class _Off:
    """What a `none_flag` stores: the field was set to None (a plain None means: not given)."""

    def __repr__(self) -> str:
        return "OFF"


OFF = _Off()


def meta(help: str | None = None, **more) -> dict:
    """A field's metadata: `field(default=..., metadata=meta("what it does", choices=...))`."""
    return {"help": help, **more}


def _kind(hint) -> type:
    """The flag's value type of a field's type hint: int for `int | None`, tuple for `tuple[str, ...]`,
    str for `str | dict | None` (the first)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def kinds(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: _kind(hints[f.name]) for f in fields(cls)}


def default_of(f):
    return f.default_factory() if f.default is MISSING else f.default


def has_flag(f, kind: type) -> bool:
    """Whether a field is a flag at all: scalars, tuples and what `parse` converts (not a nested section,
    a mapping, or a field whose metadata says `flag: None`)."""
    if "flag" in f.metadata and f.metadata["flag"] is None:
        return False
    return "parse" in f.metadata or kind in (str, int, float, bool, tuple)


def in_scope(f, scope: str) -> bool:
    return not f.metadata.get(CLUSTER if scope == PROCESS else LAUNCHER, False)


def flag_of(f, prefix: str = "") -> str:
    name = f.metadata.get("flag") or f.name.replace("_", "-")
    if name.startswith("--"):
        return name
    return f"--{prefix}-{name}" if prefix else f"--{name}"


def dest_of(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_config_args(
    p,
    cls,
    skip: Collection[str] = (),
    *,
    only: Collection[str] | None = None,
    prefix: str = "",
    scope: str = PROCESS,
    unset: bool = False,
    roles: str | None = None,
    brief: bool = False,
) -> dict[str, dataclasses.Field]:
    """Add `cls`'s flags to `p` (a parser or an argument group); returns {dest: field}.

    `prefix`: flags `--<prefix>-<name>`. `scope`: PROCESS (the component's own flags) or SETTINGS (the
    cluster's). `unset`: every flag defaults to None (not given: the file's value holds). A flag's dest
    is its name (`--pool-nodes` -> pool_nodes, `--engine-seed` -> engine_seed): several configs share a
    parser. `roles`: only the fields whose `roles` metadata admits this role. `brief`: no help text (a
    copy of flags shown before). `only`: these fields alone.
    """
    added = {}
    kind_of = kinds(cls)
    for f in fields(cls):
        kind = kind_of[f.name]
        if f.name in skip or (only is not None and f.name not in only):
            continue
        if not in_scope(f, scope) or not has_flag(f, kind):
            continue
        if roles is not None and roles not in f.metadata.get("roles", (roles,)):
            continue
        flag = flag_of(f, prefix)
        dest = dest_of(flag)
        default = None if unset else default_of(f)
        text = None if brief else f.metadata.get("help")
        if unset and text is not None and default_of(f) not in (None, ()) and "(default" not in text:
            shown = ("on" if default_of(f) else "off") if kind is bool else _spell(f, default_of(f))
            text += f" (default {shown})"
        kw: dict = {"dest": dest, "default": default, "help": text}
        if kind is not bool and "choices" not in f.metadata:
            kw["metavar"] = f.name.upper()
        if "parse" in f.metadata:
            kw["type"] = str if unset else f.metadata["parse"]
        elif kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif kind is tuple:
            kw |= {"action": "extend", "nargs": "+", "default": None}
        else:
            kw["type"] = kind
        for key in ("choices", "metavar"):
            if key in f.metadata:
                kw[key] = f.metadata[key]
        p.add_argument(flag, **kw)
        if "none_flag" in f.metadata:
            off = f.metadata["none_flag"]
            p.add_argument(
                "--" + off,
                dest=dest,
                action="store_const",
                const=OFF,
                help=None if brief else f.metadata.get("none_help", f"set {flag} to none"),
            )
        added[dest] = f
    return added


def parsed_value(f, value):
    """A parsed flag's value as the field holds it."""
    if value is OFF:
        return None
    if isinstance(value, list):  # a repeated flag
        return tuple(value)
    if value is None and isinstance(default_of(f), tuple):  # never given
        return default_of(f)
    return value


def config_from(args: argparse.Namespace, cls, prefix: str = "", **overrides):
    """`cls` from the flags `add_config_args` added (fields it skipped keep their defaults unless given
    in `overrides`)."""
    values = {}
    for f in fields(cls):
        dest = dest_of(flag_of(f, prefix)) if f.metadata.get("flag", "") is not None else f.name
        if f.name in overrides or not hasattr(args, dest):
            continue
        values[f.name] = parsed_value(f, getattr(args, dest))
    return cls(**values, **overrides)


def convert(f, value, name: str):
    """A flag's text (or a cluster file's value) as the field holds it (`parse` metadata, which takes
    both): its error names the flag."""
    if "parse" in f.metadata and value is not None:
        try:
            return f.metadata["parse"](value)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{name}: {err}") from None
    return value


def _spell(f, value) -> str:
    if "spell" in f.metadata:
        return f.metadata["spell"](value)
    if isinstance(value, dict):  # e.g. speculative_config given as a mapping (a cluster file)
        return json.dumps(value)
    return str(value)


def config_flags(
    config,
    skip: Collection[str] = (),
    *,
    only: Collection[str] | None = None,
    prefix: str = "",
    scope: str = PROCESS,
) -> list[str]:
    """The flags that `add_config_args` (with the same `only`, `prefix` and `scope`) parses back into
    `config`: a process's command line. Fields at None are left out, and so are SECRET ones."""
    out: list[str] = []
    kind_of = kinds(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in skip or (only is not None and f.name not in only) or f.metadata.get(SECRET):
            continue
        if not in_scope(f, scope) or not has_flag(f, kind_of[f.name]):
            continue
        flag = flag_of(f, prefix)
        if value is None:
            if "none_flag" in f.metadata and default_of(f) is not None:
                out.append("--" + f.metadata["none_flag"])
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple) and "spell" not in f.metadata:
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, _spell(f, value)]
    return out


def settings_of(cls) -> list[dataclasses.Field]:
    """The fields of `cls` that are cluster settings (the cluster file's keys of its section)."""
    return [f for f in fields(cls) if in_scope(f, SETTINGS)]


def section(cls, values: dict, name: str):
    """`cls` from a cluster file's section `name`: only its settings are keys; a tuple field takes a
    list or one value; a bad key or value is a ConfigError that names it."""
    if not isinstance(values, dict):
        raise ConfigError(f"{name}: expected a mapping")
    known = {f.name for f in settings_of(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"{name}: unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
    kind_of = kinds(cls)
    out = {}
    for f in settings_of(cls):
        if f.name not in values or (values[f.name] is None and "parse" in f.metadata):  # null: the default
            continue
        value = convert(f, values[f.name], f"{name}.{f.name}")
        if kind_of[f.name] is tuple and "parse" not in f.metadata:
            value = () if value is None else (value,) if isinstance(value, str) else tuple(value)
        out[f.name] = value
    try:
        return cls(**out)
    except TypeError as err:
        raise ConfigError(f"{name}: {err}") from None


def section_dict(config) -> dict:
    """The cluster-file section of `config` (`section` reads it back): its settings, tuples as lists."""
    out = {}
    for f in settings_of(type(config)):
        value = getattr(config, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
