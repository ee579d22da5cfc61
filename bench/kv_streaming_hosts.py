"""`kv_streaming.py --hosts`: a 4k-token prompt's first and second token with layer-wise KV streaming on
and off, the prefill and the decode on different emulated hosts, at each link rate.

Three emulated hosts (`kvferry.deploy.testhosts`) on one Ray cluster (`kvferry.deploy.testray`): host 1
is the frontend (Ray's head, the router, redis-server; not pinned), host 2 (core 0) runs the prefill
worker, host 3 (core 1) the decode worker. Every link is shaped at each `--rates` rate (tbf) with
`--delay-ms` one way. Two pool placements, each with `pool.stream_layers` on and off (four clusters):
- `pool_on_decode`: one pool node, on the decode host. The prefill's KV write crosses the link, so
  streaming can overlap it with the compute of the next layers;
- `pool_each`: a pool node on both worker hosts (the multi-host default). The prefill writes to its own
  host's node through the slab, and the decode's pull crosses the link after the first token.
For each, fresh random prompts of `--tokens` tokens (nothing cached) go one at a time through the
router's OpenAI API with `max_tokens=2`, streamed and greedy. TTFT is what the user waits for: the
prefill, its KV write, the pool's answer. The second token's gap is the decode's pull and first step.
The figures are medians of `--repeats` (after one warm-up per cluster). The ratio is streaming /
after-prefill at the same placement and rate (< 1: streaming answers sooner). The link counters show
the KV crossed: bytes the decode host received during the measured requests.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result
from serving_goodput import served_model, stream_times

from kvferry.deploy.testhosts import LinkShape, TestHosts
from kvferry.deploy.testray import RayNode, RayOnHosts
from kvferry.kernels.cpu import cpu_flags

HTTP_PORT = 8000
PLACEMENTS = {
    "pool_on_decode": {"per_ray_node": False, "nodes": 1, "resources": {"pool_decode": 1}},
    "pool_each": {"per_ray_node": False, "nodes": 2, "resources": {"pool_host": 1}},
}


def cluster_file(model: Path, placement: str, stream: bool, shared: Path) -> tuple[Path, str]:
    """The cluster file of one run, and its namespace."""
    namespace = f"{placement.replace('_', '-')}-{'stream' if stream else 'after'}"
    config = {
        "model": str(model),
        "namespace": namespace,
        "router": {"host": "0.0.0.0", "port": 50051, "http_port": HTTP_PORT},
        "ray": {"max_restarts": 0, "log_dir": str(shared / "logs" / namespace)},
        "prefill": {"replicas": 1, "resources": {"CPU": 1, "prefill_host": 1}},
        "decode": {"replicas": 1, "resources": {"CPU": 1, "decode_host": 1}},
        "pool": {**PLACEMENTS[placement], "memory_gib": 1.0, "stream_layers": "on" if stream else "off"},
    }
    path = shared / f"{namespace}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, namespace


def measure(url: str, hosts: TestHosts, args, rng: torch.Generator, bar: tqdm) -> dict:
    """Medians of TTFT and of the second token's gap (ms), and the MB the decode host received."""
    model = served_model(url)
    ttfts, seconds = [], []
    received = hosts[3].counters()[1]
    for _ in range(args.repeats):
        prompt = torch.randint(100, 8000, (args.tokens,), generator=rng).tolist()
        sent, times, _ = stream_times(url, model, prompt, 2)
        if len(times) != 2:
            raise SystemExit(f"expected 2 streamed tokens, got {len(times)}")
        ttfts.append((times[0] - sent) * 1e3)
        seconds.append((times[1] - times[0]) * 1e3)
        bar.update(1)
    return {
        "ttft_ms": round(statistics.median(ttfts), 1),
        "second_token_ms": round(statistics.median(seconds), 1),
        "decode_host_rx_mb": round((hosts[3].counters()[1] - received) / 2**20, 1),
    }


def run_hosts(args) -> None:
    model = bench_model_dir(args.model)  # under $HOME: every host sees it (each has its own /tmp)
    shared = Path(tempfile.mkdtemp(prefix="kvferry-ksh-", dir="/var/tmp"))
    rates = [float(r) for r in args.rates.split(",")]
    rng = torch.Generator().manual_seed(args.seed)
    rows: dict[tuple, dict] = {}
    bar = tqdm(total=len(PLACEMENTS) * 2 * len(rates) * args.repeats, desc="4k prompts", unit="req")
    with TestHosts(3, ["", "0", "1"], prefix="kvksh", subnet=5) as hosts:
        ray = RayOnHosts(hosts, shared, head=1)
        try:
            ray.start({
                1: RayNode(2, {}),
                2: RayNode(1, {"prefill_host": 1, "pool_host": 1}),
                3: RayNode(1, {"decode_host": 1, "pool_host": 1, "pool_decode": 1}),
            })  # fmt: skip
            for placement in PLACEMENTS:
                for stream in (True, False):
                    config, namespace = cluster_file(model, placement, stream, shared)
                    router = ray.kvferry_up(config, timeout=900)
                    url = f"http://{router.rsplit(':', 1)[0]}:{HTTP_PORT}"
                    warm = torch.randint(100, 8000, (args.tokens,), generator=rng).tolist()
                    stream_times(url, served_model(url), warm, 2)
                    for rate in rates:
                        for host in hosts.hosts:
                            hosts.shape(host, LinkShape(rate_mbit=rate * 1000, delay_ms=args.delay_ms))
                        rows[(placement, stream, rate)] = measure(url, hosts, args, rng, bar)
                    ray.kvferry("down", "--ray", "--namespace", namespace, timeout=600)
        finally:
            bar.close()
            ray.stop()
            shutil.rmtree(shared, ignore_errors=True)
    flags = cpu_flags()
    result: dict = {
        "model": args.model,
        "cpu": "avx512_bf16" if "avx512_bf16" in flags else "avx512f" if "avx512f" in flags else "avx2",
        "tokens": args.tokens,
        "repeats": args.repeats,
        "delay_ms": args.delay_ms,
    }
    for placement in PLACEMENTS:
        for rate in rates:
            on, off = rows[(placement, True, rate)], rows[(placement, False, rate)]
            p = f"{placement}_{rate:g}gbit"
            for key in on:
                result[f"{p}_stream_{key}"], result[f"{p}_after_{key}"] = on[key], off[key]
            result[f"{p}_ttft_ratio"] = round(on["ttft_ms"] / off["ttft_ms"], 3)
            print(
                f"{placement:15s} {rate:4g} Gbit/s: TTFT streaming {on['ttft_ms']:7.1f} ms, after "
                f"{off['ttft_ms']:7.1f} ms (ratio {result[f'{p}_ttft_ratio']:.3f}); second token "
                f"{on['second_token_ms']:6.1f} / {off['second_token_ms']:6.1f} ms",
                flush=True,
            )
    print_result(result, args.out)
