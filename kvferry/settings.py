"""Every environment variable kvferry reads, in one typed place (nothing else calls os.getenv)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

API_KEY_ENV = "KVFERRY_API_KEY"  # the router's API keys, comma-separated (`kvferry up` hands them on so)


def bare_keys(specs) -> list[str]:
    """The keys of API key specs (`KEY` or `KEY:option=value:...`, kvferry.auth.split_key_spec): what
    clients send, options left off."""
    return [spec.split(":", 1)[0] for spec in specs if spec]


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
