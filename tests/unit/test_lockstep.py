"""LockStep: the per-iteration sync of an expert-parallel decode group (one rank here: Comm.single)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvferry.decode_worker.lockstep import LockStep
from kvferry.model.moe import ExpertParallelMoe
from kvferry.model.parallel import Comm


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


class _TwoRanks:
    """Rank 0 of a 2-rank group whose other rank's all-gathered row is given (the sync's one collective)."""

    size, rank = 2, 0

    def __init__(self, other: list[float]):
        self.other = other

    def all_gather(self, mine: torch.Tensor, cpu: bool = False) -> list[torch.Tensor]:
        other = torch.tensor(self.other, dtype=mine.dtype)
        assert other.shape == mine.shape, "every rank sends rows of one width, whatever its experts"
        return [mine, other]


def test_expert_load_of_an_uneven_map():
    """5 experts on 2 ranks: rank 0 holds 0-2, rank 1 holds 3-4; rows are padded to 3 counts per layer
    and the report lists the 5 real experts per layer in global order."""
    # rank 1's row: header [work, stopping, seconds, draining, busy], then per layer 3 slots (last: pad)
    comm = _TwoRanks([1.0, 0.0, 0.004, 0.0, 0.0, 7, 1, 0, 2, 2, 0])
    moes = [ExpertParallelMoe(8, 4, 5, 2, True, comm) for _ in range(2)]
    assert [m.w13.shape[0] for m in moes] == [3, 3] and moes[0].first_expert == 0
    engine = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(mlp=m) for m in moes]))
    sync = LockStep(engine, comm)
    moes[0].load.add(torch.tensor([1, 2, 3]), 0.001)
    moes[1].load.add(torch.tensor([0, 0, 4]), 0.001)
    assert sync(False) is True  # the other rank has work
    load = sync.expert_load()
    assert [list(layer.tokens) for layer in load.layers] == [[1, 2, 3, 7, 1], [0, 0, 4, 2, 2]]
    assert list(load.rank_experts) == [3, 2]
    assert list(load.rank_tokens) == [10, 12]
    assert abs(load.balance - 3.0 / 4.0) < 1e-9  # mean(2, 4) / 4 ms
    per_expert = [1, 2, 7, 9, 3]
    assert abs(load.expert_balance - (sum(per_expert) / 5) / 9) < 1e-9


def test_expert_parallelism_of_any_degree_up_to_the_expert_count():
    from kvferry.model.parallel import ParallelConfigError, check_ep

    cfg = SimpleNamespace(num_experts=5)
    for size in range(1, 6):
        check_ep(cfg, size)
    with pytest.raises(ParallelConfigError, match="exceeds num_experts=5"):
        check_ep(cfg, 6)
    with pytest.raises(ParallelConfigError, match="needs a MoE model"):
        check_ep(SimpleNamespace(num_experts=0), 2)
