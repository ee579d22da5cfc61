"""The scaling algorithm both launchers share (deploy.scaling.scale), on an in-memory launcher."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from kvferry.deploy.config import ClusterConfig
from kvferry.deploy.scaling import ScaleRefused, scale


class NotReady(RuntimeError):
    pass


@dataclass
class Group:
    name: str
    kind: int
    alive: bool = True


@dataclass
class FakeLauncher:
    """Groups are records; `ready` says whether the router would see the new ones."""

    groups: dict[str, list[Group]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    ready: bool = True
    fail_start_after: int | None = None  # start_group raises once this many groups started
    started: list[str] = field(default_factory=list)
    discarded: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    count: int = 0

    def add(self, role: str, n: int) -> FakeLauncher:
        for _ in range(n):
            self.start_group(role, 0)
        self.started.clear()
        return self

    def names(self, role: str) -> list[str]:
        return [g.name for g in self.groups[role]]

    def live_groups(self, role: str) -> list[Group]:
        self.groups[role] = [g for g in self.groups[role] if g.alive]
        return list(self.groups[role])

    def start_group(self, role: str, kind: int) -> Group:
        if self.fail_start_after is not None and len(self.started) >= self.fail_start_after:
            raise NotReady("cannot place the group")
        group = Group(f"{role}-{self.count}", kind)
        self.count += 1
        self.groups[role].append(group)
        self.started.append(group.name)
        return group

    def wait_ready(self, started: list[Group], deadline: float) -> None:
        if not self.ready:
            raise NotReady("the cluster was not ready in time")

    def discard(self, started: list[Group]) -> None:
        for group in started:
            self.groups[group.name.split("-")[0]].remove(group)
            self.discarded.append(group.name)

    def retire(self, groups: list[Group]) -> None:
        for group in groups:
            self.groups[group.name.split("-")[0]].remove(group)
            self.retired.append(group.name)

    def say(self, text: str) -> None:
        self.said.append(text)


CFG = ClusterConfig()


def test_grow_starts_groups_of_the_first_kind():
    launcher = FakeLauncher().add("prefill", 1).add("decode", 1)
    scale(launcher, CFG, decode=3)
    assert launcher.names("decode") == ["decode-1", "decode-2", "decode-3"]
    assert launcher.names("prefill") == ["prefill-0"]  # None: left as it is
    assert [g.kind for g in launcher.groups["decode"]] == [0, 0, 0]
    assert (launcher.retired, launcher.discarded) == ([], [])
    assert launcher.said == ["scaling decode groups 1 -> 3"]


def test_shrink_retires_the_newest_after_the_wait():
    launcher = FakeLauncher().add("prefill", 3).add("decode", 2)
    scale(launcher, CFG, prefill=1, decode=1)
    assert launcher.retired == ["prefill-1", "prefill-2", "decode-4"]
    assert (launcher.names("prefill"), launcher.names("decode")) == (["prefill-0"], ["decode-3"])
    assert launcher.started == []


def test_failed_wait_discards_the_started_groups_and_keeps_the_old_ones():
    launcher = FakeLauncher(ready=False).add("prefill", 2).add("decode", 1)
    with pytest.raises(NotReady):
        scale(launcher, CFG, prefill=1, decode=3)
    assert launcher.discarded == ["decode-3", "decode-4"]
    assert launcher.retired == []  # the surplus prefill group serves on too
    assert (launcher.names("prefill"), launcher.names("decode")) == (["prefill-0", "prefill-1"], ["decode-2"])


def test_a_start_that_fails_discards_the_groups_started_before_it():
    launcher = FakeLauncher(fail_start_after=1).add("decode", 1)
    with pytest.raises(NotReady):
        scale(launcher, CFG, decode=3)
    assert launcher.discarded == ["decode-1"]
    assert launcher.names("decode") == ["decode-0"]


@pytest.mark.parametrize(
    ("cfg", "targets", "match"),
    [
        (CFG, {"decode": 0}, "decode groups must be >= 1"),
        (CFG, {"prefill": -1}, "prefill groups must be >= 1"),
        (replace(CFG, colocated=True), {"prefill": 1}, "colocated cluster has no prefill groups"),
    ],
)
def test_invalid_targets_are_refused_before_anything_changes(cfg, targets, match):
    launcher = FakeLauncher().add("prefill", 1).add("decode", 1)
    with pytest.raises(ScaleRefused, match=match):
        scale(launcher, cfg, **targets)
    assert isinstance(ScaleRefused(), ValueError)  # the Ray CLI answers a ValueError with exit code 2
    assert (launcher.started, launcher.retired, launcher.said) == ([], [], [])
    assert (launcher.names("prefill"), launcher.names("decode")) == (["prefill-0"], ["decode-1"])


def test_colocated_scales_decode():
    launcher = FakeLauncher().add("decode", 1)
    scale(launcher, replace(CFG, colocated=True), decode=2)
    assert launcher.names("decode") == ["decode-0", "decode-1"]


def test_dead_groups_are_replaced_not_counted():
    launcher = FakeLauncher().add("decode", 3)
    launcher.groups["decode"][1].alive = False
    scale(launcher, CFG, decode=3)
    assert launcher.names("decode") == ["decode-0", "decode-2", "decode-3"]
    assert launcher.retired == []
    launcher.groups["decode"][0].alive = False
    scale(launcher, CFG, decode=1)  # the dead one neither counts nor needs retiring
    assert launcher.retired == ["decode-3"]
    assert launcher.names("decode") == ["decode-2"]


def test_same_counts_change_nothing():
    launcher = FakeLauncher().add("prefill", 1).add("decode", 2)
    scale(launcher, CFG, prefill=1, decode=2)
    assert (launcher.started, launcher.retired, launcher.said) == ([], [], [])
