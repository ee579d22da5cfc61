"""Rendezvous in the cluster's Redis: the torch.distributed store of pair groups and worker groups.

A group's ranks find each other through a store (each rank writes its address, reads the others').
torch's TCPStore is a listener that speaks to any process that connects: no credential, and any
client may list, read and write its keys. kvferry's groups rendezvous in the cluster's Redis
instead, which asks for the cluster's password (and speaks TLS when the cluster's internal TLS is
on: `metadata.redis_client`), so there is no store listener at all: a process without the
credential cannot read a group's addresses or join one.

Keys live under `kvf:<namespace>:rdv:<name>/` where `name` is fresh for each group (a pair group's
`<peer>/<random>`, a worker group's `<group id>/<random>` per launch), so a relaunch never reads an
earlier incarnation's keys; each expires `TTL_S` after it was last written.

A rank waits for a key by polling (1 ms, doubling to 50 ms) until the store's timeout: a rendezvous
happens once per group, so the polls cost nothing that matters, and a peer that never comes is a
`TimeoutError` after the timeout, not a hang.
"""

from __future__ import annotations

import secrets
import time
from datetime import timedelta

import redis
import torch.distributed as dist

TTL_S = 3600
POLL_FIRST_S, POLL_MAX_S = 0.001, 0.05


class RedisStore(dist.Store):
    """A `torch.distributed.Store` on a Redis client (the cluster's: password, TLS) under `prefix`."""

    def __init__(self, client: redis.Redis, prefix: str, timeout_s: float = 60.0):
        super().__init__()
        self.client, self.prefix, self.timeout_s = client, prefix, timeout_s

    def _key(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value) -> None:
        self.client.set(self._key(key), _bytes(value), ex=TTL_S)

    def get(self, key: str) -> bytes:
        return self._wait_for(key, self.timeout_s)

    def add(self, key: str, amount: int) -> int:
        with self.client.pipeline(transaction=True) as pipe:
            pipe.incrby(self._key(key), amount)
            pipe.expire(self._key(key), TTL_S)
            value, _ = pipe.execute()
        return int(value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        """Set `key` to `desired` if it holds `expected` (or is missing and `expected` is empty);
        returns the value it holds after."""
        out = self.client.eval(_COMPARE_SET, 1, self._key(key), _bytes(expected), _bytes(desired), TTL_S)
        return bytes(out)

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        # (torch's "no timeout" is 0: the store's own then, never forever)
        limit = self.timeout_s if not timeout else timeout.total_seconds()
        deadline = time.monotonic() + limit
        for key in keys:
            self._wait_for(key, max(0.0, deadline - time.monotonic()))

    def check(self, keys) -> bool:
        keys = list(keys)
        return not keys or self.client.exists(*[self._key(k) for k in keys]) == len(keys)

    def delete_key(self, key: str) -> bool:
        return bool(self.client.delete(self._key(key)))

    def num_keys(self) -> int:
        return sum(1 for _ in self.client.scan_iter(match=self.prefix + "*", count=1000))

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def _wait_for(self, key: str, limit_s: float) -> bytes:
        deadline = time.monotonic() + limit_s
        pause = POLL_FIRST_S
        while True:
            value = self.client.get(self._key(key))
            if value is not None:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rendezvous key {key!r} not set within {limit_s:.1f}s")
            time.sleep(min(pause, left))
            pause = min(2 * pause, POLL_MAX_S)


_COMPARE_SET = """
local v = redis.call('GET', KEYS[1])
if (v == false and ARGV[1] == '') or v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return ARGV[2]
end
if v == false then return ARGV[1] end
return v
"""


def _bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # a list of ints, as torch's C++ side hands a vector<uint8_t>


def fresh_name(base: str) -> str:
    """A rendezvous name no earlier group used: `base` and 8 random hex digits."""
    return f"{base}/{secrets.token_hex(4)}"


def group_store(client: redis.Redis, namespace: str, name: str, timeout_s: float) -> RedisStore:
    """The store of group `name` in the cluster `namespace`."""
    return RedisStore(client, f"kvf:{namespace}:rdv:{name}/", timeout_s)
