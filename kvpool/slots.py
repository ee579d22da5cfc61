"""A pool node's slot table: which slab slot holds which block, in what state, read or written by whom.

Pure bookkeeping: no tensors, no torch.distributed, no gRPC, no Redis, no threads. Not thread-safe:
the caller serializes every call (`PoolNode` holds its one lock around each, and keeps the Condition a
put's reply waits on). Time comes from `clock` (default `time.monotonic`), so tests can drive the TTLs.

Slot life: FREE [-> RESERVED] -> WRITING (a put took it; not visible) -> PUBLISHED (complete: every KV
head written; its location goes to Redis) or PRIVATE (a request's tail block, never published) -> FREE.
RESERVED: set aside for one client (`reserve`, one control call per batch) which names it in a later
put; a put takes a named slot only while it is still that owner's at that generation, and an owner's
reservations lapse `reserve_ttl_s` after its last `reserve` or put (its process died, or it stopped
using them: a client uses its reservations only for half the lease after what the node confirmed, so
a slot is never handed on while its owner may still write it, short of a stall of that long between
its check and its write).
A slot's generation rises each time it is allocated, and a get names (slot, generation, key): a stale
location (the slot was evicted and reused) is refused, so lost or old metadata means a miss, never
wrong KV. `writers` (puts whose bytes are landing) and `leases` (gets sending from it) pin a slot: it
is neither freed nor evicted while either is non-zero. Eviction is LRU over published, unpinned slots.
Private blocks are freed after their first whole (all KV heads) read, on `release`, or after
`private_ttl_s`; a WRITING slot whose other KV-head slices never come is freed `assemble_timeout_s`
after its last writer finished.

Kept alongside the slots, and updated with every state change:
- `free`: FREE slots, in allocation order.
- `lru`: PUBLISHED slots nobody writes or reads, oldest first: the eviction order.
- `index`: key -> the slot holding its newest shared copy (WRITING or PUBLISHED); a private key is
  indexed only while being written (so the other ranks' slices of it join the same slot).
- `by_request`: request id -> its private and unfinished slots (WRITING or PRIVATE): `release` looks
  at those only.
- `reserved`: owner -> its RESERVED slots, and `reserve_expires`: owner -> when they lapse.
- an expiry heap of (expires, slot, generation), pushed whenever an unpinned slot may expire (a
  PRIVATE block, or a WRITING one whose writers are all done) and checked lazily against the slot when
  it comes due: `expire` pops only what is due instead of walking every slot.

`on_change(slot)` (optional) sees every state change, after the generation of a reused slot rose: the
node mirrors (generation, state) into shared memory for same-host readers (`shm.py`).
"""

from __future__ import annotations

import enum
import heapq
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvferry.kvpool.metadata import Location


class SlotState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    PUBLISHED = 2
    PRIVATE = 3
    RESERVED = 4


@dataclass(slots=True)
class Slot:
    index: int
    state: SlotState = SlotState.FREE
    key: bytes = b""
    generation: int = 0
    # bitmask of the (layer, KV head) cells received so far: a TP put brings its ranks' heads, a
    # layer-wise put one layer (bit layer * num_kv_heads + head)
    written: int = 0
    writers: int = 0  # puts whose bytes are landing here now: the slot is neither freed nor evictable
    leases: int = 0
    request_id: str = ""  # owner of a private block
    expires: float = 0.0
    released: bool = False  # its request was released while it was in use: freed once nobody uses it


class BlockRef(Protocol):
    """A location named by a reader: a `Location`, or a `pool_pb2.BlockLocation` message."""

    key: bytes
    node_id: str
    slot: int
    generation: int


