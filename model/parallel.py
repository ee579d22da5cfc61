"""Process groups for tensor- and expert-parallel groups, and how a model is split across their ranks.

A group of N ranks holds two process groups over one store (a worker group's: its rendezvous in
Redis): `cpu` (always gloo: control messages, step inputs, the lock-step sync) and `device` (the
tensors of the forward pass: NCCL when the ranks run on CUDA, the same gloo group on CPU). `Comm`
calls the process-group objects directly rather than through the global default group, so several
groups (and, in tests, several ranks as threads) can live in one process. A `Comm` of size 1 turns
every collective into a no-op. A group is formed with a long timeout (SETUP_TIMEOUT_S: every rank
joins and loads its weights at its own pace); a serving group then shortens it (`Comm.set_timeout`),
so a collective waiting on a hung rank fails within that time instead of holding the group for
minutes.

Tensor parallelism (Megatron): attention heads and KV heads are split across ranks (KV heads are
replicated when ranks outnumber them), QKV and gate/up are column-parallel, the output and down
projections row-parallel (one all-reduce each), the embedding and lm_head vocab-parallel.
Expert parallelism: rank r owns experts [r*E/N, (r+1)*E/N); everything else is replicated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

SETUP_TIMEOUT_S = 600.0  # forming the group, and whatever runs before `Comm.set_timeout`


class ParallelConfigError(ValueError):
    """A parallel degree the model cannot be split by (the message says which dimension)."""


class Comm:
    """Collectives of one group, as seen by one rank."""

    def __init__(self, rank: int = 0, size: int = 1, cpu=None, device=None):
        self.rank, self.size = rank, size
        self.cpu = cpu  # gloo ProcessGroup (None when size == 1)
        self.device = device if device is not None else cpu
        self.timeout_s = SETUP_TIMEOUT_S  # how long a collective waits for the other ranks

    @classmethod
    def single(cls) -> Comm:
        return cls()

    def set_timeout(self, timeout_s: float) -> None:
        """Every later collective of this group (both process groups) fails after `timeout_s`."""
        for pg in {id(g): g for g in (self.cpu, self.device) if g is not None}.values():
            pg._set_default_timeout(timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, cpu: bool = False) -> torch.Tensor:
        """In place; returns `t`."""
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            (self.cpu if cpu else self.device).allreduce([t], opts).wait()
        return t

    def all_gather(self, t: torch.Tensor, cpu: bool = False) -> list[torch.Tensor]:
        """Every rank's `t` (same shape on all ranks), in rank order."""
        if self.size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.size)]
        (self.cpu if cpu else self.device).allgather([out], [t.contiguous()]).wait()
        return out

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> torch.Tensor:
        """Rows inp[sum(in_splits[:r]) : ...] go to rank r; rank r's rows for us land in `out`."""
        if self.size == 1:
            out.copy_(inp)
            return out
        self.device.alltoall_base(out, inp.contiguous(), out_splits, in_splits, dist.AllToAllOptions()).wait()
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0, cpu: bool = True) -> torch.Tensor:
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            (self.cpu if cpu else self.device).broadcast([t], opts).wait()
        return t

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0 sends `data`, every rank returns it (over the gloo group: control messages)."""
        if self.size == 1:
            return data or b""
        size = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        self.broadcast(size)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.rank == 0 and data
            else torch.empty(int(size.item()), dtype=torch.uint8)
        )
        if buf.numel():
            self.broadcast(buf)
        return buf.numpy().tobytes()

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1), cpu=True)


def init_group(
    store: dist.Store,
    name: str,
    rank: int,
    size: int,
    device: torch.device,
    host: str = "127.0.0.1",
    timeout_s: float = SETUP_TIMEOUT_S,
) -> Comm:
    """Join group `name` of `size` ranks on `store` (blocks until every rank joined)."""
    if size == 1:
        return Comm.single()
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    cpu = dist.ProcessGroupGloo(dist.PrefixStore(f"kvferry/group/{name}/cpu/", store), rank, size, opts)
    dev = None
    if device.type == "cuda":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = timedelta(seconds=timeout_s)
        prefix = dist.PrefixStore(f"kvferry/group/{name}/nccl/", store)
        dev = dist.ProcessGroupNCCL(prefix, rank, size, nccl)
    comm = Comm(rank, size, cpu, dev)
    comm.timeout_s = timeout_s
    return comm


@dataclass
class Parallel:
    """How this rank's copy of the model is split: a TP group and an EP group (either may be size 1)."""

    tp: Comm
    ep: Comm

    @classmethod
    def single(cls) -> Parallel:
        return cls(Comm.single(), Comm.single())

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def ep_size(self) -> int:
        return self.ep.size


