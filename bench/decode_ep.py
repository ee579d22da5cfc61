"""Decode step time with expert parallelism: EP=1 vs EP=2 (data-parallel attention) on the bench model.

A decode batch of --batch sequences (32 by default), each with --context tokens already in its paged
KV cache (256 by default; filled by prefill forwards of random tokens, --prefill-batch sequences per
pass), then --warmup + --steps decode steps of one random token per sequence (ModelRunner.execute:
every layer, then the logits of every row, as a decode step computes them; no sampling). Each
sequence's block table grows with its length, as the engine's does.

EP=1 is one rank process holding all sequences and all experts. EP=2 is two rank processes
(kvferry.model.parallel.spawn_ranks) joined by a gloo group: each holds half the sequences and its own
KV cache (data-parallel attention, the dense weights replicated) and half the experts; every MoE layer
routes its tokens to the rank owning the chosen experts and back (dispatch_combine: four all_to_all),
so both ranks step in lock-step. They meet at a barrier before each step; a step's time is the slower
rank's, and the figure reported is the median over --steps steps. Per rank, over the timed steps
only: the wall time inside all_to_all (Comm.all_to_all wrapped on the instance; it includes waiting
for the other rank), the wall time of the MoE blocks (routing, dispatch, experts, combine), and
ExpertLoad.seconds summed over the ExpertParallelMoe layers (the local experts' compute alone).
balance = mean / max over ranks of that expert time (1.0 = perfectly even), token_balance the same
for the token-expert assignments each rank computed.

Every rank gets os.cpu_count() // size threads. On this 2-core CPU box the two EP ranks share the same
two cores that EP=1 uses alone, so the EP2/EP1 ratio mostly shows communication overhead, not a gain
from more hardware; the design (DP attention + EP experts, all_to_all per MoE layer) is the one that
scales on a multi-GPU node, where each rank has its own GPU, its own KV cache and its own experts'
weights to stream. A reference EP=1 run with 1 thread is also reported (ep1_1thread_step_ms;
--no-reference skips it), since one process of 2 OpenMP threads behaves differently on a small VM
than two processes of 1 thread.

    python bench/decode_ep.py [--batch 32] [--context 256] [--steps 20] [--warmup 3] [--dtype auto]

Last line: one JSON object (ep1_step_ms, ep2_step_ms, speedup = ep1 / ep2, balance, ep2_comm_ms, ...).
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
from kvferry.model.moe import ExpertParallelMoe
from kvferry.model.parallel import Comm, Parallel, init_group, spawn_ranks

BLOCK_SIZE = 16


def decode_rank(
    store,
    rank: int,
    size: int,
    model_dir: str,
    dtype_name: str,
    batch: int,
    context: int,
    steps: int,
    warmup: int,
    prefill_batch: int,
    threads: int,
    label: str,
) -> dict:
    """One EP rank with batch // size sequences: fill their caches, then warmup + timed decode steps."""
    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    comm = init_group(store, "bench", rank, size, cpu)
    a2a = Timed([(comm, "all_to_all")])
    max_len = context + warmup + steps
    model = load_model(model_dir, getattr(torch, dtype_name), "cpu", max_len, Parallel(Comm.single(), comm))
    ep_layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoe)]
    mlp = Timed((layer.mlp, "forward") for layer in model.layers)
    local = batch // size
    first_seq = rank * local  # this rank's sequences: first_seq .. first_seq + local - 1 of the batch
    per_seq = -(-max_len // BLOCK_SIZE)
    runner = ModelRunner(model, local * per_seq, BLOCK_SIZE, cpu)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(local)]
    # the same tokens for a sequence whatever the EP size (seeded over the whole batch)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, model.cfg.vocab_size, (batch, context), generator=gen)
    tokens = torch.randint(10, model.cfg.vocab_size, (warmup + steps, batch), generator=gen)

    t = time.perf_counter()
    for start in range(0, local, prefill_batch):  # every rank runs the same number of passes
        step = StepInputs()
        for i in range(start, min(local, start + prefill_batch)):
            row = len(step.input_ids)
            step.input_ids += prompts[first_seq + i].tolist()
            step.positions += range(context)
            step.slot_blocks += [tables[i][p // BLOCK_SIZE] for p in range(context)]
            step.slot_offsets += [p % BLOCK_SIZE for p in range(context)]
            step.prefills.append((row, context, context, tables[i][: -(-context // BLOCK_SIZE)]))
        runner.execute(step)
    fill_s = time.perf_counter() - t
    if rank == 0:
        print(f"  {label}: KV cache filled in {fill_s:.1f} s", file=sys.stderr, flush=True)

    step_ms, comm_ms, mlp_ms = [], [], []
    expert_s0 = tokens0 = calls0 = None
    logits = None
    for s in range(warmup + steps):
        if s == warmup:  # ExpertLoad accumulates from the start: count the timed steps only
            expert_s0 = sum(m.load.seconds for m in ep_layers)
            tokens0 = sum(sum(m.load.token_counts()) for m in ep_layers)
            calls0 = a2a.calls
        pos = context + s
        n_blocks = pos // BLOCK_SIZE + 1
        step = StepInputs(
            input_ids=tokens[s, first_seq : first_seq + local].tolist(),
            positions=[pos] * local,
            slot_blocks=[tables[i][pos // BLOCK_SIZE] for i in range(local)],
            slot_offsets=[pos % BLOCK_SIZE] * local,
            decode_tables=[tables[i][:n_blocks] for i in range(local)],
            decode_lens=[pos + 1] * local,
            sample_rows=list(range(local)),
        )
        comm.barrier()  # start together: a step's time is then the slower rank's
        a2a_s, mlp_s = a2a.seconds, mlp.seconds
        t = time.perf_counter()
        logits = runner.execute(step)
        elapsed = time.perf_counter() - t
        if s >= warmup:
            step_ms.append(elapsed * 1e3)
            comm_ms.append((a2a.seconds - a2a_s) * 1e3)
            mlp_ms.append((mlp.seconds - mlp_s) * 1e3)
        if rank == 0 and (s < warmup or (s - warmup) % 5 == 4 or s == warmup + steps - 1):
            what = "warmup" if s < warmup else f"step {s - warmup}"
            print(
                f"  {label} {what}: {elapsed * 1e3:.1f} ms (rank 0 in all_to_all "
                f"{(a2a.seconds - a2a_s) * 1e3:.1f} ms, in MoE blocks {(mlp.seconds - mlp_s) * 1e3:.1f} ms)",
                file=sys.stderr,
                flush=True,
            )
    expert_s = sum(m.load.seconds for m in ep_layers) - expert_s0 if ep_layers else None
    assignments = sum(sum(m.load.token_counts()) for m in ep_layers) - tokens0 if ep_layers else None
    return {
        "threads": threads,
        "fill_s": fill_s,
        "step_ms": step_ms,
        "comm_ms": comm_ms,
        "mlp_ms": mlp_ms,
        "expert_ms": None if expert_s is None else expert_s * 1e3 / steps,  # per step
        "assignments": assignments,
        "a2a_calls_per_step": (a2a.calls - calls0) // steps if size > 1 else 0,
        "logits": logits,
    }


def run_ep(size: int, model_dir: Path, dtype: torch.dtype, args, threads: int = 0) -> dict:
    """`size` rank processes of `threads` threads each (default os.cpu_count() // size)."""
    threads, label = rank_run("ep", size, threads)
    print(
        f"EP={size}: {size} rank process(es), {args.batch // size} sequences and {threads} thread(s) each",
        file=sys.stderr,
    )
    dtype_name = str(dtype).removeprefix("torch.")
    ranks = spawn_ranks(
        decode_rank,
        size,
        (
            str(model_dir),
            dtype_name,
            args.batch,
            args.context,
            args.steps,
            args.warmup,
            args.prefill_batch,
            threads,
            label,
        ),
        timeout_s=args.timeout,
    )
    per_step = [max(r["step_ms"][i] for r in ranks) for i in range(args.steps)]  # the slower rank
    out = {
        "step_ms": statistics.median(per_step),
        "mean_step_ms": statistics.mean(per_step),
        "min_step_ms": min(per_step),
        "comm_ms_per_rank": [statistics.median(r["comm_ms"]) for r in ranks],
        "mlp_ms_per_rank": [statistics.median(r["mlp_ms"]) for r in ranks],
        "threads": threads,
        "fill_s": max(r["fill_s"] for r in ranks),
        "a2a_calls_per_step": ranks[0]["a2a_calls_per_step"],
        "logits": torch.cat([r["logits"] for r in ranks]),
    }
    out["comm_ms"] = statistics.mean(out["comm_ms_per_rank"])
    out["mlp_ms"] = statistics.mean(out["mlp_ms_per_rank"])
    if ranks[0]["expert_ms"] is not None:
        expert = [r["expert_ms"] for r in ranks]
        work = [r["assignments"] for r in ranks]
        out["expert_ms_per_rank"] = expert
        out["balance"] = statistics.mean(expert) / max(expert) if max(expert) > 0 else 1.0
        out["assignments_per_rank"] = work
        out["token_balance"] = statistics.mean(work) / max(work) if max(work) > 0 else 1.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rank_bench_args(ap, "ep1_1thread_step_ms")
    ap.add_argument("--batch", type=int, default=32, help="sequences in the batch, all ranks")
    ap.add_argument("--context", type=int, default=256, help="tokens already in each sequence's cache")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prefill-batch", type=int, default=4, help="sequences per cache-filling prefill pass")
    args = ap.parse_args()
    if args.batch % 2:
        ap.error("--batch must be even (EP=2 splits it in half)")

    model_dir, cfg, dtype = bench_model(args)
    print(
        f"decode at batch {args.batch}, context {args.context}, on {cfg.name} ({dtype}, {cfg.num_experts} "
        f"experts, top-{cfg.num_experts_per_tok}), {args.warmup} warmup + {args.steps} timed steps, "
        f"{os.cpu_count()} CPU cores",
        file=sys.stderr,
    )
    ep1 = run_ep(1, model_dir, dtype, args)
    ep2 = run_ep(2, model_dir, dtype, args)
    ref = None if args.no_reference or rank_threads(1) == 1 else run_ep(1, model_dir, dtype, args, threads=1)
    diff = (ep1["logits"] - ep2["logits"]).abs().max().item()
    same_argmax = bool(torch.equal(ep1["logits"].argmax(-1), ep2["logits"].argmax(-1)))
    print(
        f"EP=1: {ep1['step_ms']:.1f} ms per step ({ep1['threads']} threads; "
        f"MoE blocks {ep1['mlp_ms']:.1f} ms)"
    )
    if ref is not None:
        print(f"EP=1 with 1 thread (reference): {ref['step_ms']:.1f} ms per step")
    print(
        f"EP=2: {ep2['step_ms']:.1f} ms per step ({ep2['threads']} thread(s) per rank; MoE blocks "
        f"{ep2['mlp_ms']:.1f} ms, of which {ep2['comm_ms']:.1f} ms in {ep2['a2a_calls_per_step']} all_to_all "
        f"and {statistics.mean(ep2['expert_ms_per_rank']):.1f} ms in the local experts)"
    )
    print(
        f"speedup EP1/EP2 step time: {ep1['step_ms'] / ep2['step_ms']:.3f}x; expert-time balance "
        f"{ep2['balance']:.3f}, assignment balance {ep2['token_balance']:.3f}; "
        f"last-step logits max |diff| {diff:.2e}"
    )
    result = {
        "model": cfg.name,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": args.batch,
        "context": args.context,
        "steps": args.steps,
        "cpu_count": os.cpu_count(),
        "ep1_threads": ep1["threads"],
        "threads_per_rank": ep2["threads"],
        "ep1_step_ms": round(ep1["step_ms"], 2),
        "ep2_step_ms": round(ep2["step_ms"], 2),
        "speedup": round(ep1["step_ms"] / ep2["step_ms"], 3),
        "balance": round(ep2["balance"], 3),
        "token_balance": round(ep2["token_balance"], 3),
        "ep2_comm_ms": round(ep2["comm_ms"], 2),
        "ep2_comm_ms_per_rank": [round(x, 2) for x in ep2["comm_ms_per_rank"]],
        "ep2_all_to_all_per_step": ep2["a2a_calls_per_step"],
        "ep2_comm_fraction": round(ep2["comm_ms"] / ep2["step_ms"], 3),
        "ep2_expert_ms_per_rank": [round(x, 2) for x in ep2["expert_ms_per_rank"]],
        "ep2_assignments_per_rank": ep2["assignments_per_rank"],
        "ep1_moe_ms": round(ep1["mlp_ms"], 2),
        "ep2_moe_ms": round(ep2["mlp_ms"], 2),
        "ep1_mean_step_ms": round(ep1["mean_step_ms"], 2),
        "ep2_mean_step_ms": round(ep2["mean_step_ms"], 2),
        "ep1_min_step_ms": round(ep1["min_step_ms"], 2),
        "ep2_min_step_ms": round(ep2["min_step_ms"], 2),
    }
    if ref is not None:
        result["ep1_1thread_step_ms"] = round(ref["step_ms"], 2)
        result["speedup_vs_1thread"] = round(ref["step_ms"] / ep2["step_ms"], 3)
    result["logits_max_abs_diff"] = diff
    result["same_argmax"] = same_argmax
    print_result(result, args.out)


if __name__ == "__main__":
    main()
