"""Per-request records of a load test, and what a rate sweep reports (the formulas of `vllm bench serve`).

TTFT = first token - send; E2EL = last token - send; TPOT = (E2EL - TTFT) / (N_out - 1);
ITL = the gaps between tokens. A request is *good* when it succeeded with TTFT <= SLO_ttft and
TPOT <= SLO_tpot; attainment(rate) = good / sent (errors and rejections count as misses); goodput =
the highest rate with attainment >= 90%, interpolated between the swept rates.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the load generator saw it (times in seconds on one monotonic-ish clock)."""

    send: float
    first_token: float | None = None
    last_token: float | None = None
    output_tokens: int = 0
    status: str = "OK"  # "OK", or the gRPC status name of the failure
    token_times: list[float] = field(default_factory=list)  # arrival time of each streamed message

    def token_arrived(self, now: float, tokens: int) -> None:
        """A streamed message with `tokens` new tokens arrived at `now`."""
        self.token_times.append(now)
        self.output_tokens += tokens
        if self.first_token is None:
            self.first_token = now
        self.last_token = now

    @property
    def ok(self) -> bool:
        return self.status == "OK" and self.first_token is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.send

    @property
    def e2el(self) -> float | None:
        return None if self.last_token is None else self.last_token - self.send

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if not self.ok or self.output_tokens < 2 or self.last_token is None:
            return None
        return (self.last_token - self.first_token) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    def good(self, slo: Slo) -> bool:
        if not self.ok or self.ttft > slo.ttft_s:
            return False
        tpot = self.tpot
        return tpot is None or tpot <= slo.tpot_s

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> RequestRecord:
        return cls(**json.loads(line))


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be > 0 seconds, got ttft={self.ttft_s}, tpot={self.tpot_s}")


def read_records(path: Path) -> list[RequestRecord]:
    with Path(path).open() as f:
        return [RequestRecord.from_json(line) for line in f if line.strip()]


def write_records(path: Path, records: Iterable[RequestRecord]) -> None:
    with Path(path).open("w") as f:
        for r in records:
            f.write(r.to_json() + "\n")


def percentiles_ms(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 (linear interpolation, as numpy and vLLM) in milliseconds; None without samples."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    points = np.percentile(np.asarray(values, dtype=np.float64) * 1e3, PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, points, strict=True)}


@dataclass
class RateSummary:
    rate: float  # the offered request rate (req/s)
    sent: int
    completed: int
    errors: int
    good: int
    attainment: float
    duration_s: float
    request_throughput: float  # completed / duration
    output_throughput: float  # output tokens / duration
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    e2el_ms: dict

    def flat(self) -> dict:
        """One CSV row: nested percentiles become ttft_ms_p50, ..."""
        row = {}
        for key, value in asdict(self).items():
            if isinstance(value, dict):
                row.update({f"{key}_{k}": v for k, v in value.items()})
            else:
                row[key] = value
        return row


def span_s(records: Sequence[RequestRecord]) -> float:
    """How long a rate's requests took: from the first send to the last token (> 0)."""
    end = max((r.last_token or r.send) for r in records)
    return max(end - min(r.send for r in records), 1e-9)


def summarize(records: Sequence[RequestRecord], rate: float, slo: Slo, duration_s: float) -> RateSummary:
    """What one rate of a sweep achieved. `duration_s`: from the first send to the last token."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.ok]
    good = sum(r.good(slo) for r in records)
    return RateSummary(
        rate=rate,
        sent=len(records),
        completed=len(done),
        errors=len(records) - len(done),
        good=good,
        attainment=good / len(records) if records else 0.0,
        duration_s=duration_s,
        request_throughput=len(done) / duration_s,
        output_throughput=sum(r.output_tokens for r in done) / duration_s,
        ttft_ms=percentiles_ms([r.ttft for r in done]),
        tpot_ms=percentiles_ms([t for r in done if (t := r.tpot) is not None]),
        itl_ms=percentiles_ms([gap for r in done for gap in r.itls]),
        e2el_ms=percentiles_ms([r.e2el for r in done if r.e2el is not None]),
    )


def goodput(rates: Sequence[float], attainments: Sequence[float], target: float = 0.9) -> float:
    """The highest rate whose attainment is >= target, interpolated linearly to where the curve crosses
    `target` between the last passing rate and the next (failing) one.

    0.0 when even the lowest swept rate misses the target (the sweep says nothing below it); the
    highest swept rate when none misses (a lower bound: sweep higher).
    """
    if len(rates) != len(attainments) or not rates:
        raise ValueError("goodput needs one attainment per swept rate")
    points = sorted(zip(rates, attainments, strict=True))
    if points[0][1] < target:
        return 0.0
    for (r0, a0), (r1, a1) in itertools.pairwise(points):
        if a1 < target:  # first failing rate: the crossing lies in [r0, r1)
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return points[-1][0]
