"""Pool metadata in Redis: block key -> location, and the registry of live nodes and workers.

Layout (every key under `kvf:{namespace}:`):
- `b:{key hex}` -> the block's copies in memory, "node_id slot generation" each, joined by ";" (one per
  node: replicas, `PoolClient.put_async` and `hot.py`). Each node adds its own copy only after the
  block's data is complete on it (so a reader never finds a half-written block) and removes it on
  eviction when the entry still names the evicted slot (compare-and-delete of that one copy, in a Lua
  script, so the other copies, or a newer copy on the same node, are never dropped).
- `d:{key hex}` -> "node_id generation": the block is in that node's disk tier (`disk.py`), in the file
  of that generation; a `Location` with `slot == DISK_SLOT`. Kept apart from `b:` so the memory copy and
  the disk copy come and go independently; a lookup prefers a live `b:` entry and falls back to `d:`.
- `n:{role}:{id}` -> JSON {addr, ...}, refreshed by its owner's heartbeat with a TTL: a node or worker
  that stops beating disappears from the registry.
- `m:{role}` -> SET of the ids of that role, added to by every heartbeat (with the record, in one
  transaction). Reading a role is SMEMBERS + MGET of those records, never a SCAN of the keyspace (which
  holds every block key); an id whose record expired is removed from the set by the reader.

A block entry is trusted only while its node is live in the registry: lookups treat an entry on a node
whose record lapsed (the node died) as a miss and delete it (compare-and-delete), so a dead node's
blocks stop being hits within one heartbeat TTL.

Redis is a cache of facts the pool nodes can re-check: losing it (restart, outage) turns lookups into
misses and skips publishing, never into wrong data, because a node serves a block only when the slot
still holds that key at that generation. So every call here swallows connection errors (logged once
per outage) and returns the "nothing known" answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import redis

from kvferry.auth import tls_material
from kvferry.kvpool.rendezvous import RedisStore, group_store

log = logging.getLogger(__name__)

# A value is one or more copies "node slot generation" (a `d:` entry: "node generation") joined by ";".
_ENTRIES = """
local function split(v)
  local out = {}
  if v then for e in string.gmatch(v, '[^;]+') do table.insert(out, e) end end
  return out
end
local function on_node(e, node) return string.sub(e, 1, string.len(node) + 1) == node .. ' ' end
local function store(key, entries)
  if #entries == 0 then return redis.call('DEL', key) end
  redis.call('SET', key, table.concat(entries, ';'))
  return 0
end
-- the copies of KEY that `drop` does not match, and whether any did
local function without(key, drop)
  local keep, found = {}, false
  for _, e in ipairs(split(redis.call('GET', key))) do
    if drop(e) then found = true else table.insert(keep, e) end
  end
  return keep, found
end
"""

# add copy ARGV[i] to KEYS[i], replacing any copy on the same node
_ADD_COPIES = (
    _ENTRIES
    + """
for i, key in ipairs(KEYS) do
  local node = string.match(ARGV[i], '^[^ ]+')
  local keep = without(key, function(e) return on_node(e, node) end)
  table.insert(keep, ARGV[i])
  store(key, keep)
end
return #KEYS
"""
)

# remove copy ARGV[i] from KEYS[i] if it is there, exactly (compare-and-delete of one copy)
_COMPARE_AND_DELETE = (
    _ENTRIES
    + """
local n = 0
for i, key in ipairs(KEYS) do
  local keep, found = without(key, function(e) return e == ARGV[i] end)
  if found then n = n + 1; store(key, keep) end
end
return n
"""
)

# drop the ids in ARGV from the role's set (KEYS[1]) whose record (KEYS[i + 1]) is still missing: a
# heartbeat that re-registered meanwhile keeps its id
_FORGET_EXPIRED = """
local n = 0
for i, member in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then n = n + redis.call('SREM', KEYS[1], member) end
end
return n
"""

# drop the copies on node ARGV[1] from each KEYS[i] (a restarted node's memory entries: its slab is new)
_FORGET_NODE = (
    _ENTRIES
    + """
local n = 0
for i, key in ipairs(KEYS) do
  local keep, found = without(key, function(e) return on_node(e, ARGV[1]) end)
  if found then n = n + 1; store(key, keep) end
