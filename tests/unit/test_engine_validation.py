"""Bad input is refused with a message naming the field, and the engine keeps serving afterwards."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from kvferry.cli import sampling_params_from
from kvferry.engine.engine import EngineConfig, EngineConfigError
from kvferry.engine.request import InvalidRequestError, SamplingParams
from kvferry.model.config import generation_eos_ids

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_model_len=64, num_kv_blocks=16)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [5.0, 6.0]}, "prompt_token_ids"),
        ({"prompt_token_ids": [-1]}, "prompt_token_ids"),
        ({"prompt_token_ids": [10**9]}, "prompt_token_ids"),
        ({"prompt_token_ids": list(range(64))}, "max_model_len"),
        ({"params": SamplingParams(max_tokens=0)}, "max_tokens"),
        ({"params": SamplingParams(temperature=float("nan"))}, "temperature"),
        ({"params": SamplingParams(temperature=-1.0)}, "temperature"),
        ({"params": SamplingParams(top_p=0.0)}, "top_p"),
        ({"params": SamplingParams(top_k=-2)}, "top_k"),
        ({"params": SamplingParams(stop=("",))}, "stop"),
        ({"params": SamplingParams(stop_token_ids=(1.5,))}, "stop_token_ids"),
    ],
)
def test_bad_requests_are_refused_and_engine_keeps_serving(engine, kwargs, field):
    args = {"prompt": "hello", "params": GREEDY} | kwargs
    with pytest.raises(InvalidRequestError, match=field):
        engine.add_request(args.pop("prompt", None), args.pop("params"), **args)
    assert not engine.has_unfinished()
    outs = list(engine.stream("hello", GREEDY))
    assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_tiny_temperature_is_greedy(engine):
    greedy = [t for o in engine.stream("abc", GREEDY) for t in o.new_token_ids]
    tiny = SamplingParams(max_tokens=3, temperature=1e-30, ignore_eos=True, seed=1)
    assert [t for o in engine.stream("abc", tiny) for t in o.new_token_ids] == greedy


def test_duplicate_and_unknown_request_ids(engine):
    engine.add_request("x", GREEDY, request_id="dup")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("y", GREEDY, request_id="dup")
    assert engine.abort("dup") and not engine.abort("dup")
    with pytest.raises(InvalidRequestError, match="no unfinished request"):
        next(engine.outputs_of("never-added"))
    assert [o.finish_reason for o in engine.step()] == ["abort"]


@pytest.mark.parametrize("field", ["block_size", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks"])
def test_engine_config_is_validated(field):
    with pytest.raises(EngineConfigError, match=field):
        EngineConfig(**{field: 0}).validate()


def test_cli_jsonl_stop_string_is_one_stop():
    args = Namespace(
        max_tokens=4,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=None,
        stop=[],
        stop_token_ids="",
        ignore_eos=False,
    )
    assert sampling_params_from(args, {"stop": "END"}).stop == ("END",)
    assert sampling_params_from(args, {"stop": ["a", "b"]}).stop == ("a", "b")


def test_generation_config_eos_ids(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert generation_eos_ids(tmp_path) == (7, 9)
    assert generation_eos_ids(tmp_path / "missing") == ()