@dataclass
class PutPlan:
    """The slots one put writes into, from `begin_write`; hand it back to finish or abort the write."""

    request_id: str
    keys: list[bytes]
    private: list[bool]
    slots: list[int | None] = field(default_factory=list)  # per block; None: nothing is written
    generations: list[int | None] = field(default_factory=list)  # of those slots, when reserved
    evicted: list[Location] = field(default_factory=list)  # to unpublish: their slots were reused
    republish: list[Location] = field(default_factory=list)  # keys complete here already
    owner: str = ""  # the client whose reserved slots the put named
    sources: list[int | None] = field(default_factory=list)  # per block: the named slot it was written in
    spare: list[tuple[int, int]] = field(default_factory=list)  # named (slot, generation) it did not keep

    @property
    def rows(self) -> list[int]:
        """Positions of the blocks that land in a slot (the others' bytes are dropped on arrival)."""
        return [i for i, slot in enumerate(self.slots) if slot is not None]


class SlotTable:
    def __init__(
        self,
        num_slots: int,
        num_kv_heads: int,
        node_id: str,
        *,
        num_layers: int = 1,
        private_ttl_s: float = 20.0,
        assemble_timeout_s: float = 30.0,
        reserve_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[Slot], None] | None = None,
    ):
        self.node_id = node_id
        self.num_kv_heads, self.num_layers = num_kv_heads, num_layers
        self.all_cells = (1 << num_kv_heads * num_layers) - 1
        self.private_ttl_s = private_ttl_s
        self.assemble_timeout_s = assemble_timeout_s
        self.reserve_ttl_s = reserve_ttl_s
        self.clock = clock
        self.on_change = on_change
        self.slots = [Slot(i) for i in range(num_slots)]
        self.free: deque[int] = deque(range(num_slots))
        self.lru: OrderedDict[int, None] = OrderedDict()  # published, unpinned: eviction order
        self.index: dict[bytes, int] = {}  # key -> slot (WRITING or PUBLISHED)
        self.by_request: dict[str, set[int]] = {}  # request id -> its WRITING / PRIVATE slots
        self.reserved: dict[str, set[int]] = {}  # owner -> its RESERVED slots
        self.reserve_expires: dict[str, float] = {}  # owner -> when its reservations lapse
        self.leases: Counter[str] = Counter()  # request id -> blocks it has leased now
        self.counters: Counter[str] = Counter()  # evictions, stale_gets, blocks_in, blocks_out
        self.in_state: Counter[SlotState] = Counter({SlotState.FREE: num_slots})
        self._expiry: list[tuple[float, int, int]] = []  # (expires, slot, generation), lazily deleted

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def available(self) -> int:
        """Slots a put can take now: free ones plus the evictable."""
        return len(self.free) + len(self.lru)

    def location(self, slot: Slot) -> Location:
        return Location(slot.key, self.node_id, slot.index, slot.generation)

    def existing(self, key: bytes) -> Slot | None:
        """The slot `index` names for `key` (its newest shared copy, or a private one being written)."""
        index = self.index.get(key)
        return None if index is None else self.slots[index]

    # -- writes --------------------------------------------------------------------------------------
    def reserve(self, owner: str, count: int) -> tuple[list[tuple[int, int]], list[Location]]:
        """Set aside up to `count` slots (fewer when every other slot is pinned) for `owner` to fill:
        ((slot, generation) of each, lowest first; locations evicted to make room, to unpublish)."""
        evicted: list[Location] = []
        held = self.reserved.setdefault(owner, set())
        out = []
        for _ in range(count):
            slot = self._allocate(evicted)
            if slot is None:
                break
            self._set_state(slot, SlotState.RESERVED)
            held.add(slot.index)
            out.append((slot.index, slot.generation))
        self._touch(owner)
        return sorted(out), evicted

    def begin_write(
        self,
        request_id: str,
        keys: Sequence[bytes],
        private: Sequence[bool] | None = None,
        *,
        owner: str = "",
        named: Sequence[tuple[int, int] | None] = (),
        allocate: bool = True,
    ) -> PutPlan:
        """Reserve a slot per block and pin it (`writers`) until `finish_write` or `abort_write`.

        A key being written already (another rank's KV-head slice of it) is joined, not re-made; one
        published here already gets no slot (`republish` names it: a writer found it missing in Redis);
        another request's private block is never written into. A new slot is the block's `named` one
        (slot, generation) when that is still `owner`'s reservation; else, if `allocate`, one from the
        free list or by evicting the least recently used published block (`evicted`); None when every
        slot is pinned. Named slots the put does not keep stay reserved (`spare`, `sources`: a writer
        through shared memory put the bytes there) until `finish_write` / `abort_write` frees them.
        """
        now = self.clock()
        private = [False] * len(keys) if private is None else list(private)
        named = list(named) or [None] * len(keys)
        plan = PutPlan(request_id, list(keys), private, owner=owner)
        self._touch(owner)
        for key, is_private, want in zip(plan.keys, private, named, strict=True):
            mine = self._reserved_slot(owner, want)
            plan.sources.append(None if mine is None else mine.index)
            slot = self.existing(key)
            if slot is not None and is_private and slot.request_id != request_id:
                slot = None  # never write into another request's private block
            if slot is not None and slot.state == SlotState.PUBLISHED:
                plan.slots.append(None)  # already complete here: drop the bytes on arrival
                plan.generations.append(None)
                plan.republish.append(self.location(slot))
                plan.spare += [] if mine is None else [(mine.index, mine.generation)]
                continue
            if slot is None:
                if mine is not None:
                    slot, mine = mine, None
                    self.reserved[owner].discard(slot.index)
                elif allocate:
                    slot = self._allocate(plan.evicted)
                if slot is not None:
                    slot.key = key
                    self._set_state(slot, SlotState.WRITING)
                    slot.request_id = request_id if is_private else ""
                    if slot.request_id:
                        self.by_request.setdefault(slot.request_id, set()).add(slot.index)
                    self.index[key] = slot.index  # private keys: only while being written
                    # pinned: nothing expires it before its writers are done (`finish_write` resets it)
                    slot.expires = now + self.private_ttl_s
            plan.spare += [] if mine is None else [(mine.index, mine.generation)]
            if slot is not None:
                slot.writers += 1  # pinned (no release, no eviction) until this put is done
            plan.slots.append(None if slot is None else slot.index)
            plan.generations.append(None if slot is None else slot.generation)
        return plan

    def finish_write(
        self,
        plan: PutPlan,
        head_begin: int = 0,
        head_end: int | None = None,
        layer_begin: int = 0,
        layer_end: int | None = None,
    ) -> tuple[list[Location], bool]:
        """The put's KV heads [head_begin, head_end) of layers [layer_begin, layer_end) landed in its
        slots: unpin them, and complete every block that now has every head of every layer (PRIVATE for
        a private block, else PUBLISHED and evictable once unpinned). A block still missing slices may
        expire `assemble_timeout_s` after its last writer. Returns (locations to publish: the completed
        blocks then `plan.republish`, whether any block was completed: a put waiting on `pending` may be
        done)."""
        head_end = self.num_kv_heads if head_end is None else head_end
        layer_end = self.num_layers if layer_end is None else layer_end
        heads = ((1 << head_end) - 1) ^ ((1 << head_begin) - 1)
        mask = sum(heads << layer * self.num_kv_heads for layer in range(layer_begin, layer_end))
        now = self.clock()
        publish: list[Location] = []
        assembled = False
        for is_private, index in zip(plan.private, plan.slots, strict=True):
            if index is None:
                continue
            slot = self.slots[index]
            slot.writers -= 1
            slot.written |= mask
            if slot.written == self.all_cells and slot.state == SlotState.WRITING:
                assembled = True
                if is_private:
                    self._set_state(slot, SlotState.PRIVATE)
                    self._set_expiry(slot, now + self.private_ttl_s)  # from completion
                    if self.index.get(slot.key) == slot.index:
                        del self.index[slot.key]
                else:
                    self._set_state(slot, SlotState.PUBLISHED)
                    self._untrack(slot)
                    publish.append(self.location(slot))
            if slot.state == SlotState.PUBLISHED and slot.writers == 0 and slot.leases == 0:
                self.lru[slot.index] = None  # evictable only once nobody writes or reads it
            if slot.state == SlotState.WRITING and slot.writers == 0:
                self._set_expiry(slot, now + self.assemble_timeout_s)  # for the other slices
            self._release_if_done(slot)
        self.counters["blocks_in"] += len(plan.rows)
        self._free_spare(plan)
        return publish + plan.republish, assembled

    def abort_write(self, plan: PutPlan) -> int:
        """The put's bytes never (all) came: unpin its slots, freeing those left WRITING with no other
        writer (no complete copy can come of them now). Returns how many slots were freed."""
        released = 0
        for index in plan.slots:
            if index is None:
                continue
            slot = self.slots[index]
            slot.writers -= 1
            if slot.writers == 0 and slot.state == SlotState.WRITING:
                self._release(slot)
                released += 1
            elif slot.writers == 0 and slot.state == SlotState.PUBLISHED and slot.leases == 0:
                self.lru[slot.index] = None
        return released + self._free_spare(plan)

    def pending(self, plan: PutPlan) -> bool:
        """Whether a block of the put still waits for another rank's KV-head slice (its slot is still
        WRITING at the generation the put reserved)."""
        return any(
            index is not None
            and self.slots[index].state == SlotState.WRITING
            and self.slots[index].generation == gen
            for index, gen in zip(plan.slots, plan.generations, strict=True)
        )

    def locations_for(self, plan: PutPlan) -> list[Location | None]:
        """The put's answer, per block: where its complete copy is, or None (not stored, or never
        completed). A block that got no slot is answered with the key's complete copy here, if any."""
        out: list[Location | None] = []
        for key, index, gen in zip(plan.keys, plan.slots, plan.generations, strict=True):
            slot = self.existing(key) if index is None else self.slots[index]
            complete = (
                slot is not None
                and slot.state in (SlotState.PUBLISHED, SlotState.PRIVATE)
                and slot.key == key
                and gen in (None, slot.generation)
            )
            out.append(self.location(slot) if complete else None)
        return out

    # -- reads ---------------------------------------------------------------------------------------
    def lease(self, request_id: str, blocks: Iterable[BlockRef]) -> tuple[list[int], Location | None]:
        """Lease the slots of `blocks` for a get, in order, stopping at the first stale one (its slot no
        longer holds that key at that generation, complete). Returns (leased slot indices, the stale
        location to unpublish when it names this node, else None)."""
        leased: list[int] = []
        stale: Location | None = None
        for loc in blocks:
            slot = self.slots[loc.slot] if 0 <= loc.slot < len(self.slots) else None
            if (
                slot is None
                or slot.key != loc.key
                or slot.generation != loc.generation
                or slot.state not in (SlotState.PUBLISHED, SlotState.PRIVATE)
            ):
                self.counters["stale_gets"] += 1
                if slot is not None and loc.node_id == self.node_id:  # drop the stale entry
                    stale = Location(loc.key, loc.node_id, loc.slot, loc.generation)
                break
            slot.leases += 1
            self.lru.pop(slot.index, None)
            leased.append(slot.index)
        self.leases[request_id] += len(leased)
        return leased, stale

    def end_lease(self, request_id: str, leased: Sequence[int], whole: bool) -> int:
        """The get that leased `leased` is over. A private block is freed after a `whole` (every KV
        head) read (readers of head slices leave it to `release` / the TTL, not knowing who else needs
        it); a published one becomes the most recently used. Returns how many slots were freed."""
        self.leases[request_id] -= len(leased)
        if self.leases[request_id] <= 0:
            del self.leases[request_id]
        released = 0
        for index in leased:
            slot = self.slots[index]
            slot.leases -= 1
            if slot.state == SlotState.PRIVATE:
                if whole and slot.leases == 0 and slot.writers == 0:
                    self._release(slot)
                    released += 1
                else:
                    released += self._release_if_done(slot)
            elif slot.state == SlotState.PUBLISHED and slot.leases == 0 and slot.writers == 0:
                self.lru[slot.index] = None
                self.lru.move_to_end(slot.index)
        self.counters["blocks_out"] += len(leased)
        return released

    # -- housekeeping --------------------------------------------------------------------------------
    def release(self, request_id: str) -> int:
        """Free the request's private and unfinished blocks that nobody reads or writes now; the ones in
        use are freed when their last writer or reader is done (a release that overtakes the request's
        own put, when the request ended early, leaves nothing behind)."""
        released = 0
        for index in list(self.by_request.get(request_id, ())):
            slot = self.slots[index]
            if slot.leases == 0 and slot.writers == 0:
                self._release(slot)
                released += 1
            else:
                slot.released = True
        return released

    def consumed(self, blocks: Iterable[BlockRef]) -> int:
        """A same-host reader copied these private blocks whole without a lease (`shm.py`): free each
        that still holds that key at that generation and is not in use (1 per block freed)."""
        released = 0
        for loc in blocks:
            slot = self.slots[loc.slot] if 0 <= loc.slot < len(self.slots) else None
            if (
                slot is not None
                and slot.state == SlotState.PRIVATE
                and (slot.key, slot.generation) == (loc.key, loc.generation)
                and slot.leases == slot.writers == 0
            ):
                self._release(slot)
                released += 1
        self.counters["blocks_out"] += released
        return released

    def _release_if_done(self, slot: Slot) -> int:
        """Free a released request's block once nobody writes or reads it (1 if freed)."""
        in_use = slot.writers or slot.leases
        if slot.released and not in_use and slot.state in (SlotState.PRIVATE, SlotState.WRITING):
            self._release(slot)
            return 1
        return 0

    def expire(self) -> int:
        """Free the unpinned private blocks older than `private_ttl_s` (from completion) and the
        WRITING slots still missing slices `assemble_timeout_s` after their last writer. Returns how
        many were freed."""
        now = self.clock()
        released, pinned, seen = 0, [], set()
        while self._expiry and self._expiry[0][0] < now:
            entry = heapq.heappop(self._expiry)
            expires, index, generation = entry
            slot = self.slots[index]
            if (
                index in seen
                or slot.generation != generation
                or slot.expires != expires
                or slot.state not in (SlotState.PRIVATE, SlotState.WRITING)
            ):
                continue  # superseded: the slot was freed, reused, completed or given a new deadline
            seen.add(index)
            if not (slot.request_id or slot.state == SlotState.WRITING):
                continue  # a private block of no request: only a whole read frees it
            if slot.leases or slot.writers:
                pinned.append(entry)  # due, but in use: looked at again on the next sweep
                continue
            self._release(slot)
            released += 1
        for entry in pinned:
            heapq.heappush(self._expiry, entry)
        for owner in [o for o, t in self.reserve_expires.items() if t < now]:  # its process died
            del self.reserve_expires[owner]
            for index in self.reserved.pop(owner, ()):
                self._release(self.slots[index])
                released += 1
        return released

    def published_locations(self) -> list[Location]:
        """Every complete shared block here (to republish when Redis comes back empty)."""
        return [self.location(s) for s in self.slots if s.state == SlotState.PUBLISHED]

    def stats(self) -> dict:
        return {
            "num_slots": len(self.slots),
            "used_slots": len(self.slots) - len(self.free),
            "free_slots": self.available(),
            "writing": self.in_state[SlotState.WRITING],
            "reserved": self.in_state[SlotState.RESERVED],
            "published": self.in_state[SlotState.PUBLISHED],
            "private_blocks": self.in_state[SlotState.PRIVATE],
            "leases": dict(self.leases),
            "blocks_in": self.counters["blocks_in"],
            "blocks_out": self.counters["blocks_out"],
            "evictions": self.counters["evictions"],
            "stale_gets": self.counters["stale_gets"],
        }

    def check(self) -> None:
        """Assert that every side structure agrees with the slots (a full scan: for tests)."""
        slots = self.slots
        assert sorted(self.free) == [s.index for s in slots if s.state == SlotState.FREE], "free list"
        assert all(
            slots[i].state == SlotState.PUBLISHED and slots[i].leases == slots[i].writers == 0
            for i in self.lru
        ), "lru holds a pinned or unpublished slot"
        assert all(
            s.index in self.lru
            for s in slots
            if s.state == SlotState.PUBLISHED and s.leases == s.writers == 0
        ), "an unpinned published slot is not evictable"
        for key, i in self.index.items():
            assert slots[i].key == key and slots[i].state in (SlotState.WRITING, SlotState.PUBLISHED), key
        assert all(self.by_request.values()), "an empty request entry is kept"
        tracked = {(r, i) for r, ids in self.by_request.items() for i in ids}
        owned = {
            (s.request_id, s.index)
            for s in slots
            if s.request_id and s.state in (SlotState.WRITING, SlotState.PRIVATE)
        }
        assert tracked == owned, f"by_request {tracked} != {owned}"
        assert +self.in_state == Counter(s.state for s in slots), "state counts"
        held = [i for ids in self.reserved.values() for i in ids]
        assert sorted(held) == [s.index for s in slots if s.state == SlotState.RESERVED], "reserved"
        due = {(e, i, g) for e, i, g in self._expiry}
        for s in slots:
            expirable = s.state == SlotState.WRITING or (s.state == SlotState.PRIVATE and s.request_id)
            if expirable and s.leases == s.writers == 0:
                assert (s.expires, s.index, s.generation) in due, f"slot {s.index} would never expire"

    # -- internals -----------------------------------------------------------------------------------
    def _set_state(self, slot: Slot, state: SlotState) -> None:
        self.in_state[slot.state] -= 1
        self.in_state[state] += 1
        slot.state = state
        if self.on_change is not None:
            self.on_change(slot)

    def _touch(self, owner: str) -> None:
        if owner:
            self.reserve_expires[owner] = self.clock() + self.reserve_ttl_s

    def _reserved_slot(self, owner: str, want: tuple[int, int] | None) -> Slot | None:
        """The slot `want` names, if it is still `owner`'s reservation at that generation."""
        if want is None or want[0] not in self.reserved.get(owner, ()):
            return None
        slot = self.slots[want[0]]
        return slot if slot.generation == want[1] else None

    def _free_spare(self, plan: PutPlan) -> int:
        """Free the named slots `plan` did not keep (those still reserved: a lapse may have freed one)."""
        held = self.reserved.get(plan.owner, set())
        freed = [i for i, gen in plan.spare if i in held and self.slots[i].generation == gen]
        for index in freed:
            held.discard(index)
            self._release(self.slots[index])
        plan.spare = []
        return len(freed)

    def _set_expiry(self, slot: Slot, expires: float) -> None:
        slot.expires = expires
        heapq.heappush(self._expiry, (expires, slot.index, slot.generation))

    def _untrack(self, slot: Slot) -> None:
        owned = self.by_request.get(slot.request_id)
        if owned is not None:
            owned.discard(slot.index)
            if not owned:
                del self.by_request[slot.request_id]

    def _allocate(self, evicted: list[Location]) -> Slot | None:
        if self.free:
            slot = self.slots[self.free.popleft()]
        elif self.lru:
            index, _ = self.lru.popitem(last=False)
            slot = self.slots[index]
            evicted.append(self.location(slot))
            self._evict(slot)
        else:
            return None
        slot.generation += 1
        return slot

    def _evict(self, slot: Slot) -> None:
        self.counters["evictions"] += 1
        if self.index.get(slot.key) == slot.index:  # a newer copy of the key keeps its entry
            del self.index[slot.key]
        self._set_state(slot, SlotState.FREE)
        slot.key, slot.written = b"", 0

    def _release(self, slot: Slot) -> None:
        if slot.state in (SlotState.WRITING, SlotState.PUBLISHED) and self.index.get(slot.key) == slot.index:
            del self.index[slot.key]
        self.lru.pop(slot.index, None)
        self._untrack(slot)
        self._set_state(slot, SlotState.FREE)
        slot.key, slot.written, slot.request_id, slot.leases = b"", 0, "", 0
        slot.released = False
        self.free.append(slot.index)
