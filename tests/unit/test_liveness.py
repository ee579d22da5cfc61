"""Liveness is progress: a worker whose engine thread hangs stops re-registering, and comes back."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from kvferry.deploy.fault_harness import wait_for
from kvferry.engine.loop import EngineLoop
from kvferry.rpc import Heartbeat
from kvferry.worker.runtime import stall_reason


class Registry:
    """An in-process registry: what `Heartbeat` uses of kvferry.kvpool.metadata.MetadataStore."""

    def __init__(self):
        self.registrations = 0
        self.unregistered = False

    def register(self, role, member_id, info, ttl_s):
        self.registrations += 1
        return True

    def unregister(self, role, member_id):
        self.unregistered = True


class IdleEngine:
    def has_unfinished(self) -> bool:
        return False


def test_a_worker_whose_engine_hangs_is_not_re_registered_until_it_moves_again():
    loop = EngineLoop(IdleEngine(), lambda outputs: None)
    worker = SimpleNamespace(loop=loop)
    registry = Registry()
    heartbeat = Heartbeat(registry, "decode", "d0", dict, 0.02, 0.1, lambda: stall_reason(worker, 0.3))
    loop.start()
    heartbeat.start()
    release = threading.Event()
    try:
        wait_for(lambda: registry.registrations >= 3, 10, "3 registrations")  # an idle loop is alive
        loop.submit(lambda: release.wait(20))  # the engine thread hangs (a step, a collective)
        wait_for(lambda: heartbeat.withheld, 10, "the heartbeat to be withheld")
        assert stall_reason(worker, 0.3).startswith("the engine loop has been in one iteration")
        count = registry.registrations
        time.sleep(0.3)  # (several heartbeat intervals: none of them registers)
        assert registry.registrations == count
        release.set()
        wait_for(lambda: not heartbeat.withheld and registry.registrations > count, 10, "a registration")
        assert stall_reason(worker, 0.3) is None
    finally:
        release.set()
        heartbeat.stopped.set()
        loop.stop()
        loop.join(10)
