"""Every environment variable kvferry reads, in one typed place (nothing else calls os.getenv)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    num_threads: int | None

    @property
    def models_dir(self) -> Path:
        return self.cache_dir / "models"


def load_settings() -> Settings:
    """Read KVFERRY_* variables; called at use time, never at import time."""
    cache = os.environ.get("KVFERRY_CACHE_DIR") or str(Path.home() / ".cache" / "kvferry")
    threads = os.environ.get("KVFERRY_NUM_THREADS")
    return Settings(cache_dir=Path(cache).expanduser(), num_threads=int(threads) if threads else None)
