"""Held-out perplexity through the serving engine (`kvferry eval`).

The held-out split of the standard library sources (`model.corpus`), tokenized and joined, is cut into
consecutive windows of `context` tokens; each window is a prompt whose prompt logprobs the engine
computes (the same path an `echo` + `logprobs` request takes), and perplexity is exp of the mean
negative log-likelihood over every scored token (each window's first token has no context and is not
scored). Whatever the engine is configured with (dtype, kernels, quantization) is what is measured.
"""

from __future__ import annotations

import math
import time

from kvferry.engine.engine import LLMEngine
from kvferry.engine.request import SamplingParams
from kvferry.model.corpus import token_stream


def heldout_tokens(engine: LLMEngine, max_tokens: int, split: str = "heldout") -> list[int]:
    eos = engine.eos_ids[0] if engine.eos_ids else 0
    return token_stream(engine.tokenizer, split, eos, max_tokens=max_tokens)


def perplexity(engine: LLMEngine, tokens: list[int], context: int, progress: bool = False) -> dict:
    """Perplexity of `tokens` scored in consecutive windows of `context` tokens (at most the engine's
    max_model_len - 1: each window's request samples one token after it)."""
    if not 2 <= context < engine.max_model_len:
        raise ValueError(f"context must be in [2, {engine.max_model_len - 1}], got {context}")
    windows = [tokens[i : i + context] for i in range(0, len(tokens), context)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise ValueError("no window of at least 2 tokens to score")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    start = time.perf_counter()
    done = engine.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=progress)
    nll = -sum(lp.logprob for c in done for lp in c.prompt_logprobs)
    scored = sum(len(c.prompt_logprobs) for c in done)
    return {
        "perplexity": round(math.exp(nll / scored), 4),
        "nll_per_token": round(nll / scored, 5),
        "tokens_scored": scored,
        "windows": len(windows),
        "context": context,
        "seconds": round(time.perf_counter() - start, 2),
    }
