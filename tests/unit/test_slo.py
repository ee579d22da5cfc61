"""SLO-aware admission's parts: the engine's step-time fit, the router's prefill queues, targets."""

from __future__ import annotations

import random

import pytest

from kvferry.engine.cost_model import MIN_STEPS, StepCost, StepCostModel, step_pairs
from kvferry.engine.request import InvalidRequestError, Request, SamplingParams
from kvferry.router.slo import Prediction, PrefillQueues, Targets, resolve_targets
from kvferry.v1 import generate_pb2


def test_the_fit_recovers_a_step_time_model_from_noisy_steps():
    rng = random.Random(0)
    model = StepCostModel()
    truth = StepCost(fixed_ms=2.0, per_token_ms=0.05, per_kpair_ms=0.004)
    for _ in range(300):
        tokens = rng.choice([1, 4, 16, 64, 256, 512])
        pairs = tokens * rng.randint(0, 512) + tokens * (tokens + 1) // 2
        model.observe(tokens, pairs, truth.step_ms(tokens, pairs) * rng.uniform(0.97, 1.03))
    fit = model.fit()
    assert fit.fixed_ms == pytest.approx(2.0, rel=0.1)
    assert fit.per_token_ms == pytest.approx(0.05, rel=0.1)
    assert fit.per_kpair_ms == pytest.approx(0.004, rel=0.15)


def test_no_fit_before_enough_steps_and_never_a_negative_coefficient():
    model = StepCostModel()
    for i in range(MIN_STEPS - 1):
        model.observe(10 * (i + 1), 0, 5.0)
    assert model.fit() is None
    for i in range(40):  # time falling with size: a least-squares slope would be negative
        model.observe(10 * (i + 1), 0, 9.0 - 0.1 * i)
    fit = model.fit()
    assert fit.per_token_ms == 0.0 and fit.per_kpair_ms >= 0 and fit.fixed_ms > 0


def test_a_prompt_is_priced_in_chunks_of_the_token_budget():
    cost = StepCost(fixed_ms=3.0, per_token_ms=0.1, per_kpair_ms=0.002)
    assert cost.prompt_ms(0, 512) == 0.0
    one_chunk = cost.prompt_ms(256, 512)
    assert one_chunk == pytest.approx(3.0 + 25.6 + 0.002 * (256 * 257 / 2) / 1e3)
    assert cost.prompt_ms(256, 100) == pytest.approx(one_chunk + 2 * 3.0)  # three steps
    assert cost.prompt_ms(64, 512, cached=192) > cost.prompt_ms(64, 512)  # attends over the cached ones


def test_step_pairs_counts_each_rows_keys():
    a = Request("a", [1] * 10, SamplingParams())
    a.num_computed_tokens = 6  # 4 more tokens after 6: 4 * 6 + 10
    b = Request("b", [1] * 3, SamplingParams())
    assert step_pairs([(a, 4), (b, 3)]) == 4 * 6 + 10 + 6


def test_heartbeat_lists_are_checked():
    cost = StepCost(1.5, 0.02, 0.003)
    assert StepCost.from_list(cost.to_list()) == cost
    for bad in (None, [1, 2], [1, -1, 0], ["x", 1, 1], [float("nan"), 0, 0]):
        assert StepCost.from_list(bad) is None


def test_prefill_queues_count_the_work_ahead_of_each_priority():
    q = PrefillQueues()
    q.add("w", "low", priority=5, cost_ms=100)
    q.add("w", "a", priority=0, cost_ms=40)
    q.add("w", "b", priority=0, cost_ms=30)
    q.add("w", "lower", priority=7, cost_ms=60)
    assert q.wait_ms("w", 0) == 70 + 100  # its priority's, and at most the one lower prefill it may run
    assert q.wait_ms("w", 5) == 170 + 60
    assert q.wait_ms("w", 9) == 230
    q.remove("w", "a")
    assert q.wait_ms("w", 0) == 30 + 100
    for rid in ("b", "low", "lower", "gone"):
        q.remove("w", rid)
    assert q.workers == {} and q.wait_ms("other", 0) == 0 and q.workers == {}  # a read makes no entry


def test_targets_come_from_the_request_else_the_cluster_and_are_checked():
    assert resolve_targets(generate_pb2.Slo(), None, None) == Targets(None, None)
    assert resolve_targets(generate_pb2.Slo(), 1000.0, 100.0) == Targets(1000.0, 100.0)
    assert resolve_targets(generate_pb2.Slo(ttft_ms=250), 1000.0, 100.0) == Targets(250.0, 100.0)
    for bad in (
        generate_pb2.Slo(ttft_ms=-1),
        generate_pb2.Slo(tpot_ms=float("inf")),
        generate_pb2.Slo(ttft_ms=1e12),
    ):
        with pytest.raises(InvalidRequestError, match=r"slo\.(ttft|tpot)_ms"):
            resolve_targets(bad, None, None)


def test_a_prediction_misses_only_the_targets_it_exceeds():
    p = Prediction(ttft_ms=800.0, wait_ms=700.0, prefill_ms=100.0, worker="w", tpot_ms=40.0)
    assert p.miss(Targets()) is None
    assert p.miss(Targets(ttft_ms=1000.0, tpot_ms=50.0)) is None
    assert p.miss(Targets(ttft_ms=500.0)) == "ttft"
    assert p.miss(Targets(tpot_ms=30.0)) == "tpot"
    assert Prediction(ttft_ms=None).miss(Targets(ttft_ms=1.0)) is None  # nothing to predict with yet


def test_what_admission_learns_is_per_priority_bounded_and_forgotten(monkeypatch):
    from types import SimpleNamespace

    from kvferry.router import slo
    from kvferry.router.config import RouterConfig

    metrics = SimpleNamespace(predicted_ttft=lambda predicted, actual: None)
    learner = slo.SloPredictor(RouterConfig(), directory=None, routing=None, metrics=metrics)
    clock = [100.0]
    monkeypatch.setattr(slo.time, "monotonic", lambda: clock[0])

    def served(priority: int, priced: float, actual: float) -> None:
        prediction = Prediction(ttft_ms=priced, wait_ms=priced / 2, prefill_ms=priced / 2)
        learner.first_token(SimpleNamespace(prediction=prediction, priority=priority), actual)

    for _ in range(30):
        served(1, 100.0, 250.0)  # the low class waits 2.5x what was priced
    served(0, 100.0, 110.0)
    assert learner.ttft_scale(1) == pytest.approx(2.5) and learner.ttft_margin(1) == pytest.approx(2.5)
    assert learner.ttft_scale(0) == 1.0  # too few samples at priority 0: the low class does not leak in
    served(slo.DEPRIORITIZED, 100.0, 9000.0)
    assert slo.DEPRIORITIZED not in learner._samples
    clock[0] += slo.SAMPLE_TTL_S + 1  # a spell with nothing served: forgotten
    assert learner.ttft_scale(1) == 1.0 and learner.ttft_margin(1) == 1.0
    for p in range(3 * slo.MAX_PRIORITY_LEVELS):
        served(p, 100.0, 100.0)
    assert len(learner._samples) == slo.MAX_PRIORITY_LEVELS
