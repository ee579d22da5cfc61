"""A prefill worker's published backlog as the router reads it (written by `kvferry.worker.backlog`,
whose docstring gives the record; the router cannot import the worker's room, so the format is checked
here, field by field: a record is never trusted blindly).

`router.directory` reads the records (the hash `kvf:{namespace}:prefill_backlog`, kvpool.metadata's
PREFILL_BACKLOG_KEY, at admission when its copy is older than BACKLOG_POLL_S, and the heartbeat's
`prefill_backlog` field) into `Member.backlog`; `router.slo` prices them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKLOG_POLL_S = 0.05  # the oldest copy of that hash admission prices with
BACKLOG_STALE_S = 3.0  # a backlog record that has not changed for this long is stale (workers: every 1 s)


@dataclass(frozen=True)
class Work:
    """Prefill work: prompt tokens to compute, of how many requests, in how many steps (chunks of the
    token budget), with how many thousand attention pairs (engine.cost_model)."""

    tokens: int = 0
    requests: int = 0
    steps: int = 0
    kpairs: float = 0.0

    @classmethod
    def from_list(cls, values) -> Work:
        tokens, requests, steps, kpairs = values
        numbers = (tokens, requests, steps, kpairs)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in numbers):
            raise ValueError(f"work {values!r}")
        if not all(math.isfinite(v) and v >= 0 for v in numbers):
            raise ValueError(f"work {values!r}")
        return cls(int(tokens), int(requests), int(steps), float(kpairs))


@dataclass(frozen=True)
class PublishedBacklog:
    """A prefill worker's backlog record (kvferry.worker.backlog), checked: per priority, (queued,
    running) work; the digests of the request ids it admitted lately."""

    boot: str
    seq: int
    time: float  # the worker's clock (orders records of two processes under one worker id only)
    levels: dict[int, tuple[Work, Work]]
    ids: frozenset[int]

    @classmethod
    def parse(cls, raw) -> PublishedBacklog:
        """`raw`: the record as JSON decoded. Raises KeyError, TypeError or ValueError if it is malformed."""
        boot, seq, at = raw["b"], raw["s"], raw["t"]
        if not isinstance(boot, str) or not isinstance(seq, int) or not isinstance(at, int | float):
            raise ValueError(f"b/s/t {boot!r} {seq!r} {at!r}")
        levels = {}
        if not isinstance(raw["p"], dict) or not all(isinstance(v, dict) for v in raw["p"].values()):
            raise TypeError(f"p {raw['p']!r}")
        for priority, level in raw["p"].items():
            levels[int(priority)] = (
                Work.from_list(level.get("q", (0, 0, 0, 0))),
                Work.from_list(level.get("r", (0, 0, 0, 0))),
            )
        ids = raw.get("ids", [])
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError("ids")
        return cls(boot, seq, float(at), levels, frozenset(ids))

    def newer_than(self, other: PublishedBacklog | None) -> bool:
        """Whether this record comes after `other` (of the same worker id)."""
        if other is None:
            return True
        if self.boot == other.boot:
            return self.seq > other.seq
        return self.time > other.time  # another process under the same id: the later one
