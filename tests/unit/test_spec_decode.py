"""Speculative decoding: --speculative-config, the n-gram proposer, the verifier (greedy: the argmax;
sampled: every emitted token distributed as the target's), and the engine with drafts against the
engine without, sampling controls included."""

from __future__ import annotations

import pytest
import torch

from kvferry.engine.engine import EngineConfig, EngineConfigError
from kvferry.engine.request import SamplingParams
from kvferry.engine.spec_decode import NgramProposer, SpeculativeConfig, SpeculativeConfigError
from kvferry.model.sampler import SampleRow, SamplingSpec, speculative_sample, target_probs

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'


def test_config_takes_vllms_json_and_names_what_is_wrong():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (5, 3, 2)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    bad = {
        '{"method": "eagle"}': "method must be one of ngram, draft_model",
        '{"draft_tensor_parallel_size": 2}': "unsupported key(s) draft_tensor_parallel_size",
        '{"num_speculative_tokens": 0}': "num_speculative_tokens must be an integer >= 1",
        '{"prompt_lookup_min": 5, "prompt_lookup_max": 2}': "prompt_lookup_min (5) must be <=",
        "{method: ngram}": "not JSON",
        "[3]": "must be a JSON object",
    }
    for text, words in bad.items():
        with pytest.raises(EngineConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            EngineConfig(speculative_config=text).validate()


def test_the_flag_travels_to_the_workers_as_json():
    """`kvferry up` spells a group's EngineConfig back into worker flags; a cluster file may give the
    config as a mapping."""
    import argparse

    from kvferry.flags import add_config_args, config_flags, config_from

    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineConfig)
    for given in ({"method": "ngram", "num_speculative_tokens": 2}, NGRAM):
        flags = config_flags(EngineConfig(speculative_config=given))
        back = config_from(parser.parse_args(flags), EngineConfig)
        assert SpeculativeConfig.parse(back.speculative_config) == SpeculativeConfig.parse(given)


def test_ngram_proposer_takes_the_longest_suffix_latest_occurrence():
    propose = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3)).propose
    #             0  1  2  3  4  5  6  7  8  9 10 11
    assert propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3], limit=5) == [7, 8, 1]  # latest of [1 2 3]
    assert propose([5, 6, 7, 1, 2, 9, 2], limit=5) == []  # only [2] recurs (n=1 < min 2): none
    assert propose([5, 6, 7, 1, 2, 9, 1, 2], limit=5) == [9, 1, 2]
    assert propose([5, 6, 7, 1, 2, 9, 1, 2], limit=1) == [9]
    assert propose([5, 6, 7, 1, 2, 9, 1, 2], limit=0) == []
    assert propose([1, 2, 3, 4, 5, 6], limit=5) == []
    # a loop shorter than K: the latest occurrence with K tokens after it, not the one just before
    pairs = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2)).propose
    assert pairs([7, 1, 2, 1, 2, 1, 2], limit=5) == [1, 2, 1]
    assert pairs([7, 1, 2, 9, 1, 2], limit=5) == [9, 1, 2]


def test_ngram_proposer_equals_a_plain_search_on_random_sequences():
    def plain(tokens, k, max_n, min_n):
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
            if starts:
                whole = [i for i in starts if i + n + k <= len(tokens)]
                at = (whole or starts)[-1] + n
                return tokens[at : at + k]
        return []

    gen = torch.Generator().manual_seed(2)
    for _ in range(300):
        size, alphabet = (
            int(torch.randint(1, 40, (1,), generator=gen)),
            int(torch.randint(2, 6, (1,), generator=gen)),
        )
        tokens = torch.randint(0, alphabet, (size,), generator=gen).tolist()
        k, max_n = (
            int(torch.randint(1, 5, (1,), generator=gen)),
            int(torch.randint(1, 5, (1,), generator=gen)),
        )
        min_n = int(torch.randint(1, max_n + 1, (1,), generator=gen))
        proposer = NgramProposer(
            SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=max_n, prompt_lookup_min=min_n)
        )
        assert proposer.propose(tokens, limit=k) == plain(tokens, k, max_n, min_n), (tokens, k, max_n, min_n)


def test_greedy_verification_keeps_the_agreeing_prefix_and_the_argmax_after():
    logits = torch.full((4, 8), -5.0)
    logits[0, 3] = logits[1, 4] = logits[2, 6] = logits[3, 1] = 5.0  # argmax 3, 4, 6, 1
    greedy = [SampleRow(SamplingSpec(temperature=0.0))] * 4
    assert [s.token for s in speculative_sample(logits, greedy, [3, 4, 5])] == [3, 4, 6]
    assert [s.token for s in speculative_sample(logits, greedy, [3, 4, 6])] == [3, 4, 6, 1]  # + bonus
    assert [s.token for s in speculative_sample(logits, greedy, [2, 4, 6])] == [3]
    with_lp = [SampleRow(SamplingSpec(temperature=0.0, logprobs=2))] * 4
    found = speculative_sample(logits, with_lp, [3, 4, 6])
    assert [s.logprob.token_id for s in found] == [3, 4, 6, 1] and len(found[0].logprob.top) == 2
    assert found[0].logprob.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[3].item())
    # a control applies at each position: the repetition penalty sees the drafts before it
    rows = [
        SampleRow(SamplingSpec(temperature=0.0, presence_penalty=20.0), outputs=[3] * j) for j in range(3)
    ]
    logits[1, 3] = 4.9  # second choice at position 1 is token 3, banned there by the penalty
    logits[1, 4] = 4.8
    assert [s.token for s in speculative_sample(logits[:3], rows, [3, 4])] == [3, 4, 6]


