"""Sampling: greedy, or temperature -> top-k -> top-p (in that order) with a per-request generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_TEMPERATURE = 1e-5  # below this, logits / T overflows float32: treated as greedy


@dataclass(frozen=True)
class SamplingSpec:
    """Per-row sampling settings; temperature 0 (or below MIN_TEMPERATURE) means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] already divided by temperature. Returns logits with masked tokens at -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already cover top_p; the first token always stays
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, specs: list[SamplingSpec], generators: list[torch.Generator | None]
) -> list[int]:
    """logits: [N, V] float32, one row per request. Returns one token id per row."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, (spec, gen) in enumerate(zip(specs, generators, strict=True)):
        if spec.greedy:
            out.append(greedy[row])
            continue
        masked = apply_top_k_top_p(logits[row] / spec.temperature, spec.top_k, spec.top_p)
        probs = masked.softmax(-1)
        if gen is not None and gen.device != probs.device:  # seeded generators are CPU generators
            probs = probs.to(gen.device)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
