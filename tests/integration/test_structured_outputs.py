"""Structured outputs (llguidance) through a disaggregated cluster, driven by clients nobody here wrote:
the openai SDK's `chat.completions.parse` with a pydantic model, vLLM's structured-output fields, tool
calls forced by tool_choice, and the gRPC API. The constraint's state crosses the prefill -> decode
hand-off (the decode worker replays the first token), so every output that parses proves it. (conftest's
shared `cluster`, which serves the model under its directory's name.)"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import grpc
import openai
import pydantic
import pytest
from cluster_helpers import post

from kvferry.router.client import Client, build_request

pytestmark = [pytest.mark.slow, pytest.mark.shared_cluster()]


@pytest.fixture(scope="module")
def name(api) -> str:
    """The name the cluster serves the model under."""
    (model,) = api.models.list().data
    return model.id


@pytest.fixture(scope="module")
def api(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)
    pets: list[Annotated[str, pydantic.Field(max_length=8)]] = pydantic.Field(max_length=3)


def test_openai_sdk_parse_returns_the_pydantic_object(api, name):
    for seed in range(4):
        out = api.chat.completions.parse(
            model=name,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=Person,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        person = out.choices[0].message.parsed
        assert isinstance(person, Person), out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop"  # the grammar completed the output


def sample_many(api, name: str, n: int, **extra_body) -> list[str]:
    def one(seed: int) -> str:
        out = api.completions.create(
            model=name, prompt="Answer:", max_tokens=40, temperature=1.0, seed=seed, extra_body=extra_body
        )
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def test_a_regex_and_a_choice_hold_on_100_sampled_completions(api, name):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{3}"
    texts = sample_many(api, name, 100, structured_outputs={"regex": pattern})
    assert all(re.fullmatch(pattern, t) for t in texts), [t for t in texts if not re.fullmatch(pattern, t)]
    assert len(set(texts)) > 50  # sampled, not one answer
    choices = ["positive", "negative", "neutral"]
    picked = sample_many(api, name, 100, guided_choice=choices)
    assert set(picked) <= set(choices) and len(set(picked)) >= 2


def test_every_spelling_of_a_constraint(api, name, cluster):
    def text(**extra) -> str:
        out = api.completions.create(
            model=name, prompt="x", max_tokens=60, temperature=0.7, seed=1, extra_body=extra
        )
        return out.choices[0].text

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    assert json.loads(text(guided_json=schema)).keys() == {"ok"}
    assert json.loads(text(structured_outputs={"json": json.dumps(schema)})).keys() == {"ok"}
    assert isinstance(json.loads(text(response_format={"type": "json_object"})), dict)
    assert text(structured_outputs={"grammar": 'start: "yes" | "no"'}) in ("yes", "no")
    assert re.fullmatch("ab+", text(guided_grammar='root ::= "a" "b"+'))  # GBNF
    # one constraint per request; a schema the library refuses is a 400 naming the field
    code, reply = post(
        cluster.http_url + "/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}
    )
    assert code == 400 and "one structured output per request" in reply["error"]["message"]
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}},
    }
    code, reply = post(
        cluster.http_url + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": bad},
    )
    assert code == 400 and reply["error"]["param"] == "response_format.json_schema.schema", reply
    assert "bogus" in reply["error"]["message"]
    code, reply = post(cluster.http_url + "/v1/completions", {"prompt": "x", "guided_regex": "[unclosed"})
    assert code == 400 and reply["error"]["param"] == "guided_regex"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def test_tool_choice_named_and_required(api, name):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    out = api.chat.completions.create(
        model=name,
        messages=messages,
        tools=[WEATHER, TIME],
        max_tokens=60,
        temperature=0.8,
        seed=2,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {
        "city",
        "days",
    }
    streamed = api.chat.completions.create(
        model=name,
        messages=messages,
        tools=[WEATHER, TIME],
        max_tokens=60,
        temperature=0.8,
        seed=2,
        stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    pieces = [
        d.function.arguments
        for c in streamed
        if c.choices and c.choices[0].delta.tool_calls
        for d in c.choices[0].delta.tool_calls
    ]
    assert "".join(pieces) == call.function.arguments
    # required: a list of calls to any of the tools (as many as the model makes; cut short by
    # max_tokens, the text comes back as content)
    finished = 0
    for seed in range(6):
        out = api.chat.completions.create(
            model=name,
            messages=messages,
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=400,
            temperature=0.8,
            seed=seed,
        )
        choice = out.choices[0]
        if choice.finish_reason == "length":
            assert choice.message.tool_calls is None and choice.message.content.startswith('[{"name": ')
            continue
        finished += 1
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")
            assert isinstance(json.loads(call.function.arguments), dict)
    assert finished >= 1
    with pytest.raises(openai.BadRequestError, match="tool_choice=auto"):
        api.chat.completions.create(model=name, messages=messages, tools=[WEATHER], max_tokens=5)


def test_grpc_structured_output_and_its_refusal(cluster):
    with Client(cluster.router_addr) as client:
        request = build_request(prompt="x", max_tokens=50, temperature=1.0, seed=5)
        request.sampling.structured.choice.choices.extend(["alpha", "beta"])
        assert client.generate(request, timeout=60).text in ("alpha", "beta")
        request = build_request(prompt="x", max_tokens=50, temperature=1.0, seed=5)
        request.sampling.structured.json_schema = '{"type": "nonsense"}'
        with pytest.raises(grpc.RpcError) as err:
            client.generate(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.structured.json_schema" in err.value.details()


HEAVY = "(a{1000}){1000}"  # its lexer explodes at the first masks: over budget at compile time
FAILS_LATER = "(b|c)(a{1000}){1000}"  # compiles in budget; its lexer passes the budget a few tokens in


def test_a_grammar_over_budget_is_a_400_before_any_work_and_one_that_fails_later_an_error(cluster, name, api):
    """A constraint can cost no one else: one over llguidance's budget is refused (400 naming the limit)
    before any prefill, quickly; one that passes it mid-generation ends in an error the client sees, on
    every API, never in a success with text the constraint does not match. Plain requests go on."""
    url = cluster.http_url + "/v1/completions"
    body = {"model": name, "prompt": "x", "max_tokens": 30, "temperature": 0}
    t0 = time.monotonic()
    code, reply = post(url, body | {"structured_outputs": {"regex": HEAVY}})
    assert code == 400 and "over the grammar budget" in reply["error"]["message"], reply
    assert time.monotonic() - t0 < 5
    code, reply = post(url, body | {"structured_outputs": {"regex": FAILS_LATER}, "ignore_eos": True})
    assert code == 500 and "structured output failed at output token" in reply["error"]["message"], reply
    stream = api.completions.create(
        model=name,
        prompt="y",
        max_tokens=30,
        temperature=0,
        stream=True,
        extra_body={"structured_outputs": {"regex": FAILS_LATER}, "ignore_eos": True},
    )
    with pytest.raises(openai.APIError, match="structured output failed"):
        for _ in stream:
            pass
    with Client(cluster.router_addr) as client:
        request = build_request(prompt="z", max_tokens=30, temperature=0.0, ignore_eos=True)
        request.sampling.structured.regex = FAILS_LATER
        with pytest.raises(grpc.RpcError) as err:
            client.generate(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "structured output failed at output token" in err.value.details()
        request.sampling.structured.regex = HEAVY
        with pytest.raises(grpc.RpcError) as err:
            client.generate(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "over the grammar budget" in err.value.details()
        plain = client.generate(build_request(prompt="x", max_tokens=5, temperature=0.0), timeout=60)
        assert plain.finished.output_tokens >= 1
