"""Pool metadata in Redis: block key -> location, and the registry of live nodes and workers.

Layout (every key under `kvf:{namespace}:`):
- `b:{key hex}` -> "node_id slot generation", written only after the block's data is complete on the
  node (so a reader never finds a half-written block) and deleted on eviction when it still names the
  evicted slot (compare-and-delete, so a newer copy elsewhere is never dropped).
- `n:{role}:{id}` -> JSON {addr, ...}, refreshed by its owner's heartbeat with a TTL: a node or worker
  that stops beating disappears from the registry.

Redis is a cache of facts the pool nodes can re-check: losing it (restart, outage) turns lookups into
misses and skips publishing, never into wrong data, because a node serves a block only when the slot
still holds that key at that generation. So every call here swallows connection errors (logged once
per outage) and returns the "nothing known" answer.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

log = logging.getLogger(__name__)

_COMPARE_AND_DELETE = """
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i] then n = n + redis.call('DEL', key) end
end
return n
"""


@dataclass(frozen=True)
class Location:
    key: bytes
    node_id: str
    slot: int
    generation: int


class MetadataStore:
    def __init__(self, url: str, namespace: str = "default", socket_timeout: float = 2.0):
        self.url = url
        self.prefix = f"kvf:{namespace}:"
        self.client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )
        self._down_since: float | None = None

    # -- health bookkeeping ---------------------------------------------------------------------------
    def _ok(self) -> None:
        if self._down_since is not None:
            log.warning(
                "redis %s is reachable again after %.1fs", self.url, time.monotonic() - self._down_since
            )
            self._down_since = None

    def _failed(self, err: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("redis %s unreachable (%s): treating lookups as misses", self.url, err)

    def server_id(self) -> str | None:
        """The Redis server's run id (changes when it restarts); None while unreachable."""
        try:
            run_id = self.client.info("server").get("run_id")
        except redis.RedisError as err:
            self._failed(err)
            return None
        self._ok()
        return str(run_id)

    # -- blocks ---------------------------------------------------------------------------------------
    def _bkey(self, key: bytes) -> str:
        return f"{self.prefix}b:{key.hex()}"

    def publish(self, locations: Sequence[Location]) -> bool:
        if not locations:
            return True
        try:  # one MSET: a command per block costs the pool's publisher thread more than the transfer
            self.client.mset(
                {self._bkey(loc.key): f"{loc.node_id} {loc.slot} {loc.generation}" for loc in locations}
            )
        except redis.RedisError as err:
            self._failed(err)
            return False
        self._ok()
        return True

    def unpublish(self, locations: Sequence[Location]) -> None:
        """Delete each entry that still names that exact (node, slot, generation)."""
        if not locations:
            return
        keys = [self._bkey(loc.key) for loc in locations]
        values = [f"{loc.node_id} {loc.slot} {loc.generation}" for loc in locations]
        try:
            self.client.eval(_COMPARE_AND_DELETE, len(keys), *keys, *values)
        except redis.RedisError as err:
            self._failed(err)
            return
        self._ok()

    def lookup(self, keys: Sequence[bytes]) -> list[Location | None]:
        """Location of each key (None when unknown); all None while Redis is unreachable."""
        if not keys:
            return []
        try:
            values = self.client.mget([self._bkey(k) for k in keys])
        except redis.RedisError as err:
            self._failed(err)
            return [None] * len(keys)
        self._ok()
        out: list[Location | None] = []
        for key, value in zip(keys, values, strict=True):
            if value is None:
                out.append(None)
                continue
            node, slot, gen = value.decode().split(" ")
            out.append(Location(key, node, int(slot), int(gen)))
        return out

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[Location]:
        """Locations of the leading keys of a chain that the pool holds (stops at the first miss)."""
        found = []
        for loc in self.lookup(keys):
            if loc is None:
                break
            found.append(loc)
        return found

    # -- registry -------------------------------------------------------------------------------------
    def register(self, role: str, member_id: str, info: dict, ttl_s: float) -> bool:
        try:
            self.client.set(f"{self.prefix}n:{role}:{member_id}", json.dumps(info), px=int(ttl_s * 1000))
        except redis.RedisError as err:
            self._failed(err)
            return False
        self._ok()
        return True

    def unregister(self, role: str, member_id: str) -> None:
        try:
            self.client.delete(f"{self.prefix}n:{role}:{member_id}")
        except redis.RedisError as err:
            self._failed(err)

    def members(self, role: str) -> dict[str, dict] | None:
        """id -> info of the live members of a role; None when Redis cannot be read."""
        pattern = f"{self.prefix}n:{role}:*"
        try:
            names = list(self.client.scan_iter(match=pattern, count=1000))
            values = self.client.mget(names) if names else []
        except redis.RedisError as err:
            self._failed(err)
            return None
        self._ok()
        start = len(pattern) - 1
        return {
            name.decode()[start:]: json.loads(value)
            for name, value in zip(names, values, strict=True)
            if value is not None
        }
