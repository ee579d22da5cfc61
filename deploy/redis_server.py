"""The redis-server a launcher starts (the registry and the pool's metadata: a cache, never persisted),
and the secrets around it.

The server asks for a password (`requirepass`), read from a config file only its owner can read, so
the password never shows in `ps`; it binds the cluster-internal host in protected mode. The URL the
components get carries the password (`redis://:PASSWORD@host:port/0`); what is printed or logged
shows it masked (`mask_url`).

With the cluster's internal TLS on, the server speaks TLS only (`port 0`, `tls-port`): its leaf of the
cluster CA sits beside the config (owner-only), clients check it against the CA and still give the
password (`tls-auth-clients no`: the password is the credential; TLS keeps it and the metadata off
the wire), and the URL is `rediss://`.
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
    host: str,
    port: int,
    workdir: Path | None = None,
    config: Path | None = None,
    tls: list[str] | None = None,
) -> list[str]:
    """A throwaway redis-server on host:port: no persistence (the metadata is a cache). `config`: a file
    of further settings read first (`write_redis_config`: the password). `tls`: the paths of its
    TLS_FILES (cert, key, CA), and the port speaks TLS only."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise LaunchError("redis-server is not installed (apt-get install redis-server), or pass --redis-url")
    argv = [binary, *([str(config)] if config is not None else [])]
    argv += ["--port", str(port)] if tls is None else ["--port", "0", "--tls-port", str(port)]
    if tls is not None:
        cert, key, ca = tls
        argv += ["--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", ca]
        argv += ["--tls-auth-clients", "no"]
    argv += ["--bind", host, "--save", "", "--appendonly", "no"]
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


TLS_FILES = ("redis-tls-cert.pem", "redis-tls-key.pem", "redis-tls-ca.pem")


def tls_files(leaf) -> dict[str, str]:
    """TLS_FILES' contents from a leaf (kvferry.auth.TlsMaterial) of the cluster CA."""
    return dict(zip(TLS_FILES, (leaf.cert.decode(), leaf.key.decode(), leaf.ca.decode()), strict=True))


def write_redis_config(path: Path, password: str, leaf=None) -> tuple[Path, list[str] | None]:
    """The config (the password) at `path`; with `leaf`, the TLS files beside it (all owner-only):
    returns the config's path and those files' paths (redis_server_argv's `tls`)."""
    paths = None
    if leaf is not None:
        paths = [str(write_private(path.parent / name, text)) for name, text in tls_files(leaf).items()]
    return write_private(path, f"requirepass {password}\n"), paths


def redis_url(host: str, port: int, password: str | None = None, tls: bool = False) -> str:
    auth = f":{password}@" if password else ""
    return f"{'rediss' if tls else 'redis'}://{auth}{host}:{port}/0"


def wait_for_redis(
    host: str, port: int, deadline: float, check=None, password: str | None = None, tls: bool = False
) -> str:
    """Poll until the server answers PING (calling `check()` between tries); returns its URL (with the
    password)."""
    import redis

    from kvferry.kvpool.metadata import redis_client

    url = redis_url(host, port, password, tls)
    client = redis_client(url)
    while True:
        if check is not None:
            check()
        with contextlib.suppress(redis.RedisError):
            client.ping()
            return url
        if time.monotonic() > deadline:
            raise LaunchError(f"redis-server on {host}:{port} did not start in time")
        time.sleep(0.05)
