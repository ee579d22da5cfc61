"""kvferry.model.sampler: greedy, temperature -> top-k -> top-p masks, seeded sampling."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvferry.model.sampler import SampleRow, SamplingSpec, apply_top_k_top_p, sample, token_logprobs


def draw(logits, specs, generators) -> list[int]:
    """One token per row for these specs and generators (no controls)."""
    rows = [SampleRow(spec, gen) for spec, gen in zip(specs, generators, strict=True)]
    return [s.token for s in sample(logits, rows)]


LOGITS = [1.0, 2.0, 0.5, -1.0, 1.5, 0.0]


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """softmax(logits / T), restricted to the top-k, then to the top-p prefix, renormalised each time."""
    exps = [math.exp(x / temperature) for x in logits]
    probs = [e / sum(exps) for e in exps]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = order[:top_k] if top_k > 0 else order
    mass = sum(probs[i] for i in keep)
    kept, before = [], 0.0
    for i in keep:
        if before >= top_p:
            break
        kept.append(i)
        before += probs[i] / mass
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


def frequencies(samples: list[int], vocab: int) -> list[float]:
    return [samples.count(i) / len(samples) for i in range(vocab)]


def kept(masked: torch.Tensor) -> set[int]:
    return set(torch.isfinite(masked).nonzero().flatten().tolist())


def test_greedy_picks_argmax_per_row_and_ignores_generators():
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.9], [5.0, 0.0, 4.9, 1.0], [-3.0, -2.0, -1.0, -1.5]])
    specs = [SamplingSpec(temperature=0.0, top_k=2, top_p=0.5)] * 3
    assert draw(logits, specs, [None, torch.Generator().manual_seed(1), None]) == [1, 0, 2]


def test_mixed_batch_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 9.0, 1.0], [0.0, 0.0, 50.0]])
    specs = [SamplingSpec(temperature=0.0), SamplingSpec(temperature=1.0)]
    assert draw(logits, specs, [None, torch.Generator().manual_seed(0)]) == [1, 2]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_exactly_the_k_largest(k):
    logits = torch.tensor([0.3, -1.2, 2.5, 0.9, 1.7, -0.4, 3.1, 0.0])
    masked = apply_top_k_top_p(logits, top_k=k, top_p=1.0)
    expected = set(torch.topk(logits, k).indices.tolist())
    assert kept(masked) == expected
    assert torch.equal(masked[list(expected)], logits[list(expected)])  # survivors are untouched
    assert torch.isneginf(masked[[i for i in range(8) if i not in expected]]).all()


@pytest.mark.parametrize("k", [0, 8, 20])
def test_top_k_disabled_or_not_smaller_than_vocab_keeps_everything(k):
    logits = torch.tensor([0.3, -1.2, 2.5, 0.9, 1.7, -0.4, 3.1, 0.0])
    assert torch.equal(apply_top_k_top_p(logits, top_k=k, top_p=1.0), logits)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.01, {2}),  # the top token always stays
        (0.45, {2}),  # 0.5 >= 0.45 already
        (0.6, {2, 0}),  # 0.5 < 0.6, 0.75 reaches it
        (0.8, {2, 0, 3}),  # 0.75 < 0.8, 0.9 reaches it
        (0.95, {2, 0, 3, 1}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, expected):
    logits = torch.tensor([0.25, 0.10, 0.50, 0.15]).log()
    assert kept(apply_top_k_top_p(logits, top_k=0, top_p=top_p)) == expected


def test_top_p_after_top_k_uses_renormalised_mass():
    # probs [0.5, 0.3, 0.2]: top-k=2 renormalises to [0.625, 0.375]; top_p=0.6 then keeps only token 0.
    # (top-p first would keep {0, 1} since 0.5 < 0.6, and top-k=2 would keep both.)
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert kept(apply_top_k_top_p(logits, top_k=2, top_p=0.6)) == {0}


def test_temperature_is_applied_before_top_p():
    # At T=1 top_p=0.7 keeps {0, 1}; at T=0.5 token 0 has mass 0.78 >= 0.7, so only token 0 survives.
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log()
    gen = torch.Generator().manual_seed(0)
    cold = draw(logits.expand(400, 3), [SamplingSpec(0.5, 0, 0.7)] * 400, [gen] * 400)
    assert set(cold) == {0}
    warm = draw(logits.expand(400, 3), [SamplingSpec(1.0, 0, 0.7)] * 400, [gen] * 400)
    assert set(warm) == {0, 1}


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (0.8, 0, 0.8), (0.8, 4, 0.9), (2.0, 5, 0.75)],
)
def test_masked_distribution_matches_reference(temperature, top_k, top_p):
    ref = reference_probs(LOGITS, temperature, top_k, top_p)
    masked = apply_top_k_top_p(torch.tensor(LOGITS) / temperature, top_k, top_p)
    assert kept(masked) == {i for i, p in enumerate(ref) if p > 0}
    gen = torch.Generator().manual_seed(1234)
    draws = torch.multinomial(masked.softmax(-1), 20000, replacement=True, generator=gen).tolist()
    for got, want in zip(frequencies(draws, len(LOGITS)), ref, strict=True):
        assert got == pytest.approx(want, abs=0.02)
        if want == 0:
            assert got == 0


def test_sample_end_to_end_distribution():
    temperature, top_k, top_p = 0.8, 4, 0.9
    ref = reference_probs(LOGITS, temperature, top_k, top_p)
    n = 4000
    gen = torch.Generator().manual_seed(7)
    spec = SamplingSpec(temperature, top_k, top_p)
    draws = draw(torch.tensor([LOGITS]).expand(n, -1), [spec] * n, [gen] * n)
    for got, want in zip(frequencies(draws, len(LOGITS)), ref, strict=True):
        assert got == pytest.approx(want, abs=0.03)
        if want == 0:
            assert got == 0


def _draw(seed: int, n: int = 64) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.zeros(n, 16)  # uniform over 16 tokens: sequences of different seeds will differ
    return draw(logits, [SamplingSpec(1.0)] * n, [gen] * n)


def test_same_seed_same_samples_different_seed_different_samples():
    assert _draw(42) == _draw(42)
    assert _draw(42) != _draw(43)
    assert len(set(_draw(42))) > 1


# -- logprobs and the controls (presence/frequency/repetition penalties, min_p, logit_bias, the token set)
def test_logprobs_are_the_raw_log_softmax_with_rank_and_top_k():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [3.0, 0.0, 0.0, 2.0]])
    rows = [SampleRow(SamplingSpec(temperature=0.0, logprobs=2)), SampleRow(SamplingSpec(0.0, logprobs=0))]
    out = sample(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert [o.token for o in out] == [1, 0]
    assert out[0].logprob.logprob == pytest.approx(ref[0, 1].item())
    assert out[0].logprob.rank == 1
    assert [t for t, _ in out[0].logprob.top] == [1, 3]
    assert out[1].logprob.top == []
    # a token that is not the most likely: its rank counts the tokens above it
    found = token_logprobs(logits, [0], [2], [1])[0]
    assert found.rank == 4 and found.logprob == pytest.approx(ref[0, 2].item())


def test_logprobs_are_taken_before_the_controls():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    spec = SamplingSpec(temperature=0.0, logit_bias=((0, 50.0),), logprobs=1)
    out = sample(logits, [SampleRow(spec)])[0]
    assert out.token == 0  # the bias chose it
    assert out.logprob.logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())
    assert out.logprob.top[0][0] == 2  # the model's own favourite


def test_penalties_match_their_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 1.0, -0.5])
    prompt, outputs = [3], [1, 1, 2]
    spec = SamplingSpec(0.0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    from kvferry.model.sampler import apply_controls

    got = apply_controls(logits.clone(), SampleRow(spec, prompt=prompt, outputs=outputs))
    expected = logits.clone()
    for t in {*prompt, *outputs}:  # repetition: prompt and outputs, divided when positive
        expected[t] = expected[t] / 2.0 if expected[t] > 0 else expected[t] * 2.0
    for t in set(outputs):  # frequency per occurrence, presence once (outputs only)
        expected[t] -= 0.25 * outputs.count(t) + 0.5
    assert torch.allclose(got, expected)


def test_transformers_repetition_penalty_agrees():
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=gen)
    seen = torch.randint(0, 50, (1, 12), generator=gen)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())
    from kvferry.model.sampler import apply_controls

    row = SampleRow(
        SamplingSpec(0.0, repetition_penalty=1.3), prompt=seen[0, :6].tolist(), outputs=seen[0, 6:].tolist()
    )
    assert torch.allclose(apply_controls(logits[0].clone(), row), ref[0])


def test_allowed_tokens_bans_and_min_p_limit_what_is_drawn():
    gen = torch.Generator().manual_seed(5)
    logits = torch.zeros(200, 10)
    spec = SamplingSpec(1.0, allowed_token_ids=(2, 3, 4))
    rows = [SampleRow(spec, gen, banned=(3,)) for _ in range(200)]
    assert {s.token for s in sample(logits, rows)} == {2, 4}
    peaked = torch.tensor([[4.0, 3.0, 0.0, 0.0, -1.0]]).expand(300, 5)
    drawn = {s.token for s in sample(peaked, [SampleRow(SamplingSpec(1.0, min_p=0.2), gen)] * 300)}
    assert drawn == {0, 1}  # p(2) / p(0) = e^-4 < 0.2


def test_a_batch_without_controls_never_copies_the_logits(monkeypatch):
    logits = torch.randn(4, 16)
    monkeypatch.setattr(torch.Tensor, "clone", lambda self: pytest.fail("copied"))
    assert len(sample(logits, [SampleRow(SamplingSpec(0.0))] * 4)) == 4


@pytest.mark.parametrize(
    ("params", "outputs", "argmax_only"),
    [
        ({"temperature": 0.0}, [], True),
        ({"temperature": 0.7}, [], False),
        ({"temperature": 0.0, "logprobs": 0}, [], False),
        ({"temperature": 0.0, "repetition_penalty": 1.2}, [], False),
        ({"temperature": 0.0, "logit_bias": {5: 3.0}}, [], False),
        ({"temperature": 0.0, "allowed_token_ids": [1, 2]}, [], False),
        ({"temperature": 0.0, "min_tokens": 2}, [7], False),  # EOS still banned
        ({"temperature": 0.0, "min_tokens": 2}, [7, 8], True),
        ({"temperature": 0.0, "n": 2}, [], False),  # the siblings' first tokens are still to draw
        ({"temperature": 0.0, "n": 2}, [7], True),
    ],
)
def test_the_runners_argmax_shortcut_samples_what_sample_does(params, outputs, argmax_only):
    """ModelRunner._sample takes a batch's argmax without building its SampleRows only for rows whose sample
    is that argmax (greedy, no logprobs, no controls, no siblings to start); its tokens are sample's."""
    from kvferry.engine.model_runner import ModelRunner
    from kvferry.engine.request import Request, SamplingParams

    if "logit_bias" in params:
        params = params | {"logit_bias": tuple(params["logit_bias"].items())}
    if "allowed_token_ids" in params:
        params = params | {"allowed_token_ids": tuple(params["allowed_token_ids"])}
    req = Request("r", [1, 2, 3], SamplingParams(**params), output_token_ids=list(outputs))
    req.banned_until_min = (0,)  # (EOS)
    assert ModelRunner.argmax_only(req) is argmax_only
    if argmax_only:
        logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
        row = ModelRunner._sample_row(req)
        assert not row.controlled
        model = SimpleNamespace(step_argmax=None)
        runner = SimpleNamespace(model=model, argmax_only=ModelRunner.argmax_only)
        assert ModelRunner._sample(runner, logits, 1, [req])[req].token == sample(logits, [row])[0].token
        runner.model.step_argmax = (logits, [49])  # the argmax a list-fed step found for these logits
        assert ModelRunner._sample(runner, logits, 1, [req])[req].token == 49
