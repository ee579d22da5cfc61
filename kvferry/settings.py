"""Every environment variable kvferry reads, in one typed place (nothing else calls os.getenv)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

API_KEY_ENV = "KVFERRY_API_KEY"  # the router's API keys, comma-separated (`kvferry up` hands them on so)


def bare_keys(specs) -> list[str]:
    """The keys of API key specs (`KEY` or `KEY:option=value:...`, split_key_spec): what
    clients send, options left off."""
    return [spec.split(":", 1)[0] for spec in specs if spec]


# what `--api-key KEY:option=value:...` may set for one key (router.admission.KeyPolicy): integers, and
# `cache_group`, a name (keys of one group share cached prompt prefixes: one tenant's several keys)
KEY_OPTIONS = ("min_priority", "max_inflight", "tokens_per_min", "cache_group")
_TEXT_OPTIONS = ("cache_group",)


def split_key_spec(spec: str) -> tuple[str, dict[str, int | str]]:
    """An API key as the router is given it, `KEY` or `KEY:option=value:...` (KEY_OPTIONS), as (the key
    clients send, its options); ValueError naming what is wrong."""
    key, *options = spec.split(":")
    out: dict[str, int | str] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or name not in KEY_OPTIONS:
            want = ", ".join(KEY_OPTIONS)
            raise ValueError(f"API key option {option!r}: expected one of {want} as NAME=VALUE")
        if name in _TEXT_OPTIONS:
            if not value:
                raise ValueError(f"API key option {name}: empty")
            out[name] = value
            continue
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"API key option {name}: {value!r} is not an integer") from None
    if not key:
        raise ValueError("an API key spec without a key")
    return key, out


def read_key_file(path: str) -> tuple[str, ...]:
    """The API key specs of a keys file: one `KEY[:options]` a line; blank lines and lines starting with
    `#` skipped. OSError / ValueError (naming the line) for a file that cannot be used."""
    specs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            split_key_spec(line)
        except ValueError as err:
            raise ValueError(f"{path}:{number}: {err}") from None
        specs.append(line)
    return tuple(specs)


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    num_threads: int | None
    api_keys: tuple[str, ...] = ()  # KVFERRY_API_KEY: what clients of the router send (kvferry up, generate)

    @property
    def models_dir(self) -> Path:
        return self.cache_dir / "models"

    @property
    def client_key(self) -> str | None:
        """The key a client of this environment sends: the first of KVFERRY_API_KEY, options left off."""
        return next(iter(bare_keys(self.api_keys)), None)


def load_settings() -> Settings:
    """Read KVFERRY_* variables; called at use time, never at import time."""
    cache = os.environ.get("KVFERRY_CACHE_DIR") or str(Path.home() / ".cache" / "kvferry")
    threads = os.environ.get("KVFERRY_NUM_THREADS")
    keys = tuple(k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip())
    return Settings(
        cache_dir=Path(cache).expanduser(), num_threads=int(threads) if threads else None, api_keys=keys
    )
