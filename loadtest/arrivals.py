"""Open-loop arrivals: send times fixed in advance, whatever the server does (not closed-loop users).

Gaps are gamma-distributed with shape `burstiness` and mean 1/rate: burstiness 1 is a Poisson process,
below 1 burstier, above 1 more regular (as `vllm bench serve --burstiness`). One `ArrivalSchedule` is
shared by every locust user of a process, so the target rate is the total, however many users run.
"""

from __future__ import annotations

import threading

import numpy as np


def arrival_offsets(rate: float, duration_s: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of an open-loop process at `rate` req/s over `duration_s`."""
    if rate <= 0 or duration_s <= 0 or burstiness <= 0:
        raise ValueError(f"rate, duration and burstiness must be > 0, got {rate}, {duration_s}, {burstiness}")
    rng = np.random.default_rng(seed)
    expected = rate * duration_s
    out: list[float] = []
    t = 0.0
    while True:  # in batches: a few draws more than expected, until past the end
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=int(expected * 1.2) + 16)
        for gap in gaps:
            t += float(gap)
            if t >= duration_s:
                return out
            out.append(t)


class ArrivalSchedule:
    """Hands out the send times of one open-loop process to whichever user asks next (thread-safe)."""

    def __init__(self, offsets: list[float], start: float):
        self.times = [start + o for o in offsets]
        self._next = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.times)

    def claim(self) -> float | None:
        """The next unclaimed send time, or None when the schedule is used up."""
        with self._lock:
            if self._next >= len(self.times):
                return None
            self._next += 1
            return self.times[self._next - 1]
