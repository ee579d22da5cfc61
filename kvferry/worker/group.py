"""A worker group: one prefill (tensor-parallel) or decode (expert-parallel) replica of 1..N ranks.

The ranks rendezvous in the cluster's Redis (kvpool.rendezvous: a password, TLS across hosts; no
store listener) under a name fresh for each launch. Rank 0, started alone, picks the name and spawns
the other ranks itself (this command again with `--rank r --dist-init NAME`); an external launcher
(Ray) picks it and starts every rank with those flags instead. Every rank then joins the group's process group
(`init_group`: gloo on CPU, NCCL with a gloo side group on GPU). A lone worker is a group of one and
forms nothing.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from kvferry.engine.engine import EngineConfig
from kvferry.kvpool.metadata import MetadataStore
from kvferry.kvpool.rendezvous import fresh_name
from kvferry.model.parallel import Comm, init_group
from kvferry.proc import dying_with_parent, terminate

log = logging.getLogger(__name__)


@dataclass
class Group:
    """This process's place in its worker group (a lone worker is a group of one)."""

    group_id: str
    rank: int
    size: int
    comm: Comm
    children: list[subprocess.Popen] = field(default_factory=list)
    store: object = None  # the group's rendezvous store (kept alive with the group: NCCL may read it later)

    @classmethod
    def single(cls, group_id: str) -> Group:
        return cls(group_id, 0, 1, Comm.single())

    def member_id(self) -> str:
        return self.group_id if self.size == 1 else f"{self.group_id}.r{self.rank}"

    def stop_children(self, timeout_s: float = 10.0) -> None:
        terminate(self.children, timeout_s)


RENDEZVOUS_S = 300.0  # how long a rank waits for the others to join (they load the model first)


def form_group(
    args, cfg: EngineConfig, role: str, group_id: str, argv: list[str], meta: MetadataStore
) -> tuple[Group, EngineConfig]:
    """Join (rank 0 alone: and start the other ranks of) the group, meeting in `meta`'s Redis; returns
    it and this rank's config."""
    size = cfg.tensor_parallel_size * cfg.expert_parallel_size
    if size == 1:
        return Group.single(group_id), cfg
    rank = args.rank or 0
    if not 0 <= rank < size:
        raise SystemExit(f"--rank {rank} is outside a group of {size}")
    if cfg.device in ("auto", "cuda") and torch.cuda.is_available():  # one GPU per rank
        cfg = replace(cfg, device=f"cuda:{rank % torch.cuda.device_count()}")
    children = []
    if args.dist_init:
        name = args.dist_init
    else:
        if args.rank:
            raise SystemExit("--rank > 0 needs --dist-init NAME (the group's rendezvous name)")
        name = fresh_name(group_id)
        for r in range(1, size):  # the other ranks: this command again, with their rank
            cmd = [sys.executable, "-m", f"kvferry.{role}_worker", *argv, "--worker-id", group_id]
            cmd += ["--port", "0", "--rank", str(r), "--dist-init", name]
            # SIGKILL: a rank is of no use without rank 0 (and TP followers ignore SIGTERM)
            children.append(
                subprocess.Popen(dying_with_parent(cmd, signal.SIGKILL), stdin=subprocess.DEVNULL)
            )
    store = meta.rendezvous(name, RENDEZVOUS_S)
    device = torch.device(cfg.device if cfg.device != "auto" else "cpu")
    log.info("joining group %s as rank %d of %d", group_id, rank, size)
    comm = init_group(store, group_id, rank, size, device, args.host)
    return Group(group_id, rank, size, comm, children, store), cfg


def group_min(comm: Comm, value: int) -> int:
    """The smallest `value` over the group's ranks (a group of one: `value`)."""
    return int(comm.all_reduce(torch.tensor([value], dtype=torch.int64), dist.ReduceOp.MIN, cpu=True).item())
