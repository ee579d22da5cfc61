"""`kvferry scale`: setting the number of prefill / decode groups of a running cluster.

One algorithm (`scale`) for every launcher; each launcher (`LocalCluster` for `kvferry up`, the Ray
`Controller` for `kvferry up --ray`) implements `GroupLauncher`: how a group starts, becomes ready,
drains and goes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from kvferry.deploy.config import ClusterConfig

Group = TypeVar("Group")  # a launcher's handle of one worker group (all its ranks)


class ScaleRefused(ValueError):
    """A target the cluster cannot take (nothing was started or stopped)."""


class GroupLauncher(Protocol[Group]):
    def live_groups(self, role: str) -> list[Group]:
        """The role's groups that serve or will serve again, oldest first. A group that is gone for
        good is left out (and forgotten): scaling replaces it instead of counting it."""

    def start_group(self, role: str, kind: int) -> Group:
        """Start a group of kind `kind` (its index in cfg.groups(role)); returns without waiting for it
        to register. One that cannot start leaves nothing behind and raises."""

    def wait_ready(self, started: list[Group], deadline: float) -> None:
        """Wait until the router reports every live group; raise when `deadline` (time.monotonic())
        passes first (or sooner, e.g. `kvferry up` raises as soon as one of `started` exits)."""

    def discard(self, started: list[Group]) -> None:
        """Kill and forget groups started by a scale that failed (they may be half up)."""

    def retire(self, groups: list[Group]) -> None:
        """Drain `groups` (they finish what they hold), stop them and forget them."""

    def say(self, text: str) -> None:
        """Report progress."""


def check_targets(cfg: ClusterConfig, prefill: int | None, decode: int | None) -> None:
    """Refuse (ScaleRefused) a count below 1, or any prefill count for a colocated cluster."""
    for role, n in (("prefill", prefill), ("decode", decode)):
        if n is None:
            continue
        if role == "prefill" and cfg.colocated:
            raise ScaleRefused("a colocated cluster has no prefill groups to scale")
        if n < 1:
            raise ScaleRefused(f"{role} groups must be >= 1 (a cluster needs both phases), got {n}")


def scale(
    launcher: GroupLauncher, cfg: ClusterConfig, prefill: int | None = None, decode: int | None = None
) -> None:
    """Set the number of prefill / decode groups (None: leave that role as it is). New groups, of the
    role's first kind, start and register first; then the newest surplus groups drain and go. A scale
    that fails (a new group does not start, exits, or the router does not see it within
    cfg.startup_timeout_s) kills what it started and raises: the groups that served before serve on."""
    check_targets(cfg, prefill, decode)
    started, surplus = [], []
    try:
        for role, n in (("prefill", prefill), ("decode", decode)):
            if n is None:
                continue
            groups = launcher.live_groups(role)
            if n != len(groups):
                launcher.say(f"scaling {role} groups {len(groups)} -> {n}")
            for _ in range(n - len(groups)):
                started.append(launcher.start_group(role, 0))
            surplus += groups[n:]
        launcher.wait_ready(started, time.monotonic() + cfg.startup_timeout_s)
    except BaseException:
        launcher.discard(started)
        raise
    launcher.retire(surplus)
