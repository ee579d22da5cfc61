"""A step-time model fitted online from the engine's own steps: the cost model SLO-aware admission uses.

Each step's wall time (forward pass and sampling) is recorded with two features of its batch: the tokens
computed (every GEMM and the MoE scale with these) and the attention work, the (query, key) pairs the
step's rows attend over (a chunk of n tokens after c cached ones: n·c + n(n+1)/2). Over the last `window`
steps, least squares with non-negative coefficients fits

    step_ms = fixed + per_token · tokens + per_kpair · pairs / 1000

(`fixed` is what a step costs whatever its size: Python, launches, thread wake-ups). A worker publishes
the fit in its heartbeat; the router prices a prompt of n uncached tokens on that worker with
`prompt_ms` (its chunks under the worker's token budget, each paying `fixed`), and a decode batch's step
with `step_ms`. The fit follows what the worker really sees: its CPU share, its dtype, its kernels.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

MIN_STEPS = 8  # fewer recorded steps than this: no fit yet


@dataclass(frozen=True)
class StepCost:
    fixed_ms: float
    per_token_ms: float
    per_kpair_ms: float  # per 1000 attention (query, key) pairs

    def step_ms(self, tokens: float, pairs: float) -> float:
        return self.fixed_ms + self.per_token_ms * tokens + self.per_kpair_ms * pairs / 1e3

    def prompt_ms(self, tokens: int, budget: int, cached: int = 0) -> float:
        """A prompt's `tokens` uncached tokens (after `cached` ones) computed in chunks of at most
        `budget` tokens a step: the steps' fixed costs, its tokens and its attention pairs."""
        if tokens <= 0:
            return 0.0
        chunks = math.ceil(tokens / max(1, budget))
        pairs = tokens * cached + tokens * (tokens + 1) / 2
        return self.fixed_ms * chunks + self.per_token_ms * tokens + self.per_kpair_ms * pairs / 1e3

    def to_list(self) -> list[float]:
        return [round(self.fixed_ms, 6), round(self.per_token_ms, 9), round(self.per_kpair_ms, 9)]

    @classmethod
    def from_list(cls, values) -> StepCost | None:
        """From a heartbeat's list; None for anything malformed (a record is never trusted blindly)."""
        try:
            fixed, token, kpair = (float(v) for v in values)
        except (TypeError, ValueError):
            return None
        if not all(math.isfinite(v) and v >= 0 for v in (fixed, token, kpair)):
            return None
        return cls(fixed, token, kpair)


def step_pairs(work) -> int:
    """The attention pairs of a batch: (request, n) rows, each n new tokens after its computed ones."""
    return sum(n * req.num_computed_tokens + n * (n + 1) // 2 for req, n in work)


class StepCostModel:
    """The last `window` steps and their fit (`fit`, refitted at most every `refit_every` new steps).
    `observe` runs on the engine thread, `fit` wherever the figures are read (a heartbeat's thread)."""

    def __init__(self, window: int = 512, refit_every: int = 16):
        self.rows: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.refit_every = refit_every
        self._since_fit = 0
        self._fit: StepCost | None = None
        self._lock = threading.Lock()

    def observe(self, tokens: int, pairs: int, ms: float) -> None:
        if ms > 0 and math.isfinite(ms):
            with self._lock:
                self.rows.append((float(tokens), pairs / 1e3, ms))
                self._since_fit += 1

    def fit(self) -> StepCost | None:
        with self._lock:
            if len(self.rows) < MIN_STEPS:
                return None
            if self._fit is not None and self._since_fit < self.refit_every:
                return self._fit
            rows = np.asarray(self.rows, dtype=np.float64)
            self._since_fit = 0
        fit = fit_nonnegative(rows)
        with self._lock:
            self._fit = fit
        return fit


def fit_nonnegative(rows: np.ndarray) -> StepCost:
    """Least squares of ms on [1, tokens, kpairs] with every coefficient >= 0: the best fit over the
    subsets of features (three features: seven subsets), a feature left out costing 0."""
    x = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
    y = rows[:, 2]
    best, best_err = np.array([float(np.median(y)), 0.0, 0.0]), math.inf
    for k in (1, 2, 3):
        for cols in itertools.combinations(range(3), k):
            coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sum((x[:, cols] @ coef - y) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(3)
                best[list(cols)] = coef
    return StepCost(*(float(v) for v in best))
