"""Prefill and decode workers that share one host's cores: prefill says when it computes, decode yields.

A prompt's prefill is compute-bound and sets TTFT; a decode step at a small batch is memory-bound and far
inside its TPOT SLO. Where both kinds of worker run on the same cores (`kvferry up` on one host), every
decode step taken while a prefill computes slows that prefill: the decode rank's thread takes a core
(or an SMT sibling's execution units) that the prefill's team is waiting on at its next barrier. CPU
priority (nice 19) alone does not stop it: the decode step runs whenever a prefill thread waits.

So the launcher gives the workers of one host a directory on its tmpfs (`WorkerConfig.host_share_dir`):
- every prefill rank keeps one 8-byte mark there (`PrefillMark`, a shared mapping): the
  `time.monotonic_ns()` of its latest step while it has work, 0 when idle;
- a decode rank (`HostPrefill`) looks at the marks before each step and, while one is set, holds its next
  step back until the prefill is done or `decode_yield_ms` has passed since its previous step started
  (its streams' TPOT stays bounded however busy prefill is).

A mark older than `STALE_S` is ignored (a prefill that died or hangs inside a step never holds decode
back for longer), and the marks of processes that are gone are removed when a decode rank rescans the
directory. CLOCK_MONOTONIC is one clock for every process of the host.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import time
from pathlib import Path

log = logging.getLogger(__name__)

MARK = struct.Struct("q")
STALE_S = 10.0  # a mark not renewed for this long is a dead or hung prefill's: ignored
RESCAN_S = 1.0  # how often a decode rank lists the directory for prefill ranks that came or went
POLL_S = 0.001  # a yielding decode rank looks at the marks this often


class PrefillMark:
    """This prefill rank's mark in the host's share directory (`<dir>/prefill.<pid>`)."""

    def __init__(self, directory: str | Path):
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"prefill.{os.getpid()}"
        # no O_TRUNC: a decode rank may still map the file of a dead process that had this pid (shrinking it
        # would fault that reader); the 8 bytes are written before they are mapped, so a full tmpfs fails
        # here (OSError) instead of faulting the engine loop at its first mark
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.pwrite(fd, MARK.pack(0), 0) != MARK.size:
                raise OSError(f"cannot write the prefill mark {self.path}")
            self._map = mmap.mmap(fd, MARK.size)
        finally:
            os.close(fd)
        self.busy = False

    def set(self, busy: bool) -> None:
        """Busy: (re)stamp the mark now (a step is about to run); idle: clear it."""
        if busy or self.busy:
            MARK.pack_into(self._map, 0, time.monotonic_ns() if busy else 0)
        self.busy = busy

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.set(False)
            self._map.close()
        self.path.unlink(missing_ok=True)


def _pid_of(name: str) -> int | None:
    prefix, _, pid = name.partition(".")
    return int(pid) if prefix == "prefill" and pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


class HostPrefill:
    """A decode rank's view of the host's prefill ranks: whether one computes now."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._maps: dict[str, mmap.mmap] = {}
        self._scanned = float("-inf")

    def busy(self) -> bool:
        """A prefill rank of this host has work (its mark is set and fresh)."""
        if time.monotonic() - self._scanned > RESCAN_S:
            self._scan()
        now = time.monotonic_ns()
        for mapping in self._maps.values():
            stamp = MARK.unpack_from(mapping, 0)[0]
            if stamp and now - stamp < STALE_S * 1e9:
                return True
        return False

    def wait_idle(self, deadline: float, stopped) -> float:
        """Hold back until no prefill rank computes, `deadline` (time.perf_counter) passes, or the
        event `stopped` is set; returns the seconds held back. (The inbox waits meanwhile: a call
        submitted to the loop runs at most the bound later.)"""
        start = time.perf_counter()
        while self.busy() and time.perf_counter() < deadline and not stopped.wait(POLL_S):
            pass
        return time.perf_counter() - start

    def _scan(self) -> None:
        self._scanned = time.monotonic()
        try:
            names = {entry.name for entry in os.scandir(self.directory)}
        except OSError:
            names = set()
        for name in list(self._maps):
            pid = _pid_of(name)
            if name not in names or pid is None or not _alive(pid):
                self._maps.pop(name).close()
        for name in names - set(self._maps):
            pid = _pid_of(name)
            if pid is None:
                continue
            if not _alive(pid):  # its process is gone (killed: it never cleared its mark)
                with contextlib.suppress(OSError):
                    (self.directory / name).unlink()
                continue
            try:
                with open(self.directory / name, "r+b") as f:
                    self._maps[name] = mmap.mmap(f.fileno(), MARK.size, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # removed meanwhile, or not yet sized
                continue

    def close(self) -> None:
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()
