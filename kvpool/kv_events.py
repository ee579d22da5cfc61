"""KV events: what each prefill worker's own prefix cache holds, published in Redis for every router.

A worker's block manager reports each change of its prefix cache (`BlockManager.watch`: a full block
became findable under its key, or stopped being); `KVEventPublisher` drains those on its own thread every
`FLUSH_S` and appends them, many keys an entry, to the namespace's stream. Redis layout (under
`kvf:{namespace}:`, beside `kvpool.metadata`'s):

- `kv_events` -> a stream (XADD, trimmed to about `STREAM_MAXLEN` entries). An entry: `w` worker id,
  `g` worker group, `e` epoch (random per worker process), `s` sequence number (1, 2, ... per epoch,
  one per entry), `k` kind (stored | removed | cleared) and `keys` (the 16-byte block keys, concatenated).
  An epoch opens with `cleared` (seq 1), then `stored` of whatever the cache held then.
- `kv_snapshot:{worker id}` -> a hash: `e`, `s`, `g`, `keys` (every key the worker holds as of seq `s`)
  and `id` (a stream id no later than the entry `s + 1`), rewritten every `SNAPSHOT_S` (its TTL refreshed
  meanwhile), and after an outage; deleted when the worker stops.

`KVIndex` is a reader's view: per worker group of the registry, the keys its events say it holds. An
entry applies when its seq follows the last one applied; a gap (a late start, a lost entry, a restarted
worker) loads the worker's snapshot and replays the stream after the snapshot's `id` (`KVEventReader`,
a thread: every Redis call is off the caller's event loop). No pickle: raw bytes, ints, short strings.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis

from kvferry.engine.block_hash import KEY_BYTES
from kvferry.kvpool.metadata import MetadataStore

log = logging.getLogger(__name__)

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"  # BlockManager.watch's kinds
KINDS = (STORED, REMOVED, CLEARED)
STREAM_MAXLEN = 100_000  # entries kept in the stream (approximately: XADD MAXLEN ~)
MAX_KEYS_PER_ENTRY = 2048  # 32 KiB of keys
FLUSH_S = 0.03  # the publisher's batching interval
SNAPSHOT_S = 5.0  # how often a worker's snapshot is rewritten (or its TTL refreshed)
SNAPSHOT_TTL_S = 30.0
RESYNC_S = 1.0  # a reader loads a worker's snapshot at most this often (a gap meanwhile: approximate)
REGISTRY_S = 2.0  # how often a reader re-reads the registry (which workers to follow)
READ_BLOCK_MS = 1000  # an idle reader wakes this often (CPU while idle: it is per second, not per request)
READ_COUNT = 1000


def stream_key(prefix: str) -> str:
    return f"{prefix}kv_events"


def snapshot_key(prefix: str, worker: str) -> str:
    return f"{prefix}kv_snapshot:{worker}"


@dataclass(frozen=True)
class KVEvent:
    """One stream entry: a run of one kind of change of one worker's cache."""

    worker: str
    group: str
    epoch: str
    seq: int
    kind: str
    keys: tuple[bytes, ...] = ()

    def fields(self) -> dict[str, bytes | str | int]:
        return {"w": self.worker, "g": self.group, "e": self.epoch, "s": self.seq, "k": self.kind,
                "keys": b"".join(self.keys)}  # fmt: skip

    @classmethod
    def parse(cls, fields: dict[bytes, bytes]) -> KVEvent | None:
        """The event of an entry; None for a malformed one."""
        try:
            kind = fields[b"k"].decode()
            if kind not in KINDS:
                raise ValueError(f"kind {kind!r}")
            keys = split_keys(fields.get(b"keys", b""))
            w, g, e = (fields[name].decode() for name in (b"w", b"g", b"e"))
            return cls(w, g, e, int(fields[b"s"]), kind, keys)
        except (KeyError, ValueError, UnicodeDecodeError) as err:
            log.warning("skipping a malformed KV event (%s): %.200r", err, fields)
            return None


