"""The redis-server a launcher starts (the registry and the pool's metadata: a cache, never persisted),
and the secrets around it.

The server asks for a password (`requirepass`), read from a config file only its owner can read, so
the password never shows in `ps`; it binds the cluster-internal host in protected mode. The URL the
components get carries the password (`redis://:PASSWORD@host:port/0`); what is printed or logged
shows it masked (`mask_url`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from pathlib import Path


class LaunchError(RuntimeError):
    """A component that cannot start (the message says why and, for a child, shows its log)."""


def redis_server_argv(
    host: str, port: int, workdir: Path | None = None, config: Path | None = None
) -> list[str]:
    """A throwaway redis-server on host:port: no persistence (the metadata is a cache). `config`: a file
    of further settings read first (`write_redis_config`: the password)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise LaunchError("redis-server is not installed (apt-get install redis-server), or pass --redis-url")
    argv = [binary, *([str(config)] if config is not None else [])]
    argv += ["--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]
    argv += ["--protected-mode", "yes"]
    return argv + (["--dir", str(workdir)] if workdir is not None else [])


def new_password() -> str:
    return secrets.token_hex(24)  # hex: safe in a URL and in redis.conf without quoting


def write_private(path: Path, text: str) -> Path:
    """Write `text` to `path`, readable by its owner only (0600 from the start, never wider)."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a file left by an earlier run may have other permissions
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return path


def write_redis_config(path: Path, password: str) -> Path:
    return write_private(path, f"requirepass {password}\n")


def redis_url(host: str, port: int, password: str | None = None) -> str:
    auth = f":{password}@" if password else ""
    return f"redis://{auth}{host}:{port}/0"


def wait_for_redis(host: str, port: int, deadline: float, check=None, password: str | None = None) -> str:
    """Poll until the server answers PING (calling `check()` between tries); returns its URL (with the
    password)."""
    import redis

    client = redis.Redis(host=host, port=port, password=password)
    while True:
        if check is not None:
            check()
        with contextlib.suppress(redis.RedisError):
            client.ping()
            return redis_url(host, port, password)
        if time.monotonic() > deadline:
            raise LaunchError(f"redis-server on {host}:{port} did not start in time")
        time.sleep(0.05)
