"""Load-test metrics (vLLM's formulas), SLO attainment, goodput interpolation and open-loop arrivals."""

from __future__ import annotations

import itertools
import statistics

import pytest

from kvferry.loadtest.arrivals import ArrivalSchedule, arrival_offsets
from kvferry.loadtest.metrics import RequestRecord, Slo, goodput, read_records, summarize, write_records


def rec(send, ttft, tokens, tpot, status="OK"):
    first = send + ttft
    times = [first + i * tpot for i in range(tokens)]
    return RequestRecord(send, first, times[-1], tokens, status, times)


def test_request_figures():
    r = rec(10.0, 0.5, 5, 0.1)
    assert r.ttft == pytest.approx(0.5) and r.e2el == pytest.approx(0.9)
    assert r.tpot == pytest.approx(0.1) and r.itls == pytest.approx([0.1] * 4)
    assert rec(0, 0.2, 1, 0).tpot is None  # one token: no TPOT, judged on TTFT alone
    assert rec(0, 0.2, 1, 0).good(Slo(0.3, 0.01))
    assert not rec(0, 0.5, 5, 0.1).good(Slo(0.3, 1.0))  # TTFT too slow
    assert not rec(0, 0.1, 5, 0.2).good(Slo(1.0, 0.1))  # TPOT too slow
    failed = RequestRecord(0.0, status="UNAVAILABLE")
    assert not failed.ok and not failed.good(Slo(10, 10))


def test_summary_counts_errors_as_misses_and_round_trips_jsonl(tmp_path):
    records = [rec(i, 0.1 * (i + 1), 4, 0.05) for i in range(8)]
    records += [RequestRecord(9.0, status="RESOURCE_EXHAUSTED"), RequestRecord(9.5, status="UNAVAILABLE")]
    write_records(tmp_path / "r.jsonl", records)
    records = read_records(tmp_path / "r.jsonl")
    s = summarize(records, rate=1.0, slo=Slo(ttft_s=0.45, tpot_s=0.06), duration_s=10.0)
    assert (s.sent, s.completed, s.errors, s.good) == (10, 8, 2, 4)  # ttft 0.1..0.4 pass
    assert s.attainment == pytest.approx(0.4)
    assert s.request_throughput == pytest.approx(0.8) and s.output_throughput == pytest.approx(3.2)
    assert s.ttft_ms["p50"] == pytest.approx(450.0)  # median of 100..800 ms
    assert s.tpot_ms["p99"] == pytest.approx(50.0)
    assert s.flat()["ttft_ms_p90"] == pytest.approx(730.0)
    with pytest.raises(ValueError):
        summarize(records, 1.0, Slo(1, 1), 0)


@pytest.mark.parametrize(
    ("rates", "attainments", "expected"),
    [
        ([1, 2, 4, 8], [1.0, 0.95, 0.85, 0.2], 2 + 2 * (0.05 / 0.10)),  # crossing between 2 and 4
        ([4, 1, 2], [0.85, 1.0, 0.95], 3.0),  # order of the sweep does not matter
        ([1, 2], [0.5, 0.1], 0.0),  # fails already at the lowest rate
        ([1, 2, 4], [1.0, 1.0, 0.99], 4.0),  # never fails: the highest swept rate (a lower bound)
        ([1, 2], [0.9, 0.0], 1.0),  # exactly on target counts
    ],
)
def test_goodput(rates, attainments, expected):
    assert goodput(rates, attainments) == pytest.approx(expected)


def test_goodput_needs_matching_lists():
    with pytest.raises(ValueError):
        goodput([1, 2], [1.0])


def test_open_loop_rate_and_burstiness():
    poisson = arrival_offsets(rate=50, duration_s=100, burstiness=1.0, seed=1)
    assert len(poisson) == pytest.approx(5000, rel=0.05)
    assert all(0 < t < 100 for t in poisson) and poisson == sorted(poisson)
    gaps = [b - a for a, b in itertools.pairwise(poisson)]
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.1)  # Poisson: CV 1
    bursty = arrival_offsets(rate=50, duration_s=100, burstiness=0.25, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(2.0, abs=0.3)  # CV 1/sqrt(k)
    assert arrival_offsets(5, 10, seed=3) == arrival_offsets(5, 10, seed=3)
    with pytest.raises(ValueError):
        arrival_offsets(0, 10)


def test_schedule_is_shared_and_ends():
    schedule = ArrivalSchedule([0.5, 1.0, 2.0], start=100.0)
    assert [schedule.claim() for _ in range(4)] == [100.5, 101.0, 102.0, None]


def test_prompts_share_their_prefix_and_are_reproducible():
    from kvferry.loadtest.prompts import PromptSource

    src = PromptSource(vocab_size=100, input_len=40, prefix_share=0.5, seed=2)
    a, b = src.prompt(0), src.prompt(1)
    assert len(a) == len(b) == 40 and a[:20] == b[:20] and a[20:] != b[20:]
    assert all(3 <= t < 100 for t in a + b)
    assert PromptSource(100, 40, 0.5, seed=2).prompt(1) == b
    assert [src.next_index() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError):
        PromptSource(100, 40, prefix_share=1.0)


def test_each_rate_gets_its_own_seed():
    """Prompts and arrivals differ between the rates of a sweep (no prefix-cache hits across rates)
    but not between the targets swept at one rate."""
    from kvferry.loadtest.sweep import rate_seed

    seeds = {rate_seed(0, r) for r in (0.5, 1, 2, 3, 4)}
    assert len(seeds) == 5
    assert rate_seed(0, 2) == rate_seed(0, 2.0) != rate_seed(1, 2)
