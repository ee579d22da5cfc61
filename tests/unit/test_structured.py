"""engine.structured: constraints -> llguidance matchers for the tiny model's tokenizer, the cache, the
token mask the sampler applies, the replay that rebuilds a matcher elsewhere, and refusals."""

from __future__ import annotations

import json
import time

import pytest
import torch

from kvferry.engine.structured import Grammars, StructuredOutputError, fill_mask, grammar_of, masks, replay
from kvferry.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer.to_json(), tokenizer.vocab_size, (tokenizer.eos_token_id,))


def walk(grammars, tokenizer, kind, value, seed: int, steps: int = 80) -> tuple[str, bool]:
    """Draw tokens uniformly among the allowed ones; (text, whether the matcher stopped)."""
    gen = torch.Generator().manual_seed(seed)
    matcher = grammars.matcher(kind, value)
    ids = []
    for _ in range(steps):
        allowed = masks(fill_mask([matcher], tokenizer.vocab_size), tokenizer.vocab_size)[0]
        allowed[tokenizer.eos_token_id] = False
        choices = allowed.nonzero().flatten()
        if matcher.is_stopped() or len(choices) == 0:
            break
        token = int(choices[torch.randint(len(choices), (1,), generator=gen)])
        assert matcher.consume_token(token)
        ids.append(token)
    return tokenizer.decode(ids), matcher.is_stopped() or matcher.is_accepting()


def test_masks_allow_exactly_what_the_constraints_allow(grammars, tokenizer):
    for seed in range(5):
        text, done = walk(grammars, tokenizer, "choice", json.dumps(["red", "green", "blue"]), seed)
        assert done and text in ("red", "green", "blue")
        text, done = walk(grammars, tokenizer, "regex", "[0-9]{3}-[a-z]{2}", seed)
        assert done and len(text) == 6 and text[3] == "-" and text[:3].isdigit()
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    text, done = walk(grammars, tokenizer, "json_schema", json.dumps(schema), 0, steps=400)
    if done:
        assert list(json.loads(text)) == ["n"]  # json.dumps's layout: '{"n": 12}'
    assert text.startswith('{"n": ')


def test_the_cache_compiles_each_constraint_once_and_hands_out_copies(grammars, tokenizer):
    key = ("regex", "ab+")
    a = grammars.matcher(*key)
    start = grammars._cache[key]
    b = grammars.matcher(*key)
    assert grammars._cache[key] is start and a is not b and a is not start  # compiled once, copied
    vocab = tokenizer.vocab_size
    before = fill_mask([b], vocab)
    assert a.consume_tokens(tokenizer.encode("ab"))  # moves `a` on ...
    assert not torch.equal(fill_mask([a], vocab), before)
    assert torch.equal(fill_mask([b], vocab), before)  # ... and neither its sibling
    assert torch.equal(fill_mask([grammars.matcher(*key)], vocab), before)  # nor the cached start


def test_replay_rebuilds_the_state_another_worker_had(grammars, tokenizer):
    value = json.dumps(["alpha beta", "alpha gamma"])
    ids = tokenizer.encode("alpha gamma")
    original = grammars.matcher("choice", value)
    original.consume_tokens(ids[:-1])
    rebuilt = grammars.matcher("choice", value)
    replay(rebuilt, ids[:-1])
    vocab = tokenizer.vocab_size
    assert torch.equal(fill_mask([original], vocab), fill_mask([rebuilt], vocab))
    with pytest.raises(StructuredOutputError, match="does not match"):
        replay(grammars.matcher("choice", value), tokenizer.encode("zzz"))


def test_an_empty_row_allows_eos_only():
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b100
    out = masks(bitmask, 40, eos_ids=(0, 7))
    assert out[0].nonzero().flatten().tolist() == [2]
    assert out[1].nonzero().flatten().tolist() == [0, 7]


@pytest.mark.parametrize(
    ("kind", "value", "words"),
    [
        ("json_schema", '{"type": "bogus"}', "bogus"),
        ("json_schema", "{not json", "Expecting"),
        ("json_schema", '{"type": "object", "not": {"type": "string"}}', "not"),  # refused, never ignored
        ("regex", "[unclosed", "unclosed"),
        ("choice", "[]", "non-empty"),
        ("grammar", "start: undefined_rule", "undefined_rule"),
    ],
)
def test_refusals_say_why(grammars, kind, value, words):
    with pytest.raises(StructuredOutputError, match=None) as err:
        grammars.check(kind, value)
    assert words.lower() in str(err.value).lower()
    assert grammar_of("json_object", "")  # (and the good ones build)


def test_a_grammar_over_budget_is_refused_at_compile_time_and_quickly(grammars):
    """llguidance builds its lexer at the first masks: compiling warms them under LIMITS, so a regex whose
    lexer explodes is a refusal naming the limit, not seconds of some engine step."""
    t0 = time.monotonic()
    with pytest.raises(
        StructuredOutputError, match=r"over the grammar budget: .*too many expressions"
    ) as err:
        grammars.check("regex", "(a{1000}){1000}")
    assert time.monotonic() - t0 < 2.0  # (with llguidance's own limits: ~0.5 s of lexer, then a failure)
    assert "<state>" not in str(err.value)  # no parser state in what a client reads


def test_a_matcher_that_fails_mid_generation_ends_its_request_in_error(grammars, tokenizer):
    """A constraint that compiles but passes its budget later: the request ends FINISHED_ERROR at the token
    that failed (which is not kept), with why; never "stop" with text the constraint does not match."""
    from kvferry.engine.output import OutputState
    from kvferry.engine.request import Request, RequestStatus, SamplingParams

    value = "(b|c)(a{1000}){1000}"
    grammars.check("regex", value)  # (the first step and the one after it are in budget)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    req.matcher = grammars.matcher("regex", value)
    state = OutputState(req, tokenizer, (tokenizer.eos_token_id,), 1024)
    # as the engine does: a mask, then a token it allows (here: the first), until the matcher fails
    status, added = None, []
    for _ in range(20):
        allowed = masks(fill_mask([req.matcher], tokenizer.vocab_size), tokenizer.vocab_size, state.stop_ids)
        token = int(allowed[0].nonzero()[0])
        status = state.add_token(token)
        if status is not None:
            break
        added.append(token)
    assert status == RequestStatus.FINISHED_ERROR and req.output_token_ids == added  # (not the last)
    assert req.error.startswith(f"the structured output failed at output token {len(added)}: ")
    assert "too many" in req.error and "<state>" not in req.error and "<non-verbose" not in req.error
    req.status = status
    out = state.emit()
    assert out.finished and out.finish_reason == "error" and out.error == req.error
    assert out.text == tokenizer.decode(added)
    assert out.text == "" or (out.text[0] in "bc" and set(out.text[1:]) <= {"a"})  # what it kept matches


def test_an_engine_request_whose_grammar_fails_finishes_with_error(tiny_model_dir):
    from kvferry.engine.engine import EngineConfig, LLMEngine
    from kvferry.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    structured = ("regex", "(b|c)(a{1000}){1000}")
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, structured=structured)
    outs = list(engine.stream("hello", params))
    last = outs[-1]
    assert last.finish_reason == "error" and "structured output failed" in last.error
    text = "".join(o.text for o in outs)
    assert text == "" or (text[0] in "bc" and set(text[1:]) <= {"a"})  # what it kept matches
