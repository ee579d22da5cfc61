"""The router's CPU per request under load, this checkout against a baseline commit in the same run.

Brings up a disaggregated cluster on the bench model (`kvferry up`'s processes, this checkout), and,
with `--baseline REV`, a second router built from commit REV (a git worktree installed into its own
venv over this one's packages) on the same Redis and workers. Both routers then serve the same load in
alternating rounds: `--concurrency` streams at a time of fresh `--input-len`-token prompts (token ids;
fresh for each router, so neither finds the other's cached) to `--output-len` tokens (greedy,
ignore_eos), over gRPC (`Generate`) and over the OpenAI HTTP API (`/v1/completions`, streamed). A
router's CPU is its process's user + system time (/proc/PID/stat, every thread) over the requests it
served; the figure is per request. Every request must stream all its tokens (checked). Last line: one
JSON object; `<api>_after_vs_before` = this checkout's CPU per request / the baseline's.

The floor (unless `--no-floor`): the same gRPC load through a bare relay that does nothing but pass one
message per token from an upstream stream on (`bench/grpc_floor.py`, paced at the step the router's run
saw): `floor_grpc_cpu_ms_per_request` is what gRPC alone costs the router's process on this machine,
`after_grpc_over_floor_ms` what kvferry's router adds to it; `floor_serve_only_cpu_ms_per_request` is
the client's side of the stream alone (a server that makes up its tokens: no upstream call);
`floor_split_cpu_ms_per_request` the least a router of kvferry's design does (a `Prefill` call, then the
stream's tokens from one shared `Relay` link, a batch per step) and, with `--baseline`,
`grpc_split_floor_vs_before` that least over the baseline's CPU: no router on this transport gets under it.

    python bench/router_cpu.py [--baseline REV] [--requests 120] [--rounds 3] [--concurrency 4]
                               [--stream-interval N] [--no-floor]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import baseline_argv, baseline_python, bench_model_dir, print_result, remove_worktree

from kvferry.deploy.config import ClusterConfig, WorkerGroupSettings
from kvferry.deploy.local import LocalCluster, router_argv
from kvferry.deploy.readiness import wait_until_ready
from kvferry.kernels.cpu import cpu_flags
from kvferry.proc import free_port
from kvferry.router.client import build_request
from kvferry.router.config import RouterConfig
from kvferry.v1 import generate_pb2_grpc

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def start_baseline_router(cluster: LocalCluster, python: str) -> tuple[str, str, int]:
    """The baseline router on the cluster's Redis and namespace: (gRPC address, HTTP URL, pid)."""
    host = "127.0.0.1"
    port, http_port = free_port(host), free_port(host)
    argv = baseline_argv(python, router_argv(cluster.cfg, str(cluster.model_dir), host, port, http_port))
    child = cluster._spawn("router-baseline", argv)
    addr = f"{host}:{port}"
    wait_until_ready(addr, cluster.want, time.monotonic() + 120, **cluster.probe_args())
    return addr, f"http://{host}:{http_port}", child.proc.pid