@dataclass(frozen=True)
class Snapshot:
    worker: str
    group: str
    epoch: str
    seq: int
    id: str  # replay the stream after this id for the entries past `seq`
    keys: frozenset[bytes]

    @classmethod
    def parse(cls, worker: str, fields: dict[bytes, bytes]) -> Snapshot | None:
        if not fields:
            return None
        try:
            return cls(worker, fields[b"g"].decode(), fields[b"e"].decode(), int(fields[b"s"]),
                       fields[b"id"].decode(), frozenset(split_keys(fields[b"keys"])))  # fmt: skip
        except (KeyError, ValueError, UnicodeDecodeError) as err:
            log.warning("skipping the malformed KV snapshot of %s (%s)", worker, err)
            return None


def split_keys(data: bytes) -> tuple[bytes, ...]:
    if len(data) % KEY_BYTES:
        raise ValueError(f"{len(data)} bytes of keys")
    return tuple(data[i : i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES))


def batched(changes: Iterable[tuple[str, bytes | None]]) -> list[tuple[str, list[bytes]]]:
    """Changes in order as runs of one kind, at most MAX_KEYS_PER_ENTRY keys a run."""
    out: list[tuple[str, list[bytes]]] = []
    for kind, key in changes:
        if kind == CLEARED:
            out.append((CLEARED, []))
        elif out and out[-1][0] == kind and len(out[-1][1]) < MAX_KEYS_PER_ENTRY:
            out[-1][1].append(key)
        else:
            out.append((kind, [key]))
    return out


def _stream_id(sid: str) -> tuple[int, int]:
    ms, _, n = sid.partition("-")
    return int(ms), int(n or 0)


class KVEventPublisher:
    """A worker's side: drains `changes` (a `BlockManager.watch()` deque) every `flush_s` on its own
    thread, appends them to the stream and keeps the snapshot. A Redis outage loses the entries of its
    flushes (their seq numbers are used: readers see the gap) and rewrites the snapshot after it."""

    def __init__(
        self,
        meta: MetadataStore,
        worker: str,
        group: str,
        changes: deque,
        flush_s: float = FLUSH_S,
        snapshot_s: float = SNAPSHOT_S,
    ):
        self.client = meta.client
        self.stream = stream_key(meta.prefix)
        self.snapshot_key = snapshot_key(meta.prefix, worker)
        self.worker, self.group, self.changes = worker, group, changes
        self.flush_s, self.snapshot_s = flush_s, snapshot_s
        self.epoch = os.urandom(8).hex()
        self.seq = 0
        self.keys: set[bytes] = set()  # the cache as of `seq`: what the snapshot says
        self.last_id = "0-0"  # of the last entry appended
        self.snapshot_seq = -1
        self.snapshot_at = 0.0
        self.snapshot_due = True
        self.down = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> None:
        """The first flush here (the epoch's start and the snapshot: there before the worker registers),
        the others on the publisher's thread."""
        self.flush()
        self._thread.start()

    def stop(self) -> None:
        """Publish what is left, then delete the snapshot (the worker is leaving)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.flush()
        try:
            self.client.delete(self.snapshot_key)
        except redis.RedisError as err:
            log.warning("could not delete the KV snapshot of %s: %s", self.worker, err)

    def _run(self) -> None:
        while not self._stopped.wait(self.flush_s):
            try:
                self.flush()
            except Exception:  # the publisher must outlive any one flush
                log.exception("publishing KV events failed")

    def flush(self) -> int:
        """Publish the changes made since the last flush (and the snapshot, when due); the entries sent."""
        n = len(self.changes)
        events = []
        for kind, keys in batched(self.changes.popleft() for _ in range(n)):
            self.seq += 1
            if kind == CLEARED:
                self.keys.clear()
            elif kind == STORED:
                self.keys.update(keys)
            else:
                self.keys.difference_update(keys)
            events.append(KVEvent(self.worker, self.group, self.epoch, self.seq, kind, tuple(keys)))
        sent = self._append(events)
        if self.snapshot_due or time.monotonic() - self.snapshot_at >= self.snapshot_s:
            self._snapshot()
        return sent

    def _append(self, events: list[KVEvent]) -> int:
        if not events:
            return 0
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for event in events:
                    pipe.xadd(self.stream, event.fields(), maxlen=STREAM_MAXLEN, approximate=True)
                ids = pipe.execute()
        except redis.RedisError as err:
            self._failed(err)
            return 0
        self.last_id = ids[-1].decode() if isinstance(ids[-1], bytes) else str(ids[-1])
        self._ok()
        return len(events)

    def _snapshot(self) -> None:
        try:
            if self.seq == self.snapshot_seq and self.client.pexpire(self.snapshot_key, _ms(SNAPSHOT_TTL_S)):
                pass  # unchanged and still there: its TTL refreshed
            else:
                fields = {"e": self.epoch, "s": self.seq, "g": self.group, "id": self.last_id,
                          "keys": b"".join(self.keys)}  # fmt: skip
                with self.client.pipeline(transaction=True) as pipe:
                    pipe.hset(self.snapshot_key, mapping=fields)
                    pipe.pexpire(self.snapshot_key, _ms(SNAPSHOT_TTL_S))
                    pipe.execute()
        except redis.RedisError as err:
            self._failed(err)
            return
        self._ok()
        self.snapshot_seq, self.snapshot_at, self.snapshot_due = self.seq, time.monotonic(), False

    def _failed(self, err: Exception) -> None:
        self.snapshot_due = True
        if not self.down:
            log.warning("publishing KV events failed (%s): routers will reload the snapshot", err)
        self.down = True

    def _ok(self) -> None:
        if self.down:
            log.warning("publishing KV events again")
        self.down = False


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


# -- the readers' side ------------------------------------------------------------------------------------
APPLIED, SKIPPED, IGNORED, GAP = "applied", "skipped", "ignored", "gap"


@dataclass
class WorkerKeys:
    """One worker group's prefix cache as its events tell it."""

    worker: str
    addr: str
    epoch: str = ""
    seq: int = 0  # the last entry applied
    keys: set[bytes] = field(default_factory=set)
    exact: bool = False  # loaded from a snapshot (or an epoch's start) and every entry since applied
    synced_at: float = float("-inf")  # the last snapshot load (tried)


