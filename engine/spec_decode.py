"""Speculative decoding: proposals for a request's next tokens, verified in one forward pass.

`--speculative-config` takes vLLM's JSON: `{"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_max": N, "prompt_lookup_min": M}`, or `{"method": "draft_model", "model": DIR_OR_NAME,
"num_speculative_tokens": K}` (a smaller model on the same tokenizer, `engine/draft_model.py`; a `model`
without a method means draft_model, as in vLLM), or `{"method": "mtp", "num_speculative_tokens": K}`
(the checkpoint's multi-token-prediction layer, `engine/mtp_proposer.py`). Before each step the engine
asks the proposer for up to K tokens for every request in steady decode; the scheduler computes the
request's last token and its drafts as one row of K + 1 tokens, the model runner samples at each of
those positions and
`model.sampler.speculative_sample` keeps the drafts the target agrees with plus one token of its own
(greedy: exactly the non-speculative output; sampled: the target's distribution, by rejection). KV
written for rejected drafts lies past the request's computed tokens and is overwritten later.

The n-gram proposer is prompt lookup: the longest suffix of the request's tokens (prompt and output, N
down to M tokens) that occurred before, and the K tokens that followed its latest earlier occurrence
(the latest with K tokens after it, in a loop shorter than K).
Code, logs and edits repeat themselves, so the proposals cost nothing but a search.

Requests with a structured output or asking for prompt logprobs decode one token per step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

METHODS = ("ngram", "draft_model", "mtp")


class SpeculativeConfigError(ValueError):
    """A --speculative-config that cannot work (the message says which key)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # draft_model: a checkpoint directory or a built-in name (`draft`)

    @classmethod
    def parse(cls, text: str | dict | None) -> SpeculativeConfig | None:
        """vLLM's JSON (or a dict of it); None or an empty text: no speculation."""
        if text is None or text == "" or text == {}:
            return None
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as err:
            raise SpeculativeConfigError(f"speculative_config is not JSON: {err}") from None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("speculative_config must be a JSON object")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config: unsupported key(s) {', '.join(unknown)} (supported: "
                f"{', '.join(sorted(known))})"
            )
        if "model" in raw and "method" not in raw:
            raw["method"] = "draft_model"
        cfg = cls(**raw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise SpeculativeConfigError(
                    f"speculative_config.{name} must be an integer >= 1, got {value!r}"
                )
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise SpeculativeConfigError(
                "speculative_config.model must name the draft model (a checkpoint directory or a built-in "
                "name such as draft) for method draft_model"
            )
        if self.method in ("ngram", "mtp") and self.model is not None:
            raise SpeculativeConfigError(
                f"speculative_config.model goes with method draft_model, not {self.method}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )


class NgramProposer:
    def __init__(self, cfg: SpeculativeConfig):
        self.k = cfg.num_speculative_tokens
        self.max_n = cfg.prompt_lookup_max
        self.min_n = cfg.prompt_lookup_min

    def propose_batch(self, items: list[tuple[str, list[int], int]], running: set[str]) -> list[list[int]]:
        """`propose` for each (request id, tokens, limit); the n-gram proposer keeps no state."""
        return [self.propose(tokens, limit) for _, tokens, limit in items]

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(K, limit) tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` (max_n down to min_n long) that is followed by that many (else the latest); [] when
        no suffix recurs."""
        k = min(self.k, limit)
        if k <= 0 or len(tokens) <= self.min_n:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        size = len(seq)
        # where an earlier occurrence of a suffix can end: the positions before the last holding its token
        ends = np.flatnonzero(seq[:-1] == seq[-1])
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            hits = ends[ends >= n - 1]
            for back in range(1, n):  # the rest of the suffix, token by token
                hits = hits[seq[hits - back] == seq[size - 1 - back]]
            if hits.size:  # hits: where occurrences end; their continuations start one after
                whole = hits[hits + 1 + k <= size]  # occurrences followed by k tokens, if any
                start = int(whole[-1] if whole.size else hits[-1]) + 1
                return seq[start : start + k].tolist()
        return []