end
return n
"""
)

POOL_ROLE = "pool"  # the registry role of the pool nodes
DISK_SLOT = 2**32 - 1  # the slot of a location in a node's disk tier (a `d:` entry)


@dataclass(frozen=True)
class Location:
    key: bytes
    node_id: str
    slot: int
    generation: int
    # the block's other live copies (other nodes; a disk copy last), which a get falls back on when this
    # one is gone: not part of the location's identity
    replicas: tuple[Location, ...] = field(default=(), compare=False, repr=False)

    def copies(self) -> tuple[Location, ...]:
        """This location and its replicas, each without replicas of its own."""
        return (replace(self, replicas=()), *self.replicas)


REDIS_URL_ENV = "KVFERRY_REDIS_URL"  # how the launchers hand the URL over: its password stays out of `ps`


def add_redis_url_arg(p: argparse.ArgumentParser) -> None:
    """`--redis-url`, which defaults to $KVFERRY_REDIS_URL (one of the two is required)."""
    env = os.environ.get(REDIS_URL_ENV)
    p.add_argument(
        "--redis-url",
        default=env,
        required=not env,
        help=f"the metadata Redis, redis://[:password@]host:port/db (default: ${REDIS_URL_ENV}, which "
        "keeps the password off the command line)",
    )


# the prefill workers' published backlogs (kvferry.worker.backlog writes them, router.directory reads):
# a hash under the store's prefix, one field per worker; each record names the requests it took on by
# `request_digest`, which the routers compute the same way
PREFILL_BACKLOG_KEY = "prefill_backlog"


def request_digest(request_id: str) -> int:
    """A request id as a prefill worker's backlog record names it (CRC-32 of its UTF-8)."""
    return zlib.crc32(request_id.encode())


def redis_client(url: str, timeout_s: float = 2.0) -> redis.Redis:
    """The one way a kvferry process opens the cluster's Redis. A `rediss://` URL speaks TLS: the
    server's certificate must chain to the system's roots (a managed Redis) or, when this process has
    internal TLS material (kvferry.auth.tls_material), to the cluster CA (the launchers' redis-server
    holds a leaf of it): redis-py adds the CA to the default roots."""
    extra = {}
    if url.startswith("rediss://"):
        tls = tls_material()
        if tls is not None:
            extra["ssl_ca_data"] = tls.ca.decode()
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **extra)


def mask_url(url: str) -> str:
    """`url` with its password (if any) replaced by ***, for logs and status lines."""
    return re.sub(r"^(\w+://[^:@/]*:)[^@/]+@", r"\1***@", url)


