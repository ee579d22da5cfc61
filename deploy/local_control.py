"""`kvferry scale` for a cluster that `kvferry up` runs locally: the request travels through the
cluster's Redis (a key the running `up` polls every second and answers), so it needs no port of its own."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid

from kvferry.deploy.local import LocalCluster
from kvferry.kvpool.metadata import mask_url, redis_client


def _scale_key(namespace: str) -> str:
    return f"kvf:{namespace}:scale"


def _launcher_key(namespace: str) -> str:
    return f"kvf:{namespace}:launcher"  # a running `kvferry up` refreshes it every second


def request_scale(
    redis_url: str,
    namespace: str,
    prefill: int | None,
    decode: int | None,
    timeout_s=600.0,
    routers: int | None = None,
):
    """`kvferry scale` for a local cluster: its `kvferry up` watches this Redis key and answers."""
    import redis

    ask = {"id": uuid.uuid4().hex, "prefill": prefill, "decode": decode, "routers": routers}
    client = redis_client(redis_url, 5.0)
    key = _scale_key(namespace)
    try:
        if not client.exists(_launcher_key(namespace)):
            print(
                f"kvferry: error: no kvferry up serves namespace {namespace!r} on {mask_url(redis_url)}",
                file=sys.stderr,
            )
            return 2
        client.set(key, json.dumps(ask))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            raw = client.get(key + ":done")
            if raw is not None and json.loads(raw).get("id") == ask["id"]:
                done = json.loads(raw)
                print(json.dumps(done, indent=2))
                return 0 if done.get("ok") else 1
            time.sleep(0.2)
        client.delete(key)  # nobody took it: it must not run later, unasked
    except redis.RedisError as err:
        print(f"kvferry: error: {mask_url(redis_url)}: {err}", file=sys.stderr)
        return 1
    print(f"kvferry: error: kvferry up did not answer within {timeout_s:.0f}s", file=sys.stderr)
    return 1


def _serve_scale_requests(cluster: LocalCluster) -> None:
    import redis

    client = redis_client(cluster.redis_url)
    key = _scale_key(cluster.cfg.namespace)
    try:
        client.set(_launcher_key(cluster.cfg.namespace), str(os.getpid()), px=5000)
        raw = client.getdel(key)
        if raw is None:
            return
        answer = {"id": None, "ok": True}
        try:
            ask = json.loads(raw)
            answer["id"] = ask.get("id")
            cluster.scale(ask.get("prefill"), ask.get("decode"), ask.get("routers"))
        except Exception as err:  # a bad request or a failed scale: answered, the cluster serves on
            answer.update(ok=False, error=str(err))
        answer["groups"] = {role: [c.name for c in cluster.groups[role]] for role in cluster.groups}
        answer["routers"] = [c.name for c in cluster.live_routers()]
        client.set(key + ":done", json.dumps(answer), ex=600)
    except redis.RedisError as err:  # e.g. redis restarting: asked again in a second
        print(f"kvferry: scale requests: redis: {err}", file=sys.stderr, flush=True)


def run_until_signal(cluster: LocalCluster) -> None:
    """Serve `kvferry scale` requests until SIGINT/SIGTERM (the watcher restarts and reports units)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        _serve_scale_requests(cluster)