class KVIndex:
    """Per worker group, the keys its KV events say it holds. The registry decides which groups are
    followed (`retain`); the reader thread applies entries and snapshots, the router reads
    (`match`): every method takes `lock`."""

    def __init__(self, resync_s: float = RESYNC_S):
        self.resync_s = resync_s
        self.lock = threading.Lock()
        self.workers: dict[str, WorkerKeys] = {}  # group -> its keys

    def retain(self, members: dict[str, tuple[str, str]]) -> None:
        """Follow these groups (group -> (worker id, address)): one gone, or at another address (a new
        process), is forgotten; a new one is followed from its snapshot (`due`)."""
        with self.lock:
            for group, w in list(self.workers.items()):
                if members.get(group) != (w.worker, w.addr):
                    del self.workers[group]
            for group, (worker, addr) in members.items():
                self.workers.setdefault(group, WorkerKeys(worker, addr))

    def due(self, now: float) -> dict[str, str]:
        """The groups whose snapshot is to be loaded now (group -> worker id)."""
        with self.lock:
            return {
                g: w.worker
                for g, w in self.workers.items()
                if not w.exact and w.synced_at + self.resync_s <= now
            }

    def resync_all(self) -> None:
        """Load every group's snapshot again (after a lost connection: entries may have been missed)."""
        with self.lock:
            for w in self.workers.values():
                w.exact, w.synced_at = False, float("-inf")

    def load(self, group: str, snapshot: Snapshot | None, now: float) -> None:
        """Start a group over from its snapshot (None: there is none: nothing known, and not exact)."""
        keys = set(snapshot.keys) if snapshot is not None else set()
        with self.lock:
            w = self.workers.get(group)
            if w is None:
                return
            w.synced_at = now
            if snapshot is None:
                w.exact = False
                return
            w.epoch, w.seq, w.keys, w.exact = snapshot.epoch, snapshot.seq, keys, True

    def apply(self, event: KVEvent, now: float) -> str:
        """Apply an entry: APPLIED; SKIPPED (the snapshot covers it); IGNORED (a group not followed); GAP
        (entries are missing and the snapshot may be loaded now: load it, then apply again). A gap
        within `resync_s` of the last load is applied anyway, the group marked inexact (due again)."""
        with self.lock:
            w = self.workers.get(event.group)
            if w is None or w.worker != event.worker:
                return IGNORED
            if event.epoch == w.epoch and event.seq <= w.seq:
                return SKIPPED
            follows = event.epoch == w.epoch and event.seq == w.seq + 1
            if event.seq == 1:  # an epoch's start: its cleared entry makes the view whole
                w.exact = True
            elif not follows:
                if w.synced_at + self.resync_s <= now:
                    return GAP
                w.exact = False
            w.epoch, w.seq = event.epoch, event.seq
            if event.kind == CLEARED:
                w.keys = set()
            elif event.kind == STORED:
                w.keys.update(event.keys)
            else:
                w.keys.difference_update(event.keys)
            return APPLIED

    def holds(self, group: str) -> set[bytes]:
        """The group's keys (the live set: read it under `lock`)."""
        w = self.workers.get(group)
        return w.keys if w is not None else set()


