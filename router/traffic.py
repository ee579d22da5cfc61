"""What a router served over its last window, for the planner (deploy.planner).

The router counts each request as it arrives (both APIs) and each one served as it finishes: its prompt
tokens, the tokens its prefill computed (the prompt less its local and pool cache hits), its output
tokens, TTFT and TPOT; and each request admission predicted to miss its TTFT or TPOT target.
`summary()` gives the window's rates, means and percentiles of this router alone; the router publishes
it every second as its registry record (role `router`, one per router), where `kvferry up --autoscale`
reads every router's and sums them (`deploy.planner.Traffic.merge`).
"""

from __future__ import annotations

import threading
import time
from collections import deque

WINDOW_S = 20.0
MAX_EVENTS = 65536  # per kind: the memory stays bounded at any request rate


class TrafficWindow:
    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        self.arrivals: deque[tuple[float, int]] = deque(maxlen=MAX_EVENTS)  # (t, prompt tokens)
        # (t, prompt tokens, computed tokens, output tokens, ttft ms, tpot ms or None)
        self.served: deque[tuple[float, int, int, int, float | None, float | None]] = deque(maxlen=MAX_EVENTS)
        self.refused = deque(maxlen=MAX_EVENTS)
        self.misses: dict[str, deque[float]] = {
            "ttft": deque(maxlen=MAX_EVENTS),
            "tpot": deque(maxlen=MAX_EVENTS),
        }
        self._lock = threading.Lock()  # the event loop records, the heartbeat thread summarizes

    def arrived(self, prompt_tokens: int) -> None:
        with self._lock:
            self.arrivals.append((self.clock(), prompt_tokens))

    def rejected(self) -> None:
        with self._lock:
            self.refused.append(self.clock())

    def predicted_miss(self, reason: str) -> None:
        """A request admission predicted to miss its `reason` target (ttft | tpot): refused or queued last."""
        with self._lock:
            if reason in self.misses:
                self.misses[reason].append(self.clock())

    def finished(
        self,
        prompt_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        ttft_ms: float | None,
        tpot_ms: float | None,
    ) -> None:
        with self._lock:
            self.served.append(
                (
                    self.clock(),
                    prompt_tokens,
                    max(0, prompt_tokens - cached_tokens),
                    output_tokens,
                    ttft_ms,
                    tpot_ms,
                )
            )

    def _trim(self, now: float) -> None:
        oldest = now - self.window_s
        for events in (self.arrivals, self.served, self.refused, *self.misses.values()):
            while events and (events[0] if isinstance(events[0], float) else events[0][0]) < oldest:
                events.popleft()

    def summary(self) -> dict:
        with self._lock:
            now = self.clock()
            self._trim(now)
            arrivals, served, refused = list(self.arrivals), list(self.served), len(self.refused)
            misses = {reason: len(events) for reason, events in self.misses.items()}
        span = max(1e-3, min(self.window_s, now - self.started))
        out = {
            "window_s": round(span, 3),
            "arrival_rps": round(len(arrivals) / span, 4),
            "refused_rps": round(refused / span, 4),
            # predicted SLO misses (admission refused or deprioritized them): demand a role could not take
            "miss_ttft_rps": round(misses["ttft"] / span, 4),
            "miss_tpot_rps": round(misses["tpot"] / span, 4),
            "prompt_tokens": _mean([a[1] for a in arrivals]),
            "finished": len(served),
            "uncached_tokens": _mean([s[2] for s in served]),
            "output_tokens": _mean([s[3] for s in served]),
        }
        ttfts = sorted(s[4] for s in served if s[4] is not None)
        tpots = sorted(s[5] for s in served if s[5] is not None)
        for name, values in (("ttft", ttfts), ("tpot", tpots)):
            for q in (50, 90):
                out[f"{name}_p{q}_ms"] = _quantile(values, q / 100)
        return out


def _mean(values: list) -> float:
    return round(sum(values) / len(values), 3) if values else 0.0


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)