def grpc_one(stub, prompt: list[int], output_len: int) -> list[int]:
    request = build_request(prompt_token_ids=prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return [t for msg in stub.Generate(request, timeout=300) for t in msg.token_ids]


def http_one(url: str, model: str, prompt: list[int], output_len: int) -> list[int]:
    """The streamed completion's tokens, as its usage chunk counts them ([0] * n)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    tokens = 0
    with urllib.request.urlopen(request, timeout=300) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return [0] * tokens


def run_load(target: dict, api: str, prompts: list[list[int]], args, bar: tqdm) -> tuple[float, list, float]:
    """Serve `prompts` through one router; (its CPU seconds, each prompt's output, wall seconds)."""
    before, t0 = cpu_s(target["pid"]), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        if api == "grpc":
            channel = grpc.insecure_channel(target["addr"])
            stub = generate_pb2_grpc.GenerationStub(channel)
            jobs = [pool.submit(grpc_one, stub, p, args.output_len) for p in prompts]
        else:
            model = target["model"]
            jobs = [pool.submit(http_one, target["url"], model, p, args.output_len) for p in prompts]
        outputs = []
        for job in jobs:
            outputs.append(job.result())
            bar.update(1)
        if api == "grpc":
            channel.close()
    return cpu_s(target["pid"]) - before, outputs, time.perf_counter() - t0


def serve_load(args, cmds: list[list[str]], port: int, work: Path, desc: str) -> float:
    """CPU seconds per request of the last of `cmds` (bench/grpc_floor.py processes; it serves `port`)
    under the router's load: the same client, concurrency and tokens per request."""
    with open(work / "floor.log", "ab") as logs:
        procs = [subprocess.Popen(cmd, stdout=logs, stderr=subprocess.STDOUT) for cmd in cmds]
    try:
        addr = f"127.0.0.1:{port}"
        with grpc.insecure_channel(addr) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        prompts = [[100] * args.input_len for _ in range(args.requests * args.rounds)]
        bar = tqdm(total=len(prompts), desc=desc, unit="req")
        used, outputs, _ = run_load({"addr": addr, "pid": procs[-1].pid}, "grpc", prompts, args, bar)
        bar.close()
        if any(len(out) != args.output_len for out in outputs):
            raise SystemExit(f"the {desc} ended a stream early")
        return used / len(prompts)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def measure_floor(args, step_s: float, work: Path) -> tuple[float, float, float]:
    """CPU seconds per request of gRPC alone (bench/grpc_floor.py), one message per token on a `step_s`
    step clock: (a bare relay of an upstream stream, a server that only streams to the client, the
    least a router of kvferry's design does: a Prefill call, then one Relay link's batches)."""
    script = [sys.executable, str(Path(__file__).resolve().parent / "grpc_floor.py")]
    tokens, step = str(args.output_len), str(step_s)

    def behind(upstream: str, front: str) -> float:  # `front` serves the load, `upstream` feeds it
        up, port = free_port("127.0.0.1"), free_port("127.0.0.1")
        cmds = [[*script, upstream, str(up), tokens, step], [*script, front, str(port), str(up), "auto"]]
        return serve_load(args, cmds, port, work, f"floor: {front}")

    relay = behind("upstream", "relay")
    port = free_port("127.0.0.1")
    alone = serve_load(
        args, [[*script, "source", str(port), tokens, step, "auto"]], port, work, "floor: serve"
    )
    return relay, alone, behind("workers", "split")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--baseline", default="", help="a git revision whose router is measured beside this one")
    ap.add_argument("--requests", type=int, default=120, help="per router, API and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--apis", default="grpc,http")
    ap.add_argument(
        "--stream-interval", type=int, default=1, help="the decode worker's tokens per streamed message"
    )
    ap.add_argument(
        "--no-floor", action="store_true", help="skip the bare gRPC relay's CPU (bench/grpc_floor.py)"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    apis = args.apis.split(",")
    work = Path(tempfile.mkdtemp(prefix="kvferry-router-cpu-"))
    cfg = ClusterConfig(
        model=str(bench_model_dir(args.model)),
        namespace="router-cpu",
        router=RouterConfig(port=0, http_port=0, max_inflight=4096),
        decode=WorkerGroupSettings(engine={"stream_interval": args.stream_interval}),
    )
    cluster = LocalCluster(cfg, log_dir=work / "logs", quiet=True)
    totals: dict[tuple[str, str], list[float]] = {}
    walls: dict[tuple[str, str], list[float]] = {}
    floor = serve_floor = split_floor = step_s = None
    try:
        python = baseline_python(args.baseline, work) if args.baseline else ""
        cluster.start()
        router = next(c for c in cluster.children if c.name == "router")
        served = json.load(urllib.request.urlopen(f"{cluster.http_url}/v1/models", timeout=30))
        model = served["data"][0]["id"]
        targets = {"after": {"addr": cluster.router_addr, "url": cluster.http_url, "pid": router.proc.pid}}
        if python:
            addr, url, pid = start_baseline_router(cluster, python)
            targets["before"] = {"addr": addr, "url": url, "pid": pid}
        for t in targets.values():
            t["model"] = model
        gen = torch.Generator().manual_seed(0)
        total = args.rounds * len(apis) * len(targets) * args.requests
        bar = tqdm(total=total, desc="requests", unit="req")
        for rnd in range(args.rounds):
            for api in apis:
                # alternate which router goes first: neither always meets a warmer or colder machine
                for name in sorted(targets, reverse=rnd % 2 == 1):
                    prompts = [  # fresh for each router: neither finds the other's prompts cached
                        torch.randint(100, 8000, (args.input_len,), generator=gen).tolist()
                        for _ in range(args.requests)
                    ]
                    used, outputs, wall = run_load(targets[name], api, prompts, args, bar)
                    totals.setdefault((name, api), []).append(used)
                    walls.setdefault((name, api), []).append(wall)
                    short = [n for n in map(len, outputs) if n != args.output_len]
                    if short:
                        raise SystemExit(f"{name} ({api}): {len(short)} requests ended early: {short[:5]}")
        bar.close()
        cluster.stop()
        if "grpc" in apis and not args.no_floor:
            # the router's own step: requests at `concurrency` in flight, each `output_len` tokens long
            served = sum(walls[("after", "grpc")]) / (args.requests * args.rounds)
            step_s = served * args.concurrency / args.output_len
            floor, serve_floor, split_floor = measure_floor(args, step_s, work)
    finally:
        cluster.stop()
        remove_worktree(work)
        shutil.rmtree(work, ignore_errors=True)
    flags = cpu_flags()
    result = {
        "model": args.model,
        "cpu": "avx512_bf16" if "avx512_bf16" in flags else "avx512f" if "avx512f" in flags else "avx2",
        "requests": args.requests * args.rounds,
        "concurrency": args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "stream_interval": args.stream_interval,
        "baseline": args.baseline or None,
    }
    for (name, api), used in sorted(totals.items()):
        result[f"{name}_{api}_cpu_ms_per_request"] = round(sum(used) / (args.requests * args.rounds) * 1e3, 2)
    if floor is not None:
        result["floor_step_ms"] = round(step_s * 1e3, 2)
        result["floor_grpc_cpu_ms_per_request"] = round(floor * 1e3, 2)
        result["floor_serve_only_cpu_ms_per_request"] = round(serve_floor * 1e3, 2)
        result["floor_split_cpu_ms_per_request"] = round(split_floor * 1e3, 2)
        result["after_grpc_over_floor_ms"] = round(result["after_grpc_cpu_ms_per_request"] - floor * 1e3, 2)
    if python:
        for api in apis:
            a, b = (result[f"{n}_{api}_cpu_ms_per_request"] for n in ("after", "before"))
            result[f"{api}_after_vs_before"] = round(a / b, 3) if b else None
        if split_floor is not None and result.get("before_grpc_cpu_ms_per_request"):
            least = result["floor_split_cpu_ms_per_request"] / result["before_grpc_cpu_ms_per_request"]
            result["grpc_split_floor_vs_before"] = round(least, 3)
    print_result(result, args.out)


if __name__ == "__main__":
    main()