class KVEventReader:
    """A router's side: a thread that follows the registry's prefill workers (`role`) into `index`:
    their snapshots, then the stream (XREAD BLOCK from the last id). `ready` is set once the first
    snapshots are loaded."""

    def __init__(self, meta: MetadataStore, index: KVIndex, role: str = "prefill"):
        self.meta, self.client, self.index, self.role = meta, meta.client, index, role
        self.stream = stream_key(meta.prefix)
        self.pos: str | None = None  # the last stream id read; None: start at the stream's end
        self.ready = threading.Event()
        self.down = False
        self._registry_at = 0.0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(READ_BLOCK_MS / 1000 + 5)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self.step()
            except redis.RedisError as err:
                if not self.down:
                    log.warning("reading KV events failed (%s): retrying", err)
                self.down, self.pos = True, None
                self._stopped.wait(1.0)
            except Exception:
                log.exception("reading KV events failed")
                self._stopped.wait(1.0)

    def step(self, block_ms: int = READ_BLOCK_MS) -> None:
        """Follow the registry, load the snapshots that are due, then apply the next entries."""
        now = time.monotonic()
        if self.pos is None:
            last = self.client.xrevrange(self.stream, count=1)
            self.pos = last[0][0].decode() if last else "0-0"
            self.index.resync_all()
            if self.down:
                log.warning("reading KV events again")
            self.down = False
        if now >= self._registry_at:
            members = self.meta.members(self.role)
            if members is not None:
                self.index.retain(_followed(members))
                self._registry_at = now + REGISTRY_S
        due = self.index.due(now)
        if due:
            self.sync(due)
        if not self.ready.is_set() and self._registry_at > now:
            self.ready.set()
            count = len(self.index.workers)
            log.info("KV events: following the prefix caches of %d %s workers", count, self.role)
        reply = self.client.xread({self.stream: self.pos}, count=READ_COUNT, block=block_ms or None)
        for _, entries in reply or ():
            for sid, fields in entries:
                event = KVEvent.parse(fields)
                if event is not None and self.index.apply(event, time.monotonic()) == GAP:
                    self.sync({event.group: event.worker})
                    self.index.apply(event, time.monotonic())
                self.pos = sid.decode()

    def sync(self, groups: dict[str, str]) -> None:
        """Load these groups' snapshots (group -> worker id), then replay the stream after them up to
        where this reader stands."""
        with self.client.pipeline(transaction=False) as pipe:
            for worker in groups.values():
                pipe.hgetall(snapshot_key(self.meta.prefix, worker))
            raw = pipe.execute()
        now = time.monotonic()
        starts = []
        for (group, worker), fields in zip(groups.items(), raw, strict=True):
            snapshot = Snapshot.parse(worker, fields)
            if snapshot is not None and snapshot.group != group:
                snapshot = None
            self.index.load(group, snapshot, now)
            if snapshot is not None:
                starts.append(snapshot.id)
        if starts and self.pos is not None:
            self._replay(min(starts, key=_stream_id), set(groups), now)

    def _replay(self, start: str, groups: set[str], now: float) -> None:
        while _stream_id(start) < _stream_id(self.pos):
            entries = self.client.xrange(self.stream, min=f"({start}", max=self.pos, count=READ_COUNT)
            if not entries:
                return
            for sid, fields in entries:
                event = KVEvent.parse(fields)
                if event is not None and event.group in groups:
                    self.index.apply(event, now)
                start = sid.decode()


def _followed(members: dict[str, dict]) -> dict[str, tuple[str, str]]:
    """group -> (worker id, address) of the registry's records."""
    out = {}
    for member_id, record in members.items():
        addr, group = record.get("addr"), record.get("group") or member_id
        if isinstance(addr, str) and isinstance(group, str):
            out[group] = (member_id, addr)
    return out
