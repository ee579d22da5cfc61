"""Offline throughput: kvferry's engine vs `transformers` generate with static batches, same checkpoint.

64 requests x 256 prompt tokens x 64 output tokens (ignore EOS, greedy), all submitted at once. The
baseline runs `generate` on static batches of 32 in the same process. Last line: one JSON object.

    python bench/engine_throughput.py [--model bench] [--dtype auto] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model_dir, memcpy_gbps, print_result, weight_bytes_per_step

from kvferry.decode_worker.engine import EngineConfig, LLMEngine
from kvferry.decode_worker.request import SamplingParams


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=gen).tolist()


def run_kvferry(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    done = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - t
    assert all(len(d.output_token_ids) == output_len for d in done)
    return len(prompts) * output_len / elapsed


def decode_step_ms_at_batch_1(engine: LLMEngine, steps: int = 32) -> float:
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    request_id = engine.add_request(params=params, prompt_token_ids=list(range(10, 42)))
    outputs = engine.outputs_of(request_id)
    next(outputs)  # the prefill step
    t = time.perf_counter()
    for _ in outputs:
        pass
    return (time.perf_counter() - t) / steps * 1e3


def run_transformers(model_dir: Path, dtype: torch.dtype, prompts, output_len: int, batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:2]), **dict(kwargs, max_new_tokens=2, min_new_tokens=2))
        t = time.perf_counter()
        for i in range(0, len(prompts), batch):
            out = model.generate(torch.tensor(prompts[i : i + batch]), **kwargs)
            assert out.shape[1] == len(prompts[0]) + output_len
        elapsed = time.perf_counter() - t
    return len(prompts) * output_len / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--baseline-batch", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    args = ap.parse_args()

    model_dir = bench_model_dir(args.model)
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype=args.dtype,
            max_model_len=args.input_len + args.output_len + 64,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    prompts = make_prompts(args.num_requests, args.input_len, engine.model.cfg.vocab_size)
    engine.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=4, temperature=0))
    step_ms = decode_step_ms_at_batch_1(engine)
    kvferry_tps = run_kvferry(engine, prompts, args.output_len)
    engine_dtype = engine.dtype
    del engine
    baseline_tps = run_transformers(model_dir, engine_dtype, prompts, args.output_len, args.baseline_batch)
    bandwidth = memcpy_gbps()
    cfg_bytes = weight_bytes_per_step(
        __import__("kvferry.model.config", fromlist=["ModelConfig"]).ModelConfig.from_dir(model_dir),
        1,
        engine_dtype.itemsize,
    )
    print_result(
        {
            "dtype": str(engine_dtype).removeprefix("torch."),
            "kvferry_out_tok_s": round(kvferry_tps, 1),
            "baseline_out_tok_s": round(baseline_tps, 1),
            "ratio": round(kvferry_tps / baseline_tps, 3),
            "decode_step_ms_at_batch_1": round(step_ms, 3),
            "roofline_ms_at_batch_1": round(cfg_bytes / (bandwidth * 1e9) * 1e3, 3),
            "memcpy_gbps": round(bandwidth, 2),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
