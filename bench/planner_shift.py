"""The planner on a workload that shifts halfway, against every fixed P:D split of the same groups.

Hosts: each worker group runs in a CPU slot of its own, a cgroup (v1 `cpu` controller) with a quota of
`--slot-cores` cores (default 0.45): what one group gets does not depend on how many others run, as on
separate hosts, so the P:D split decides capacity the way it does on a real cluster (on two shared cores
it would not: every group would take from the same two). `--groups` (3) slots are the cluster's room;
one more is kept for the group a move starts before the one it replaces has drained. The router, redis,
the pool node and this client share what the slots leave (2 - 3 x 0.45 cores here). Loopback links.

Workload (open loop, Poisson arrivals, the same arrival times and prompts for every run):
- phase 1, `--phase-s` seconds: `--a-input` (1024) token prompts, `--a-output` (16) tokens out, at
  `--a-rate` req/s: prefill-heavy;
- phase 2, as long: `--b-input` (64) token prompts, `--b-output` (256) tokens out, at `--b-rate` req/s:
  decode-heavy.
Runs, each on a fresh cluster of the bench model: every fixed split of `--groups` groups (1:2 and 2:1
for 3), then the planner (`--autoscale`, prefill and decode each 1 .. groups-1, at most `--groups`
groups, starting at 1:2). Every request carries the SLO (TTFT `--slo-ttft-ms`, TPOT `--slo-tpot-ms`) and
the router admits predictively (its default), so an overloaded split refuses what it cannot serve
instead of queueing it. Goodput = requests that met both targets per second of arrivals.

    python bench/planner_shift.py [--phase-s 120] [--a-rate 1.6] [--b-rate 3] [--out DIR]

Last line: one JSON object (per run and phase: goodput, attainment; the planner's over the best fixed
split's; the planner's decision log). OUT gets result.json and requests.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result, reported_cpu_flags
from slo_admission import Outcome, one, summary

from kvferry.deploy.config import ClusterConfig, WorkerGroupSettings
from kvferry.deploy.local import Child, LocalCluster
from kvferry.deploy.planner import AutoscaleSettings
from kvferry.loadtest.arrivals import arrival_offsets
from kvferry.router.client import Client, build_request
from kvferry.router.config import RouterConfig
from kvferry.v1 import generate_pb2

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


class CpuSlots:
    """`n` cgroups with `cores` cores each; a process placed in a free one keeps it until it exits."""

    def __init__(self, n: int, cores: float, prefix: str = "kvferry-slot"):
        if not (CGROUP_CPU / "cgroup.procs").exists() or os.geteuid() != 0:
            raise SystemExit(
                "planner_shift needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu"
            )
        self.dirs = [CGROUP_CPU / f"{prefix}-{i}" for i in range(n)]
        for d in self.dirs:
            d.mkdir(exist_ok=True)
            (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (d / "cpu.cfs_quota_us").write_text(str(int(cores * PERIOD_US)))
        self.lock = threading.Lock()

    def place(self, pid: int) -> Path:
        with self.lock:
            for d in self.dirs:
                if not (d / "cgroup.procs").read_text().split():
                    (d / "cgroup.procs").write_text(str(pid))
                    return d
        raise RuntimeError("no free CPU slot: more groups than slots")

    def remove(self) -> None:
        for d in self.dirs:
            for pid in (d / "cgroup.procs").read_text().split():  # leftovers go back to the root group
                with contextlib.suppress(OSError):
                    (CGROUP_CPU / "cgroup.procs").write_text(pid)
            try:
                d.rmdir()
            except OSError as err:
                print(f"planner_shift: could not remove {d}: {err}", file=sys.stderr)


class SlottedCluster(LocalCluster):
    """`kvferry up`'s cluster with every worker group in a CPU slot of its own."""

    slots: CpuSlots | None = None

    def start_group(self, role: str, kind: int) -> Child:
        child = super().start_group(role, kind)
        self.slots.place(child.proc.pid)  # before it has loaded anything (its threads inherit the group)
        return child


