"""LockStep: the per-iteration sync of an expert-parallel decode group (one rank here: Comm.single)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvferry.model.moe import ExpertParallelMoe
from kvferry.model.parallel import Comm
from kvferry.worker.ep import LockStep


def make(num_layers: int = 2, experts: int = 4) -> tuple[LockStep, list[ExpertParallelMoe]]:
    moes = [ExpertParallelMoe(8, 4, experts, 2, True, Comm.single()) for _ in range(num_layers)]
    engine = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(mlp=m) for m in moes]))
    return LockStep(engine, Comm.single()), moes


def test_work_flag_and_expert_load():
    sync, moes = make()
    assert sync(False) is False and sync(True) is True
    moes[0].load.add(torch.tensor([3, 0, 1, 0]), 0.002)
    moes[1].load.add(torch.tensor([0, 2, 0, 2]), 0.001)
    sync(False)
    load = sync.expert_load()
    assert [list(layer.tokens) for layer in load.layers] == [[3, 0, 1, 0], [0, 2, 0, 2]]
    assert list(load.rank_tokens) == [8]
    assert abs(load.rank_moe_ms[0] - 3.0) < 1e-9 and load.balance == 1.0


def test_a_stopping_rank_stops_the_group():
    sync, _ = make()
    stopped = []
    sync.on_group_stop = lambda: stopped.append(True)
    assert sync(True) is True and not stopped
    sync.stopping = True
    assert sync(True) is False  # no rank steps once any rank announced its stop
    assert stopped == [True]


def test_a_draining_rank_drains_the_group_which_is_idle_only_when_no_rank_holds_requests():
    sync, _ = make()
    drains = []
    sync.on_group_drain = lambda: drains.append(True)
    held = [True]
    sync.busy = lambda: held[0]
    sync(False)
    assert not drains and not sync.group_idle()  # nobody drains yet
    sync.draining = True
    sync(False)
    assert not drains  # this rank started the drain: nothing to follow
    assert not sync.group_idle()  # it still holds a request
    held[0] = False
    sync(False)
    assert sync.group_idle()