class MetadataStore:
    """`live_cache_s`: how long lookups reuse the set of live pool nodes (well under the heartbeat TTL);
    a location on a node missing from it is re-checked against a fresh registry read."""

    def __init__(
        self, url: str, namespace: str = "default", socket_timeout: float = 2.0, live_cache_s: float = 0.5
    ):
        self.url = url
        self.namespace = namespace
        self.prefix = f"kvf:{namespace}:"
        self.client = redis_client(url, socket_timeout)
        self._down_since: float | None = None
        self.live_cache_s = live_cache_s
        self._live: tuple[float, frozenset[str]] | None = None  # (read at, live pool node ids)
        self._malformed: set[str] = set()  # registry records already logged as unreadable
        # registrations that found no record of the member (its first, or one after its record lapsed
        # or Redis lost it): readers may have dropped its block entries meanwhile
        self.fresh_registrations = 0

    def charge_tokens(self, owner: str, tokens: int, per_minute: int, now: float | None = None) -> float:
        """Count `tokens` for `owner` (an API key's digest) in this minute's window, shared by every
        router: 0 when within `per_minute` (then counted), else the seconds until the window ends (not
        counted). A request larger than the whole limit passes alone in an empty window. Redis down:
        0 (the limit is not enforced while it is). `now`: the wall clock (every router's agrees)."""
        now = time.time() if now is None else now
        window = int(now // 60)
        try:
            ok = self.client.eval(_CHARGE, 1, f"{self.prefix}rate:{owner}:{window}", tokens, per_minute, 120)
        except redis.RedisError as err:
            self._failed(err)
            return 0.0
        self._ok()
        return 0.0 if ok else max(1.0, (window + 1) * 60 - now)

    def rendezvous(self, name: str, timeout_s: float) -> RedisStore:
        """The torch.distributed store of group `name` (kvpool.rendezvous), on this Redis."""
        return group_store(self.client, self.namespace, name, timeout_s)

    # -- health bookkeeping ---------------------------------------------------------------------------
    def _ok(self) -> None:
        if self._down_since is not None:
            log.warning(
                "redis %s is reachable again after %.1fs",
                mask_url(self.url),
                time.monotonic() - self._down_since,
            )
            self._down_since = None

    def _failed(self, err: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("redis %s unreachable (%s): treating lookups as misses", mask_url(self.url), err)

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

    def _dkey(self, key: bytes) -> str:
        return f"{self.prefix}d:{key.hex()}"

    def _entry(self, loc: Location) -> tuple[str, str]:
        """(Redis key, value) of a location: a `d:` entry for a disk location, else a `b:` one."""
        if loc.slot == DISK_SLOT:
            return self._dkey(loc.key), f"{loc.node_id} {loc.generation}"
        return self._bkey(loc.key), f"{loc.node_id} {loc.slot} {loc.generation}"

    def publish(self, locations: Sequence[Location]) -> bool:
        """Add each copy to its key's entry (a disk copy replaces its key's `d:` entry); a node's earlier
        copy of the key is replaced."""
        if not locations:
            return True
        memory = [self._entry(loc) for loc in locations if loc.slot != DISK_SLOT]
        disk = dict(self._entry(loc) for loc in locations if loc.slot == DISK_SLOT)
        try:  # one script for every block: a command per block costs the publisher more than the transfer
            with self.client.pipeline(transaction=False) as pipe:
                if memory:
                    keys, values = zip(*memory, strict=True)
                    pipe.eval(_ADD_COPIES, len(keys), *keys, *values)
                if disk:
                    pipe.mset(disk)
                pipe.execute()
        except redis.RedisError as err:
            self._failed(err)
            return False
        self._ok()
        return True

    def unpublish(self, locations: Sequence[Location]) -> None:
        """Remove each copy from its key's entry if the entry still names that exact (node, slot,
        generation); the key's other copies stay."""
        if not locations:
            return
        keys, values = zip(*map(self._entry, locations), strict=True)
        try:
            self.client.eval(_COMPARE_AND_DELETE, len(keys), *keys, *values)
        except redis.RedisError as err:
            self._failed(err)
            return
        self._ok()

    def forget_node_blocks(self, keys: Sequence[bytes], node_id: str) -> None:
        """Remove the copies on `node_id` from the `b:` entries of `keys`: a restarted node's slab holds
        none of them, and a stale memory entry would hide the key's disk entry from lookups."""
        if not keys:
            return
        try:
            self.client.eval(_FORGET_NODE, len(keys), *(self._bkey(k) for k in keys), node_id)
        except redis.RedisError as err:
            self._failed(err)
            return
        self._ok()

    def lookup(
        self, keys: Sequence[bytes], prefer: Callable[[str], int] | None = None
    ) -> list[Location | None]:
        """Location of each key (None when unknown, or on no pool node that is live): one of its live
        memory copies, else its live disk copy (`slot == DISK_SLOT`), the other live copies as its
        `replicas`; all None while Redis is unreachable. Entries on a node whose registry record lapsed
        are deleted.

        Of several copies the one whose node ranks lowest in `prefer` (the nearest: a node on the
        reader's host), then the one on the node the previous key's copy is on (a get moves a run of
        blocks on one node in one transfer), is chosen."""
        if not keys:
            return []
        try:  # one MGET of both kinds of entry
            values = self.client.mget([self._bkey(k) for k in keys] + [self._dkey(k) for k in keys])
        except redis.RedisError as err:
            self._failed(err)
            return [None] * len(keys)
        self._ok()
        n = len(keys)
        memory = [_parse_copies(k, v) for k, v in zip(keys, values[:n], strict=True)]
        disk = [[] if v is None else _parse_disk(k, v) for k, v in zip(keys, values[n:], strict=True)]
        live = self._live_copies([loc for copies in memory + disk for loc in copies])
        rank = prefer or (lambda _: 0)
        out, previous = [], ""
        for copies, on_disk in zip(memory, disk, strict=True):
            copies = [loc for loc in copies if loc.node_id in live]
            copies.sort(key=lambda loc: (rank(loc.node_id), loc.node_id != previous))
            copies += [loc for loc in on_disk if loc.node_id in live]
            if not copies:
                out.append(None)
                continue
            out.append(replace(copies[0], replicas=tuple(copies[1:])))
            previous = copies[0].node_id
        return out

    def _live_copies(self, found: list[Location]) -> frozenset[str] | set[str]:
        """The pool nodes of `found` that are live (all of them when the registry was never readable).
        The live set is reused for `live_cache_s`; a node missing from it is re-checked by a registry
        read made after the MGET, and only that read's verdict deletes entries (a node that registered,
        then published, after an older read is never mistaken for a dead one)."""
        nodes = {loc.node_id for loc in found}
        if not nodes:
            return nodes
        cached, now = self._live, time.monotonic()
        live = cached[1] if cached is not None and now - cached[0] < self.live_cache_s else None
        if live is None or not nodes <= live:
            members = self.members(POOL_ROLE)
            if members is not None:
                live = frozenset(members)
                self._live = (now, live)
                self.unpublish([loc for loc in found if loc.node_id not in live])
            elif cached is not None:  # the registry cannot be read: filter by what it said last
                live = cached[1]
            else:
                return nodes
        return live

    def lookup_prefix(
        self, keys: Sequence[bytes], prefer: Callable[[str], int] | None = None
    ) -> list[Location]:
        """Locations of the leading keys of a chain that the pool holds, in memory or on disk (stops at the
        first miss); `prefer` as in `lookup`."""
        found = []
        for loc in self.lookup(keys, prefer):
            if loc is None:
                break
            found.append(loc)
        return found

    # -- registry -------------------------------------------------------------------------------------
    def _nkey(self, role: str, member_id: str) -> str:
        return f"{self.prefix}n:{role}:{member_id}"

    def _mkey(self, role: str) -> str:
        return f"{self.prefix}m:{role}"

    def register(self, role: str, member_id: str, info: dict, ttl_s: float) -> bool:
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.set(self._nkey(role, member_id), json.dumps(info), px=int(ttl_s * 1000), get=True)
                pipe.sadd(self._mkey(role), member_id)
                previous, _ = pipe.execute()
        except redis.RedisError as err:
            self._failed(err)
            return False
        self._ok()
        if previous is None:
            self.fresh_registrations += 1
        return True

    def unregister(self, role: str, member_id: str) -> None:
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(self._nkey(role, member_id))
                pipe.srem(self._mkey(role), member_id)
                pipe.execute()
        except redis.RedisError as err:
            self._failed(err)
            return
        self._ok()

    def members(self, role: str) -> dict[str, dict] | None:
        """id -> info of the live members of a role; None when Redis cannot be read.

        A record that is not a JSON object is left out (logged once per member)."""
        return self.members_of((role,))[role]

    def members_of(self, roles: tuple[str, ...]) -> dict[str, dict[str, dict] | None]:
        """`members` of several roles in two round trips (every set, then every record): a router reads
        the whole registry twice a second, and each round trip is CPU it spends while idle."""
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for role in roles:
                    pipe.smembers(self._mkey(role))
                sets = pipe.execute()
            ids = {role: sorted(m.decode() for m in found) for role, found in zip(roles, sets, strict=True)}
            keys = [self._nkey(role, i) for role in roles for i in ids[role]]
            flat = iter(self.client.mget(keys) if keys else [])
            values = {role: [next(flat) for _ in ids[role]] for role in roles}
            for role in roles:
                expired = [i for i, value in zip(ids[role], values[role], strict=True) if value is None]
                if expired:  # lazily: the record's TTL ran out, the set still names it
                    stale = [self._mkey(role), *(self._nkey(role, i) for i in expired)]
                    self.client.eval(_FORGET_EXPIRED, len(stale), *stale, *expired)
        except redis.RedisError as err:
            self._failed(err)
            return dict.fromkeys(roles)
        self._ok()
        out: dict[str, dict[str, dict] | None] = {}
        for role in roles:
            out[role] = {}
            for member_id, value in zip(ids[role], values[role], strict=True):
                record = None if value is None else self._record(role, member_id, value)
                if record is not None:
                    out[role][member_id] = record
        return out

    def _record(self, role: str, member_id: str, value: bytes) -> dict | None:
        name = f"{role}:{member_id}"
        try:
            record = json.loads(value)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if name not in self._malformed:
                self._malformed.add(name)
                log.warning("registry record of %s %s is not a JSON object: %.200r", role, member_id, value)
            return None
        self._malformed.discard(name)
        return record


# KEYS[1]: a key's window; ARGV: the request's tokens, the limit, the window's TTL. 1: counted, 0: over.
_CHARGE = """
local used = redis.call('INCRBY', KEYS[1], ARGV[1])
if used == tonumber(ARGV[1]) then redis.call('EXPIRE', KEYS[1], ARGV[3]) return 1 end
if used > tonumber(ARGV[2]) then redis.call('DECRBY', KEYS[1], ARGV[1]) return 0 end
return 1
"""


def _parse_disk(key: bytes, value: bytes) -> list[Location]:
    """A disk entry "node generation"; [] (a miss) for anything else."""
    try:
        node, gen = value.decode().split(" ")
        return [Location(key, node, DISK_SLOT, int(gen))]
    except ValueError:
        log.warning("malformed disk entry %s: %.100r", key.hex(), value)
        return []


def _parse_copies(key: bytes, value: bytes | None) -> list[Location]:
    """A block entry: copies "node slot generation" joined by ";"; a malformed copy is left out."""
    out = []
    for copy in value.decode(errors="replace").split(";") if value else ():
        try:
            node, slot, gen = copy.split(" ")
            out.append(Location(key, node, int(slot), int(gen)))
        except ValueError:
            log.warning("malformed block entry %s: %.100r", key.hex(), value)
    return out
