"""Engine flags: the EngineConfig fields as command-line options (shared by `kvferry generate`, the
workers and the launchers, which spell an EngineConfig back into these flags)."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from kvferry.engine.engine import KERNEL_CHOICES, KV_CACHE_DTYPES, EngineConfig
from kvferry.model.quant import QUANTIZATION_CHOICES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument(
        "--model",
        default=d.model,
        help="checkpoint directory, or a built-in name (tiny, bench, trained, draft)",
    )
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument(
        "--kernels",
        default=d.kernels,
        choices=KERNEL_CHOICES,
        help="auto: Triton kernels on CUDA, the C++ CPU kernels for float32 on CPU (built on first use); "
        "torch: plain torch ops; triton: the Triton kernels (on a CPU only under TRITON_INTERPRET=1)",
    )
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
    p.add_argument("--kv-cache-memory-gib", type=float, default=d.kv_cache_memory_gib)
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching
    )
    p.add_argument("--engine-seed", type=int, default=d.seed, help="seed for requests that give none")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=d.tensor_parallel_size, help="ranks of a prefill group"
    )
    p.add_argument(
        "--expert-parallel-size", type=int, default=d.expert_parallel_size, help="ranks of a decode group"
    )
    p.add_argument(
        "--decode-step-interval-ms",
        type=float,
        default=d.decode_step_interval_ms,
        help="decode workers: step at most once per this interval while 4 or more requests run (bigger "
        "decode batches for the same weight reads; the spare time goes to whatever shares the cores)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=d.stream_interval,
        help="decode workers: stream a request's tokens this many per message after its first (fewer "
        "messages for the router; the client gets them in bursts)",
    )
    p.add_argument(
        "--quantization",
        default=d.quantization,
        choices=QUANTIZATION_CHOICES,
        help="int8: attention and expert weights int8 per output channel, activations int8 per token "
        "(W8A8, dynamic; C++ kernels with AVX512-VNNI or AVX2 on CPU, Triton on CUDA)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="int8: K/V rows int8 with a float32 scale each (a quarter of float32's bytes, in the cache, "
        "the pool and on the wire); auto: the activations' dtype",
    )
    p.add_argument(
        "--speculative-config",
        default=d.speculative_config,
        help='speculative decoding, as vLLM spells it: JSON such as \'{"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (prompt lookup)',
    )


def engine_config_from(args) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and k != "seed"}
    return EngineConfig(**values, seed=args.engine_seed)


def engine_flags(engine: EngineConfig) -> list[str]:
    """EngineConfig -> the flags `add_engine_args` parses back into it (None fields are left out)."""
    out = []
    for f in fields(engine):
        value = getattr(engine, f.name)
        if value is None:
            continue
        flag = "--" + ("engine-seed" if f.name == "seed" else f.name.replace("_", "-"))
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):  # speculative_config given as a mapping (a cluster file)
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out
