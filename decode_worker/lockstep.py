"""The expert-parallel group protocol: every rank of a decode group steps in lock-step.

Each rank serves its own clients and schedules its own batch (data-parallel attention), but every MoE
layer exchanges tokens with all ranks (`all_to_all`), so all of them must run every step together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvferry.engine.engine import LLMEngine
from kvferry.model.moe import ExpertParallelMoe
from kvferry.model.parallel import Comm, expert_range
from kvferry.v1 import worker_pb2


class LockStep:
    """The per-iteration sync of an expert-parallel group, and the group's expert-load figures.

    Every engine-loop iteration each rank all-gathers [has work, stopping, seconds in its experts,
    draining, requests held, token assignments per local expert per MoE layer]; if any rank has
    work, all of them step (an idle rank with an empty batch, so every MoE layer's all_to_all has all
    ranks). The same exchange gives every rank the whole group's expert load, so any rank's GetStats
    can report it, and drains the group as one: once any rank drains, every rank does, and the group
    stops only when no rank holds a request.
    """

    HEADER = 5  # has work, stopping, expert seconds, draining, holds requests

    def __init__(self, engine: LLMEngine, comm: Comm):
        self.comm = comm
        self.moe = [layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, ExpertParallelMoe)]
        num_experts = self.moe[0].owner.numel() if self.moe else 0
        # each rank's experts (uneven maps: the first E mod M ranks hold one more); every rank sends
        # `width` counts per layer, its own padded with zeros, so the all-gathered rows line up
        self.rank_experts = [len(expert_range(num_experts, comm.size, r)) for r in range(comm.size)]
        self.width = max(self.rank_experts, default=0)
        self.view = torch.zeros(comm.size, self.HEADER + len(self.moe) * self.width, dtype=torch.float64)
        self.stopping = False  # this rank is shutting down (it tells the others in the next sync)
        self.draining = False  # this rank takes no new requests (the others follow)
        self.busy: Callable[[], bool] = lambda: False  # this rank holds requests
        self.on_group_stop: Callable[[], None] | None = None
        self.on_group_drain: Callable[[], None] | None = None

    def __call__(self, has_work: bool) -> bool:
        mine = [float(has_work), float(self.stopping), sum(m.load.seconds for m in self.moe)]
        mine += [float(self.draining), float(self.busy())]
        for m in self.moe:
            counts = m.load.token_counts()
            mine += counts + [0] * (self.width - len(counts))
        self.view = torch.stack(self.comm.all_gather(torch.tensor(mine, dtype=torch.float64), cpu=True))
        if self.view[:, 1].any():  # a rank is stopping: no rank steps again
            if self.on_group_stop is not None:
                self.on_group_stop()
            return False
        if self.view[:, 3].any() and not self.draining and self.on_group_drain is not None:
            self.on_group_drain()  # another rank drains: so does this one
        return bool(self.view[:, 0].any())

    def group_idle(self) -> bool:
        """As of the last sync: every rank drains and none holds a request."""
        return bool(self.view[:, 3].all()) and not self.view[:, 4].any()

    def expert_load(self) -> worker_pb2.ExpertLoad:
        view = self.view
        padded = view[:, self.HEADER :].view(self.comm.size, len(self.moe), self.width)  # [rank, layer, slot]
        # [layer, global expert]: each rank's own experts, in rank order (= global expert order)
        tokens = torch.cat([padded[r, :, :n] for r, n in enumerate(self.rank_experts)], dim=1)
        moe_ms = (view[:, 2] * 1e3).tolist()
        peak, per_expert = max(moe_ms), tokens.sum(0)
        busiest = float(per_expert.max()) if per_expert.numel() else 0.0
        return worker_pb2.ExpertLoad(
            layers=[worker_pb2.LayerExpertTokens(tokens=[int(t) for t in row.tolist()]) for row in tokens],
            rank_tokens=[int(padded[r].sum()) for r in range(self.comm.size)],
            rank_moe_ms=moe_ms,
            balance=sum(moe_ms) / len(moe_ms) / peak if peak > 0 else 1.0,
            rank_experts=self.rank_experts,
            expert_balance=float(per_expert.mean()) / busiest if busiest > 0 else 1.0,
        )