@dataclass(frozen=True)
class TPShard:
    """Which heads, KV heads, intermediate columns and vocab rows rank `rank` of `size` holds."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int

    @property
    def heads(self) -> range:
        n = self.num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_heads(self) -> range:
        """KV heads held here: a slice of them, or one head shared by size/num_kv_heads ranks."""
        if self.size <= self.num_kv_heads:
            n = self.num_kv_heads // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        head = self.rank // (self.size // self.num_kv_heads)
        return range(head, head + 1)

    @property
    def writes_kv(self) -> bool:
        """True for the first rank of each KV-head replica set: it alone writes the slice out."""
        return self.size <= self.num_kv_heads or self.rank % (self.size // self.num_kv_heads) == 0

    def columns(self, total: int) -> slice:
        """This rank's share of a dimension split evenly (intermediate sizes)."""
        n = total // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows per rank): the vocabulary is padded up to a multiple of `size`."""
        per = -(-vocab_size // self.size)
        return self.rank * per, per


def check_tp(cfg, size: int) -> None:
    """Raise ParallelConfigError unless the model splits evenly `size` ways."""
    if size < 1:
        raise ParallelConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    problems = []
    if cfg.num_heads % size:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads={cfg.num_kv_heads} (nor does {size} divide by it)")
    for name, value in (
        ("intermediate_size", cfg.intermediate_size),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
    ):
        if value % size:
            problems.append(f"{name}={value}")
    if problems:
        raise ParallelConfigError(f"tensor_parallel_size={size} does not divide {', '.join(problems)}")


def check_ep(cfg, size: int) -> None:
    """Raise ParallelConfigError unless `size` ranks can each hold at least one expert."""
    if size < 1:
        raise ParallelConfigError(f"expert_parallel_size must be >= 1, got {size}")
    if size > 1 and cfg.num_experts == 0:
        raise ParallelConfigError(f"expert_parallel_size={size} needs a MoE model (num_experts=0)")
    if size > max(cfg.num_experts, 1):
        raise ParallelConfigError(
            f"expert_parallel_size={size} exceeds num_experts={cfg.num_experts} (every rank holds an expert)"
        )


def expert_range(num_experts: int, size: int, rank: int) -> range:
    """The global expert ids rank `rank` of an expert-parallel group of `size` holds: a contiguous range,
    E // size experts each, the first E % size ranks one more (5 experts on 2 ranks: 0-2 | 3-4)."""
    base, extra = divmod(num_experts, size)
    first = rank * base + min(rank, extra)
    return range(first, first + base + (1 if rank < extra else 0))


def expert_owner(num_experts: int, size: int) -> torch.Tensor:
    """[num_experts] int64: the rank holding each expert (`expert_range`'s map)."""
    owner = torch.empty(
        num_experts, dtype=torch.long, device="cpu"
    )  # not the meta device a model is built on
    for rank in range(size):
        experts = expert_range(num_experts, size, rank)
        owner[experts.start : experts.stop] = rank
    return owner


def _convert(value, fn):
    """Tensors <-> numpy arrays inside results (torch's queue pickling shares memory that dies with the
    child; numpy arrays travel by value)."""
    import numpy as np

    if isinstance(value, torch.Tensor | np.ndarray):
        return fn(value.detach().cpu() if isinstance(value, torch.Tensor) else value)
    if isinstance(value, list | tuple):
        return type(value)(_convert(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _convert(v, fn) for k, v in value.items()}
    return value


def _rank_main(target, rank: int, size: int, port: int, args: tuple, results) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        results.put((rank, _convert(target(store, rank, size, *args), lambda t: t.numpy()), None))
    except BaseException as err:
        import traceback

        results.put((rank, None, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def spawn_ranks(target, size: int, args: tuple = (), timeout_s: float = 300.0) -> list:
    """Run `target(store, rank, size, *args)` in `size` fresh processes; their return values, by rank.

    For tests and benchmarks on one host (gloo groups must not share a process: the group constructor
    can hold the GIL while it waits for its peers). `target` must be importable (module level).
    """
    import multiprocessing as mp
    import queue as queue_mod

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(target, r, size, store.port, args, results), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < size:
            try:
                rank, value, error = results.get(timeout=0.2)
            except queue_mod.Empty:
                missing = sorted(set(range(size)) - set(out))
                dead = [r for r in missing if procs[r].exitcode is not None]
                if dead and results.empty():  # died without a word (a crash, os._exit, no target)
                    codes = {r: procs[r].exitcode for r in dead}
                    raise RuntimeError(f"rank(s) exited without a result (exit codes {codes})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {missing} did not finish") from None
                continue
            if error is not None:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            out[rank] = _convert(value, torch.from_numpy)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(size)]
