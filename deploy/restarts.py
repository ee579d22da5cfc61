"""When a launcher restarts a dead unit (redis, a pool node, a worker group, the router), and when it
gives up: the one rule `kvferry up` applies to every unit it supervises.

A unit restarts at most `max` times within a sliding `window_s`; before each restart it waits
`backoff_s`, doubled for every restart already in the window (1 s, 2 s, 4 s ... at most
`max_backoff_s`), so a unit that crashes at once on start does not spin the host. One more death in
the window and the unit is left down: the launcher reports it and serves on with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.deploy.config import RestartSettings


@dataclass
class RestartBudget:
    """The restart history of one unit (pure bookkeeping: times come from the caller)."""

    settings: RestartSettings = field(default_factory=RestartSettings)
    history: list[float] = field(default_factory=list)  # when each restart happened (monotonic s)

    def recent(self, now: float) -> int:
        """Restarts within the window that ends at `now`."""
        self.history = [t for t in self.history if now - t < self.settings.window_s]
        return len(self.history)

    def delay(self, now: float) -> float | None:
        """Seconds to wait before the next restart of a unit that died at `now`; None: given up."""
        n = self.recent(now)
        if n >= self.settings.max:
            return None
        return min(self.settings.max_backoff_s, self.settings.backoff_s * 2**n)

    def record(self, now: float) -> int:
        """Count a restart made at `now`; returns the restarts in the window, this one included."""
        self.history.append(now)
        return self.recent(now)
