"""Prefill latency with tensor parallelism: TP=1 vs TP=2 on the bench model, compute vs communication.

One prompt of --prompt-len random tokens (1024 by default) is one prefill chunk of one forward pass
(ModelRunner.execute: every layer, then compute_logits of the last row), as a prefill worker runs it.
TP=1 is one rank process; TP=2 is two rank processes (kvferry.model.parallel.spawn_ranks) joined by a
gloo group, Megatron-split (heads and KV heads, gate/up columns, vocab), with one all-reduce after
attention and one after the MLP in every layer, one for the vocab-parallel embedding and an all-gather
of the logits. Each rank wraps its Comm's all_reduce/all_gather to add up the wall time spent inside
collectives: that is the communication figure (it includes waiting for the slower rank to arrive),
the rest of the forward is compute. Ranks meet at a barrier before every iteration; an iteration's
latency is the slower rank's; the figure reported is the median over --iters iterations after --warmup.

Every rank gets os.cpu_count() // size threads. On this 2-core CPU box the two TP ranks share the
same two cores that TP=1 uses alone, so the TP2/TP1 ratio mostly shows what communication (and
splitting the GEMMs in half) costs, not a gain from more hardware; the design is the one that scales
on a multi-GPU node, where each rank has its own GPU and the all-reduces go over NVLink (NCCL).
Because one process running 2 OpenMP threads and two processes of 1 thread are not the same thing on
a small VM, a reference TP=1 run with 1 thread is also reported (tp1_1thread_ms; --no-reference
skips it).

    python bench/prefill_tp.py [--prompt-len 1024] [--iters 5] [--warmup 1] [--dtype auto]

Last line: one JSON object (tp1_ms, tp2_ms, speedup = tp1_ms / tp2_ms, tp2_comm_ms, ...).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Timed, add_rank_bench_args, bench_model, print_result, rank_run, rank_threads

from kvferry.engine.model_runner import ModelRunner, StepInputs
from kvferry.model.loader import load_model
from kvferry.model.parallel import Comm, Parallel, init_group, spawn_ranks

BLOCK_SIZE = 16


def prefill_rank(
    store,
    rank: int,
    size: int,
    model_dir: str,
    dtype_name: str,
    prompt_len: int,
    iters: int,
    warmup: int,
    threads: int,
    label: str,
) -> dict:
    """One TP rank: load its shard, run warmup + timed prefills of the same prompt; per-iteration figures."""
    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    comm = init_group(store, "bench", rank, size, cpu)
    timer = Timed([(comm, "all_reduce"), (comm, "all_gather")])
    dtype = getattr(torch, dtype_name)
    model = load_model(model_dir, dtype, "cpu", prompt_len, Parallel(comm, Comm.single()))
    num_blocks = -(-prompt_len // BLOCK_SIZE)
    runner = ModelRunner(model, num_blocks, BLOCK_SIZE, cpu)
    gen = torch.Generator().manual_seed(0)  # the same prompt on every rank and for every TP size
    ids = torch.randint(10, model.cfg.vocab_size, (prompt_len,), generator=gen).tolist()
    positions = list(range(prompt_len))
    step = StepInputs(
        input_ids=ids,
        positions=positions,
        slot_blocks=[p // BLOCK_SIZE for p in positions],
        slot_offsets=[p % BLOCK_SIZE for p in positions],
        prefills=[(0, prompt_len, prompt_len, list(range(num_blocks)))],
        sample_rows=[prompt_len - 1],
    )
    total_ms, comm_ms = [], []
    calls = nbytes = 0
    logits = None
    for i in range(warmup + iters):
        comm.barrier()  # start together: an iteration's latency is then the slower rank's
        seconds, calls0, bytes0 = timer.seconds, timer.calls, timer.bytes  # the barrier is not counted
        t = time.perf_counter()
        logits = runner.execute(step)
        elapsed = time.perf_counter() - t
        if i >= warmup:
            total_ms.append(elapsed * 1e3)
            comm_ms.append((timer.seconds - seconds) * 1e3)
            calls, nbytes = timer.calls - calls0, timer.bytes - bytes0
        if rank == 0:
            what = "warmup" if i < warmup else f"iter {i - warmup}"
            print(
                f"  {label} {what}: {elapsed * 1e3:.1f} ms (rank 0 in collectives "
                f"{(timer.seconds - seconds) * 1e3:.1f} ms)",
                file=sys.stderr,
                flush=True,
            )
    return {
        "threads": threads,
        "total_ms": total_ms,
        "comm_ms": comm_ms,
        "collectives": calls,
        "collective_bytes": nbytes,
        "logits": logits[0],
    }


def run_tp(size: int, model_dir: Path, dtype: torch.dtype, args, threads: int = 0) -> dict:
    """`size` rank processes of `threads` threads each (default os.cpu_count() // size)."""
    threads, label = rank_run("tp", size, threads)
    print(f"TP={size}: {size} rank process(es), {threads} thread(s) each", file=sys.stderr)
    dtype_name = str(dtype).removeprefix("torch.")
    ranks = spawn_ranks(
        prefill_rank,
        size,
        (str(model_dir), dtype_name, args.prompt_len, args.iters, args.warmup, threads, label),
        timeout_s=args.timeout,
    )
    per_iter = [max(r["total_ms"][i] for r in ranks) for i in range(args.iters)]  # the slower rank
    comm_per_rank = [statistics.median(r["comm_ms"]) for r in ranks]
    return {
        "ms": statistics.median(per_iter),
        "min_ms": min(per_iter),
        "comm_ms": statistics.mean(comm_per_rank),
        "comm_ms_per_rank": comm_per_rank,
        "collectives": ranks[0]["collectives"],
        "collective_mb": ranks[0]["collective_bytes"] / 2**20,
        "threads": threads,
        "logits": ranks[0]["logits"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rank_bench_args(ap, "tp1_1thread_ms")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5, help="timed iterations (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()

    model_dir, cfg, dtype = bench_model(args)
    print(
        f"prefill of {args.prompt_len} tokens on {cfg.name} ({dtype}), {args.warmup} warmup + "
        f"{args.iters} timed iterations, {os.cpu_count()} CPU cores",
        file=sys.stderr,
    )
    tp1 = run_tp(1, model_dir, dtype, args)
    tp2 = run_tp(2, model_dir, dtype, args)
    ref = None if args.no_reference or rank_threads(1) == 1 else run_tp(1, model_dir, dtype, args, threads=1)
    diff = (tp1["logits"] - tp2["logits"]).abs().max().item()
    same_argmax = bool(tp1["logits"].argmax() == tp2["logits"].argmax())
    compute_ms = tp2["ms"] - tp2["comm_ms"]
    print(f"TP=1: {tp1['ms']:.1f} ms per prefill ({tp1['threads']} threads)")
    if ref is not None:
        print(f"TP=1 with 1 thread (reference): {ref['ms']:.1f} ms per prefill")
    print(
        f"TP=2: {tp2['ms']:.1f} ms per prefill ({tp2['threads']} thread(s) per rank): "
        f"{tp2['comm_ms']:.1f} ms in {tp2['collectives']} collectives "
        f"({tp2['collective_mb']:.1f} MiB per rank), {compute_ms:.1f} ms compute"
    )
    print(f"speedup TP1/TP2 latency: {tp1['ms'] / tp2['ms']:.3f}x; last-row logits max |diff| {diff:.2e}")
    result = {
        "model": cfg.name,
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_len": args.prompt_len,
        "iters": args.iters,
        "cpu_count": os.cpu_count(),
        "tp1_threads": tp1["threads"],
        "threads_per_rank": tp2["threads"],
        "tp1_ms": round(tp1["ms"], 2),
        "tp2_ms": round(tp2["ms"], 2),
        "speedup": round(tp1["ms"] / tp2["ms"], 3),
        "tp2_comm_ms": round(tp2["comm_ms"], 2),
        "tp2_comm_ms_per_rank": [round(x, 2) for x in tp2["comm_ms_per_rank"]],
        "tp2_compute_ms": round(compute_ms, 2),
        "tp2_comm_fraction": round(tp2["comm_ms"] / tp2["ms"], 3),
        "tp2_collectives": tp2["collectives"],
        "tp2_collective_mb_per_rank": round(tp2["collective_mb"], 2),
        "tp1_min_ms": round(tp1["min_ms"], 2),
        "tp2_min_ms": round(tp2["min_ms"], 2),
    }
    if ref is not None:
        result["tp1_1thread_ms"] = round(ref["ms"], 2)
        result["speedup_vs_1thread"] = round(ref["ms"] / tp2["ms"], 3)
    result["logits_max_abs_diff"] = diff
    result["same_argmax"] = same_argmax
    print_result(result, args.out)


if __name__ == "__main__":
    main()
