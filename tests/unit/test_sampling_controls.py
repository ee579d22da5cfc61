"""The engine's sampling controls end to end in one process: min_tokens, include_stop_str_in_output,
logit_bias, allowed_token_ids, the penalties' bookkeeping across a resumed stream, and their validation."""

from __future__ import annotations

import pytest

from kvferry.engine.request import InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


PROMPT = list(range(100, 120))


def run(engine, prompt=PROMPT, **params):
    return engine.generate([{"prompt_token_ids": prompt, "params": SamplingParams(**params)}])[0]


def test_min_tokens_holds_eos_back_then_lets_it_end_the_output(engine):
    eos = engine.eos_ids[0]
    pushed = {"temperature": 0.0, "max_tokens": 20, "logit_bias": ((eos, 100.0),)}
    assert run(engine, **pushed).output_token_ids == [eos]
    c = run(engine, min_tokens=5, **pushed)
    assert (
        len(c.output_token_ids) == 6 and c.output_token_ids[-1] == eos and eos not in c.output_token_ids[:5]
    )
    assert c.finish_reason == "stop"


def test_stop_ids_wait_for_min_tokens_too(engine):
    greedy = run(engine, temperature=0.0, max_tokens=8, ignore_eos=True).output_token_ids
    stop_id = greedy[1]
    c = run(engine, temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=(stop_id,), min_tokens=4)
    # the stop id is banned from the first 4 tokens (so the second differs), and nothing ends early
    assert c.output_token_ids[0] == greedy[0] and c.output_token_ids[1] != stop_id
    assert stop_id not in c.output_token_ids[:4] and len(c.output_token_ids) >= 4


def test_include_stop_str_in_output(engine):
    text = run(engine, temperature=0.0, max_tokens=12, ignore_eos=True).text
    stop = text[3:6]
    cut = run(engine, temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,))
    kept = run(
        engine, temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True
    )
    assert stop not in cut.text and kept.text == cut.text + stop
    assert cut.finish_reason == kept.finish_reason == "stop"


def test_allowed_token_ids_and_a_resumed_streams_penalties(engine):
    c = run(engine, temperature=1.0, seed=3, max_tokens=30, allowed_token_ids=(7, 8, 9), ignore_eos=True)
    assert set(c.output_token_ids) <= {7, 8, 9}
    # a stream resumed elsewhere: its earlier outputs are in the prompt, and still count as outputs
    params = {
        "temperature": 0.0,
        "max_tokens": 12,
        "ignore_eos": True,
        "presence_penalty": 2.0,
        "frequency_penalty": 2.0,
    }
    whole = run(engine, **params).output_token_ids
    req = engine.make_request(
        None, SamplingParams(**{**params, "max_tokens": 8}), PROMPT + whole[:4], "resumed"
    )
    req.output_offset = 4
    engine.submit(req)
    resumed = [t for out in engine.outputs_of("resumed") for t in out.new_token_ids]
    assert resumed == whole[4:]


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 100]"),
        ({"min_tokens": 20, "max_tokens": 4}, "min_tokens must be in [0, max_tokens=4]"),
        ({"logit_bias": ((5, 300.0),)}, "logit_bias must map token ids to numbers in [-100, 100]"),
        ({"logit_bias": ((9000, 1.0),)}, "logit_bias must lie in [0, 8192)"),
        ({"allowed_token_ids": (1, 99999)}, "allowed_token_ids must lie in [0, 8192)"),
        ({"logprobs": 21}, "logprobs must be in [0, 20]"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20]"),
    ],
)
def test_bad_controls_are_refused_naming_the_field(engine, params, words):
    with pytest.raises(InvalidRequestError, match=None) as err:
        engine.make_request(None, SamplingParams(**params), PROMPT)
    assert words in str(err.value)


def test_n_draws_every_first_token_from_the_same_logits(engine):
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=11, n=5, logprobs=0)
    req = engine.make_request(None, params, PROMPT, "n-draws")
    engine.submit(req)
    list(engine.outputs_of("n-draws"))
    draws = [
        (req.output_token_ids[0], req.output_logprobs[0]),
        *((s.token, s.logprob) for s in req.sibling_samples),
    ]
    assert len(draws) == 5 and len({t for t, _ in draws}) > 1
    for token, lp in draws:  # each one's logprob is that token's under the prompt's own distribution
        scored = run(engine, [*PROMPT, token], temperature=0.0, max_tokens=1, prompt_logprobs=0)
        assert lp.token_id == token and lp.logprob == pytest.approx(
            scored.prompt_logprobs[-1].logprob, abs=1e-4
        )