def workload(args) -> list[tuple[float, list[int], int, int]]:
    """(offset s, prompt, output tokens, phase) of every request, seeded."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for phase, (rate, n_in, n_out) in enumerate(
        ((args.a_rate, args.a_input, args.a_output), (args.b_rate, args.b_input, args.b_output))
    ):
        for t in arrival_offsets(rate, args.phase_s, seed=11 + phase):
            prompt = torch.randint(100, 8000, (n_in,), generator=gen).tolist()
            out.append((phase * args.phase_s + t, prompt, n_out, phase))
    return out


def drive(client: Client, label: str, requests, slo: generate_pb2.Slo) -> list[Outcome]:
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    bar = tqdm(total=len(requests), desc=label, unit="req", file=sys.stderr)

    def done(future):
        with lock:
            outcomes.append(future.result())
        bar.update(1)

    with ThreadPoolExecutor(max_workers=512) as pool:
        start = time.perf_counter()
        for offset, prompt, n_out, phase in requests:
            wait = start + offset - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            request = build_request(
                prompt_token_ids=prompt, max_tokens=n_out, temperature=0.0, ignore_eos=True
            )
            request.slo.CopyFrom(slo)
            out = Outcome(label, phase, time.perf_counter())  # `priority` holds the phase here
            pool.submit(one, client, request, out).add_done_callback(done)
    bar.close()
    return outcomes


def one_run(
    label: str, split: tuple[int, int], args, model: str, requests, slots: CpuSlots
) -> tuple[dict, list]:
    engine = {"max_model_len": 2048}
    cfg = ClusterConfig(
        model=model,
        namespace=f"shift-{label}",
        placement="even",  # one thread a worker: its slot is under one core
        router=RouterConfig(port=0, http_port=0, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms),
        prefill=WorkerGroupSettings(replicas=split[0], engine=engine),
        decode=WorkerGroupSettings(replicas=split[1], engine=engine),
        startup_timeout_s=600,
    )
    if label == "planner":
        top = args.groups - 1
        cfg = replace(
            cfg,
            autoscale=AutoscaleSettings(
                enabled=True,
                prefill=(1, top),
                decode=(1, top),
                max_groups=args.groups,
                cooldown_s=args.cooldown_s,
                ttft_ms=args.slo_ttft_ms,
                tpot_ms=args.slo_tpot_ms,
            ),
        )
    slo = generate_pb2.Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    cluster = SlottedCluster(cfg, log_dir=args.out / "logs" / label, quiet=True)
    cluster.slots = slots
    with cluster, Client(cluster.router_addr) as client:
        # warm-up: both kinds of request, so every worker has fitted its step costs before the clock
        # (light: the planner starts the measured run from its starting split)
        warm = [(i * 1.5, requests[i][1], requests[i][2], 0) for i in range(10)]
        warm += [(15 + i * 0.5, requests[-1 - i][1], requests[-1 - i][2], 1) for i in range(10)]
        drive(client, f"{label} warm-up", warm, slo)
        t0 = time.time()
        outs = drive(client, label, requests, slo)
        decisions = []
        if cluster.autoscaler is not None:
            decisions = [
                d.to_dict() | {"t_s": round(d.at - t0, 1)} for d in cluster.autoscaler.planner.decisions
            ]
        groups = cluster.counts()
    result = {
        "phase1": summary([o for o in outs if o.priority == 0], args.phase_s, args),
        "phase2": summary([o for o in outs if o.priority == 1], args.phase_s, args),
        "all": summary(outs, 2 * args.phase_s, args),
        "start": list(split),
        "end": list(groups),
    }
    if label == "planner":
        result["decisions"] = decisions
    return result, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--groups", type=int, default=3, help="worker groups (slots) of every run")
    ap.add_argument("--slot-cores", type=float, default=0.45)
    ap.add_argument("--phase-s", type=float, default=120.0)
    ap.add_argument("--a-rate", type=float, default=1.6)
    ap.add_argument("--a-input", type=int, default=1024)
    ap.add_argument("--a-output", type=int, default=16)
    ap.add_argument("--b-rate", type=float, default=3.0)
    ap.add_argument("--b-input", type=int, default=64)
    ap.add_argument("--b-output", type=int, default=256)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--cooldown-s", type=float, default=20.0)
    ap.add_argument(
        "--runs", default="", help="comma list of runs (default: every fixed split, then planner)"
    )
    ap.add_argument("--out", type=Path, default=Path("planner-shift"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = str(bench_model_dir(args.model))
    requests = workload(args)
    splits = {f"fixed-{p}:{args.groups - p}": (p, args.groups - p) for p in range(1, args.groups)}
    splits["planner"] = (1, args.groups - 1)
    labels = args.runs.split(",") if args.runs else list(splits)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still removes its slots
    slots = CpuSlots(args.groups + 1, args.slot_cores)
    runs, every = {}, []
    try:
        for label in labels:
            runs[label], outs = one_run(label, splits[label], args, model, requests, slots)
            every += outs
            print(f"{label}: {json.dumps(runs[label])}", file=sys.stderr)
    finally:
        slots.remove()
    with open(args.out / "requests.jsonl", "w") as f:
        for o in every:
            f.write(json.dumps(asdict(o)) + "\n")
    fixed = {k: v["all"]["goodput"] for k, v in runs.items() if k.startswith("fixed")}
    best = max(fixed, key=fixed.get) if fixed else None
    result = {
        "bench": "planner_shift",
        "model": args.model,
        "cpu_flags": reported_cpu_flags(),
        "slot_cores": args.slot_cores,
        "groups": args.groups,
        "phases": {
            "1": {
                "rate": args.a_rate,
                "input": args.a_input,
                "output": args.a_output,
                "seconds": args.phase_s,
            },
            "2": {
                "rate": args.b_rate,
                "input": args.b_input,
                "output": args.b_output,
                "seconds": args.phase_s,
            },
        },
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "runs": runs,
        "best_fixed": best,
    }
    if best is not None and "planner" in runs:
        result["planner_vs_best_fixed"] = round(runs["planner"]["all"]["goodput"] / max(fixed[best], 1e-9), 3)
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print_result(result)


if __name__ == "__main__":
    main()