@pytest.mark.parametrize("spec", [SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.7, top_k=4)])
def test_rejection_sampling_preserves_the_target_distribution(spec):
    """Over 20000 draws on a 6-token vocabulary: the first emitted token is distributed as the target's
    p0 whatever the draft, and the second (after an accepted draft) as p1 (chi-square, 5 dof, p=0.001)."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.2], [0.3, -1.0, 1.5, 0.0, 0.7, 0.1], [0.0] * 6])
    rows = [SampleRow(spec, gen)] * 3
    p0, p1 = (target_probs(logits[j], spec, None) for j in range(2))
    draws = 20000
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(draws):
        out = speculative_sample(logits, rows, [4, 2])
        first[out[0].token] += 1
        if out[0].token == 4:  # the draft was accepted: the next token follows p1
            second[out[1].token] += 1

    def chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
        keep = p > 0
        assert counts[~keep].sum() == 0  # nothing outside the target's support
        expected = p[keep] * counts.sum()
        return float(((counts[keep] - expected) ** 2 / expected).sum())

    assert chi2(first, p0) < 20.5 and chi2(second, p1) < 20.5  # 20.5: the 0.999 quantile at 5 dof
    assert abs(first[4] / draws - p0[4]) < 0.02


@pytest.fixture(scope="module")
def engines(make_engine):
    return make_engine(), make_engine(speculative_config=NGRAM)


LOOP = [101, 202, 303, 404, 505] * 4


@pytest.fixture(scope="module")
def repeat_prompts(engines) -> list[list[int]]:
    """Two prompts, then each followed by the model's greedy continuation and the prompt again: the model
    continues it the same way, so the n-gram proposals (the continuation seen before) are accepted, up
    to where a control makes the target differ."""
    plain, _ = engines
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    bases = [LOOP, list(range(30, 60))]
    outs = [c.output_token_ids for c in plain.generate([{"prompt_token_ids": p} for p in bases], greedy)]
    return [*bases, *(p + o + p for p, o in zip(bases, outs, strict=True))]


@pytest.mark.parametrize(
    "params",
    [
        dict(repetition_penalty=1.01),  # mild: a stronger one stops the copying the drafts propose
        dict(frequency_penalty=0.5, presence_penalty=0.3),
        dict(min_tokens=20, logit_bias=((7, 3.0),)),
        dict(logprobs=3),
        dict(max_tokens=5),
    ],
    ids=["repetition", "frequency-presence", "min-tokens-bias", "logprobs", "short"],
)
def test_engine_with_drafts_matches_the_engine_without(engines, repeat_prompts, params):
    plain, spec = engines
    prompts = repeat_prompts
    sp = SamplingParams(**({"max_tokens": 24, "temperature": 0.0, "ignore_eos": True} | params))
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], sp)
    before, accepted = spec.spec_proposed, spec.spec_accepted
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert [g.output_token_ids for g in got] == [w.output_token_ids for w in want]
    assert all(len(g.output_token_ids) == sp.max_tokens for g in got)
    if sp.logprobs is not None:
        for g, w in zip(got, want, strict=True):
            assert [lp.token_id for lp in g.logprobs] == g.output_token_ids
            assert [lp.logprob for lp in g.logprobs] == pytest.approx(
                [lp.logprob for lp in w.logprobs], abs=1e-4
            )
    assert spec.spec_proposed > before and spec.spec_accepted > accepted
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks
    spec.block_manager.check_invariants()


def test_sampled_requests_with_drafts_finish_with_their_lengths_and_repeat_by_seed(engines):
    _, spec = engines
    sp = SamplingParams(max_tokens=30, temperature=0.8, seed=4, ignore_eos=True)
    first = spec.generate([{"prompt_token_ids": LOOP}] * 3, sp)
    again = spec.generate([{"prompt_token_ids": LOOP}], sp)
    assert all(len(c.output_token_ids) == 30 for c in first)
    assert first[0].output_token_ids == again[0].output_token_ids


def test_a_stop_string_inside_accepted_drafts_ends_the_output_there(engines):
    plain, spec = engines
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = plain.generate([{"prompt_token_ids": LOOP}], sp)[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    want = plain.generate([{"prompt_token_ids": LOOP}], sp)[0]
    got = spec.generate([{"prompt_token_ids": LOOP}], sp)[0]
    assert (got.text, got.output_token_ids, got.finish_reason) == (want.text, want.output_token_ids, "stop")


def test_draft_model_config_parses_as_vllm_spells_it():
    cfg = SpeculativeConfig.parse('{"model": "draft", "num_speculative_tokens": 4}')
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "draft", 4)
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "/some/dir"}).model == "/some/dir"
    with pytest.raises(SpeculativeConfigError, match="model must name the draft model"):
        SpeculativeConfig.parse('{"method": "draft_model"}')
    with pytest.raises(SpeculativeConfigError, match="goes with method draft_model"):
        SpeculativeConfig.parse('{"method": "ngram", "model": "draft"}')
