"""Synthetic prompts for load tests: token ids of a fixed length, optionally sharing a common prefix
(a system prompt every request carries, which the KV pool can serve after the first request)."""

from __future__ import annotations

import itertools

import numpy as np

FIRST_ID = 3  # keep clear of the usual special tokens at the bottom of the vocabulary


class PromptSource:
    def __init__(self, vocab_size: int, input_len: int, prefix_share: float = 0.0, seed: int = 0):
        if input_len < 1 or not 0.0 <= prefix_share < 1.0:
            raise ValueError(
                f"need input_len >= 1 and 0 <= prefix_share < 1, got {input_len}, {prefix_share}"
            )
        self.vocab_size, self.input_len, self.seed = vocab_size, input_len, seed
        shared = int(input_len * prefix_share)
        self.prefix = np.random.default_rng([seed, 2**31]).integers(FIRST_ID, vocab_size, shared).tolist()
        self._count = itertools.count()

    def next_index(self) -> int:
        return next(self._count)

    def prompt(self, index: int) -> list[int]:
        """Prompt `index`: the shared prefix, then tokens unique to it (the same for the same index)."""
        rest = self.input_len - len(self.prefix)
        return (
            self.prefix
            + np.random.default_rng([self.seed, index]).integers(FIRST_ID, self.vocab_size, rest).tolist()
        )
