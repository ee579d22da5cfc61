"""What the OpenAI HTTP API adds per streamed token, against the gRPC API of the same router.

Brings up a local cluster (`kvferry up` as a library: redis, a pool node, a prefill and a decode worker,
the router with its HTTP API) and sends the same greedy requests, interleaved, one at a time, through
both APIs: gRPC `Generate` (the repository's client) and `POST /v1/completions` with `stream: true`
(stdlib http.client reading the SSE lines). The client notes when each token arrives. The baseline is
the gRPC stream of the same run, so the engine's own step time cancels out:

    overhead per token (p50, p99) = inter-token gap over HTTP - over gRPC, at that percentile
    overhead per request = E2E over HTTP - over gRPC (median), and TTFT likewise

    python bench/http_overhead.py [--model tiny] [--requests 40] [--tokens 64] [--prompt-len 64]

Last line JSON: grpc/http ITL p50/p99 (ms), their differences, the HTTP/gRPC ratio of ITL p50, TTFT
and E2E medians.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_result

from kvferry.deploy.config import ClusterConfig, WorkerGroupSettings
from kvferry.deploy.local import LocalCluster
from kvferry.router.client import Client, build_request
from kvferry.router.config import RouterConfig


def grpc_stream(client: Client, ids: list[int], tokens: int) -> tuple[float, list[float]]:
    """(send time, token arrival times) of one greedy request over gRPC."""
    request = build_request(prompt_token_ids=ids, max_tokens=tokens, temperature=0.0, ignore_eos=True)
    sent, times = time.perf_counter(), []
    for msg in client.stream(request, timeout=120):
        now = time.perf_counter()
        times += [now] * len(msg.token_ids)
    return sent, times


def http_stream(host: str, port: int, model: str, ids: list[int], tokens: int) -> tuple[float, list[float]]:
    """(send time, token arrival times) of one greedy request over the OpenAI API (SSE)."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    conn = http.client.HTTPConnection(host, port, timeout=120)
    sent, times = time.perf_counter(), []
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:300]!r}")
    while line := reply.readline():
        if line.startswith(b"data: {"):
            now = time.perf_counter()
            times += [now] * len(json.loads(line[6:])["choices"][0]["token_ids"])
    conn.close()
    return sent, times


def percentile_ms(values: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, p))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=40, help="per API")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    engine = {"max_model_len": 1024, "num_kv_blocks": 512}
    cfg = ClusterConfig(
        model=args.model,
        router=RouterConfig(port=0, http_port=0),
        prefill=WorkerGroupSettings(engine=engine),
        decode=WorkerGroupSettings(engine=engine),
    )
    with tempfile.TemporaryDirectory() as logs, LocalCluster(cfg, log_dir=Path(logs), quiet=True) as cluster:
        host, port = cluster.http_url.removeprefix("http://").split(":")
        rng = np.random.default_rng(0)
        runs = {"grpc": [], "http": []}
        with Client(cluster.router_addr) as client:
            vocab = client.model_info().vocab_size
            warm = rng.integers(3, vocab, args.prompt_len).tolist()
            grpc_stream(client, warm, 4)
            http_stream(host, int(port), args.model, warm, 4)
            for _ in tqdm(range(args.requests), desc="requests (gRPC + HTTP)", unit="pair"):
                ids = rng.integers(3, vocab, args.prompt_len).tolist()  # fresh: no prefix-cache hits
                runs["grpc"].append(grpc_stream(client, ids, args.tokens))
                ids = rng.integers(3, vocab, args.prompt_len).tolist()
                runs["http"].append(http_stream(host, int(port), args.model, ids, args.tokens))

    result: dict = {"model": args.model, "requests_per_api": args.requests, "tokens": args.tokens}
    for api, items in runs.items():
        assert all(len(t) == args.tokens for _, t in items), f"{api}: a stream came back short"
        gaps = [b - a for _, t in items for a, b in itertools.pairwise(t)]
        result[f"{api}_itl_p50_ms"] = percentile_ms(gaps, 50)
        result[f"{api}_itl_p99_ms"] = percentile_ms(gaps, 99)
        result[f"{api}_ttft_p50_ms"] = statistics.median(t[0] - s for s, t in items) * 1e3
        result[f"{api}_e2e_p50_ms"] = statistics.median(t[-1] - s for s, t in items) * 1e3
    for key in ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "e2e_p50_ms"):
        result[f"http_minus_grpc_{key}"] = result[f"http_{key}"] - result[f"grpc_{key}"]
    result["http_overhead_per_token_ms"] = result["http_minus_grpc_e2e_p50_ms"] / args.tokens
    result["http_vs_grpc_itl_p50_ratio"] = result["http_itl_p50_ms"] / result["grpc_itl_p50_ms"]
    print_result({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}, args.out)


if __name__ == "__main__":
    main()
