"""Latent KV vs GQA KV through the pool: bytes per 1k-token prompt and the hand-off's time.

For a DeepSeek-V3-shaped model (`bench-deepseek`: latent attention, one 80-value row per token and
layer) and the Qwen3-MoE bench model of similar active parameters (`bench`: K and V of 4 heads x 32 per
token and layer), in the same run: the engine prefills the same 1024-token prompt into its paged cache
(real KV, the engine's KV dtype), the prompt's 64 blocks are put into a pool node (a redis-server and a
`kvferry.kvpool` process, over the gloo pair group, as a prefill worker hands off) and pulled back into a
second cache (as a decode worker does), checked equal. Hand-off time: put then get, best of --repeats.

    python bench/kv_latent.py [--repeats 5] [--prompt-len 1024]

Last line JSON: per model the block layout, bytes per prompt, put/get/hand-off ms; then
`bytes_ratio` (GQA bytes / latent bytes) and `handoff_ratio` (GQA time / latent time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, print_result, reported_cpu_flags
from kv_transfer import measure_pool, pool_node

from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.engine.request import SamplingParams
from kvferry.kvpool.client import PoolClient, wait_for_nodes
from kvferry.kvpool.metadata import MetadataStore
from kvferry.kvpool.transfer import BlockLayout, dtype_name, pack_blocks

MODELS = ("bench-deepseek", "bench")


def prefilled_cache(model: str, prompt_len: int, block_size: int) -> tuple[torch.Tensor, BlockLayout, str]:
    """The engine's paged cache holding the prompt's blocks (and nothing else): [L, 2, H, n, bs, D]."""
    blocks = prompt_len // block_size
    engine = LLMEngine(
        EngineConfig(
            model=str(bench_model_dir(model)),
            max_model_len=prompt_len + 16,
            num_kv_blocks=blocks + 1,
            block_size=block_size,
            enable_prefix_caching=False,
        )
    )
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, engine.model.cfg.vocab_size, (prompt_len,), generator=gen).tolist()
    engine.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0))
    cache = engine.runner.kv_cache[:, :, :, :blocks].contiguous()  # the prompt's blocks (block ids 0..n-1)
    layout = BlockLayout.for_model(engine.model.cfg, block_size, cache.dtype)
    assert cache.abs().sum() > 0 and layout.block_bytes * blocks == cache.nbytes
    return cache, layout, engine.model.cfg.architecture


def handoff(cache: torch.Tensor, layout: BlockLayout, repeats: int, bar) -> tuple[float, float]:
    """(best put ms, best get ms) of the prompt's blocks through a pool node, one put and one get each."""
    blocks = cache.shape[3]
    with pool_node(layout, (repeats + 2) * blocks + 1024) as url:  # every rep's blocks, reservations
        meta = MetadataStore(url)
        prefill, decode = (PoolClient(meta, layout, peer_id=f"bench-{r}", shm=False) for r in ("put", "get"))
        try:
            if not wait_for_nodes(prefill, 1, 60):
                raise SystemExit("the pool node did not register")
            warm = prefill.put("warm", [b"\xff" * 16], pack_blocks(cache, [0]), private=[True])
            decode.get("warm", warm)  # connection set-up is not the hand-off
            best = (float("inf"), float("inf"))
            dst = torch.zeros_like(cache)
            for rep in range(repeats):
                put_gbps, get_gbps = measure_pool(prefill, decode, cache, dst, blocks, bytes([rep, 7]), bar)
                ms = tuple(cache.nbytes / (gbps * 1e9) * 1e3 for gbps in (put_gbps, get_gbps))
                best = (min(best[0], ms[0]), min(best[1], ms[1]))
            return best
        finally:
            prefill.close()
            decode.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    out: dict = {"cpu": reported_cpu_flags(), "prompt_tokens": args.prompt_len}
    bar = tqdm(total=len(MODELS) * args.repeats * 2, desc="hand-offs", unit="transfer", file=sys.stderr)
    for model in MODELS:
        cache, layout, arch = prefilled_cache(model, args.prompt_len, args.block_size)
        put_ms, get_ms = handoff(cache, layout, args.repeats, bar)
        out[model] = {
            "architecture": arch,
            "layout": layout.to_list(),
            "kv_dtype": dtype_name(cache.dtype),
            "block_bytes": layout.block_bytes,
            "bytes_per_prompt": cache.nbytes,
            "put_ms": round(put_ms, 3),
            "get_ms": round(get_ms, 3),
            "handoff_ms": round(put_ms + get_ms, 3),
        }
    bar.close()
    latent, gqa = out[MODELS[0]], out[MODELS[1]]
    out["bytes_ratio"] = round(gqa["bytes_per_prompt"] / latent["bytes_per_prompt"], 3)
    out["handoff_ratio"] = round(gqa["handoff_ms"] / latent["handoff_ms"], 3)
    print_result(out)


if __name__ == "__main__":
    main()
