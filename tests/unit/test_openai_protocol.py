"""OpenAI request shapes -> gRPC requests, the fields kvferry refuses, response and chunk shapes,
chat templates, and the router's Prometheus metrics (no processes)."""

from __future__ import annotations

import json

import pydantic
import pytest

from kvferry.engine.request import InvalidRequestError
from kvferry.model.chat_template import CHATML, ChatTemplate, ChatTemplateError
from kvferry.model.tokenizer import Tokenizer
from kvferry.router.directory import Directory, Member, PoolMember
from kvferry.router.metrics import RouterMetrics
from kvferry.router.openai_protocol import (
    ChatCompletionRequest,
    ChoiceState,
    CompletionRequest,
    Echo,
    ResponseShape,
)
from kvferry.v1 import generate_pb2


def test_text_ids_and_lists_of_them_become_one_request_per_prompt():
    text = CompletionRequest(prompt="import os").generate_requests("r")
    assert [r.text for r in text] == ["import os"] and text[0].request_id == "r-0"
    ids = CompletionRequest(prompt=[5, 6, 7]).generate_requests("r")
    assert len(ids) == 1 and list(ids[0].token_ids.ids) == [5, 6, 7]
    many = CompletionRequest(prompt=[[1, 2], [3]]).generate_requests("r")
    assert [list(r.token_ids.ids) for r in many] == [[1, 2], [3]] and many[1].request_id == "r-1"
    assert [r.text for r in CompletionRequest(prompt=["a", "b"]).generate_requests("r")] == ["a", "b"]
    with pytest.raises(InvalidRequestError, match="prompt must not be empty"):
        CompletionRequest(prompt=[]).generate_requests("r")


def test_sampling_fields_map_to_the_grpc_names_with_openai_defaults():
    req = CompletionRequest(
        prompt="x", max_tokens=7, temperature=0.5, top_p=0.9, top_k=-1, seed=3, stop="\n", ignore_eos=True
    )
    p = req.generate_requests("r")[0].sampling
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.5, pytest.approx(0.9), 0, 3)
    assert list(p.stop) == ["\n"] and p.ignore_eos
    default = CompletionRequest(prompt="x").generate_requests("r")[0].sampling
    assert (
        not default.HasField("max_tokens")
        and not default.HasField("temperature")
        and not default.HasField("seed")
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("prompt_embeds", "x"), ("suffix", "x"), ("bad_words", ["x"]), ("guided_decoding_backend", "xgrammar")],
)
def test_unimplemented_fields_are_refused_by_name_unless_neutral(field, value):
    with pytest.raises(InvalidRequestError, match=f"^{field}="):
        CompletionRequest(prompt="x", **{field: value}).generate_requests("r")
    neutral = {"prompt_embeds": None, "suffix": None, "bad_words": [], "guided_decoding_backend": "auto"}
    CompletionRequest(prompt="x", **{field: neutral[field]}).generate_requests("r")  # what clients send


def test_sampling_controls_and_logprobs_map_to_the_grpc_fields():
    body = CompletionRequest(
        prompt="x",
        logprobs=2,
        echo=True,
        max_tokens=0,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_p=0.1,
        min_tokens=0,
        logit_bias={"5": -100, "7": 2.5},
        allowed_token_ids=[5, 6, 7],
        include_stop_str_in_output=True,
    )
    (req,) = body.generate_requests("r")
    p = req.sampling
    assert p.max_tokens == 1 and p.logprobs == 2 and p.prompt_logprobs == 2  # echo: the prompt's too
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5) and p.repetition_penalty == pytest.approx(
        1.2
    )
    assert dict(p.logit_bias) == {5: -100.0, 7: 2.5} and list(p.allowed_token_ids) == [5, 6, 7]
    assert p.include_stop_str_in_output and p.min_p == pytest.approx(0.1)
    with pytest.raises(InvalidRequestError, match="logit_bias keys must be token ids"):
        CompletionRequest(prompt="x", logit_bias={"a": 1}).generate_requests("r")
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3)
    assert chat.sampling(4).logprobs == 3
    with pytest.raises(InvalidRequestError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=3).sampling(4)
    with pytest.raises(InvalidRequestError, match=r"^chat_template_kwargs.messages"):
        ChatCompletionRequest(
            messages=[{"role": "user", "content": "x"}], chat_template_kwargs={"messages": []}
        ).template_kwargs()


def test_shape_errors_name_the_field():
    with pytest.raises(pydantic.ValidationError, match="max_tokens"):
        CompletionRequest(prompt="x", max_tokens=2**40)
    with pytest.raises(pydantic.ValidationError, match="seed"):
        CompletionRequest(prompt="x", seed=-1)
    with pytest.raises(InvalidRequestError, match=r"^n must be in \[1, 64\]"):
        CompletionRequest(prompt="x", n=65).generate_requests("r")
    with pytest.raises(InvalidRequestError, match="stream_options"):
        CompletionRequest(prompt="x", stream_options={"include_usage": True}).generate_requests("r")


def test_chat_messages_join_text_parts_and_refuse_others():
    req = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        max_completion_tokens=4,
        max_tokens=9,
    )
    assert req.template_messages() == [{"role": "user", "content": "ab"}] and req.max_new_tokens == 4
    bad = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].content: only text parts"):
        bad.template_messages()


def finished(reason="length", prompt=5, output=3, cached=2, pool=1) -> generate_pb2.Finished:
    return generate_pb2.Finished(
        finish_reason=reason,
        prompt_tokens=prompt,
        output_tokens=output,
        cached_tokens=cached,
        pool_cached_tokens=pool,
        timings=generate_pb2.Timings(
            queue_ms=1, prefill_ms=2, kv_transfer_ms=3, first_decode_ms=4, ttft_ms=9
        ),
    )


def message(text: str, ids: list[int], done=None, logprobs=(), prompt_logprobs=()):
    msg = generate_pb2.GenerateResponse(
        text=text, token_ids=ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )
    if done is not None:
        msg.finished.CopyFrom(done)
    return msg


def test_chunks_usage_and_whole_responses_have_openai_shapes():
    shape = ResponseShape(chat=True, response_id="chatcmpl-1", model="m", return_token_ids=True)
    state = ChoiceState()
    first = shape.chunk(0, state, message("hi", [7]))
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "hi",
    }
    last = shape.chunk(0, state, message("", [8], finished()))
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["token_ids"] == [8]
    assert last["timings"]["prefill_ms"] == 2 and last["timings"]["pool_cached_tokens"] == 1
    usage = shape.usage_chunk([finished(), finished(prompt=4, output=1, cached=0, pool=0)])
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    text = ResponseShape(chat=False, response_id="cmpl-1", model="m", return_token_ids=False)
    whole_state = ChoiceState()
    text.add(0, whole_state, message("abc", [1, 2, 3], finished(reason="stop")))
    whole = text.whole([whole_state])
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "abc"
    assert whole["choices"][0]["finish_reason"] == "stop" and "token_ids" not in whole["choices"][0]
    json.dumps(whole)  # serialisable as is


def lp(token: int, value: float, top=()) -> generate_pb2.TokenLogprob:
    ids, values = zip(*top, strict=True) if top else ((), ())
    return generate_pb2.TokenLogprob(token_id=token, logprob=value, rank=1, top_ids=ids, top_logprobs=values)


def test_logprobs_and_echo_in_the_completions_and_chat_shapes(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode("hello there world")
    shape = ResponseShape(
        False, "cmpl-1", "m", False, tok, logprobs=1, prompts=[Echo("hello there world", ids)], echo=True
    )
    state = ChoiceState()
    prompt_lps = [lp(t, -1.0 - i, [(t, -1.0 - i)]) for i, t in enumerate(ids[1:])]
    shape.add(0, state, message(" x", [42], None, [lp(42, -0.5, [(9, -0.25)])], prompt_lps))
    shape.add(0, state, message("", [43], finished(reason="stop"), [lp(43, float("-inf"))]))
    choice = shape.whole([state])["choices"][0]
    got = choice["logprobs"]
    assert choice["text"] == "hello there world x"
    n = len(ids)
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["token_logprobs"][1:n] == [pytest.approx(-1.0 - i) for i in range(n - 1)]
    assert got["token_logprobs"][n:] == [-0.5, -9999.0]  # -inf is not JSON: vLLM's floor
    assert got["top_logprobs"][n] == {
        tok.decode([42], skip_special_tokens=False): -0.5,
        tok.decode([9], skip_special_tokens=False): -0.25,
    }
    assert got["text_offset"] == sorted(got["text_offset"]) and len(got["tokens"]) == n + 2
    dropped = ResponseShape(
        False, "c", "m", False, tok, logprobs=0, prompts=[Echo("a", [5])], echo=True, drop_output=True
    )
    state = ChoiceState()
    dropped.add(0, state, message("zz", [9], finished(), [lp(9, -1.0)]))
    whole = dropped.whole([state])
    assert whole["choices"][0]["text"] == "a" and whole["choices"][0]["logprobs"]["tokens"] == [
        tok.decode([5], skip_special_tokens=False)
    ]
    assert whole["usage"]["completion_tokens"] == 0
    chat = ResponseShape(True, "c", "m", False, tok, logprobs=1)
    state = ChoiceState()
    chunk = chat.chunk(0, state, message("x", [42], None, [lp(42, -0.5, [(9, -0.25), (42, -0.5)])]))
    (entry,) = chunk["choices"][0]["logprobs"]["content"]
    assert entry["logprob"] == -0.5 and entry["bytes"] == list(entry["token"].encode())
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.25]  # top_logprobs=1


def test_chatml_template_of_the_builtin_models(tiny_model_dir):
    template = ChatTemplate.from_dir(tiny_model_dir)
    text = template.render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert not template.render([{"role": "user", "content": "hi"}], add_generation_prompt=False).endswith(
        "assistant\n"
    )


def test_templates_from_files_lists_and_their_errors(tmp_path):
    assert ChatTemplate.from_dir(tmp_path) is None  # no template: the API answers 400
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "x"},
                    {"name": "default", "template": CHATML},
                ]
            }
        )
    )
    assert (
        ChatTemplate.from_dir(tmp_path)
        .render([{"role": "user", "content": "a"}])
        .startswith("<|im_start|>user")
    )
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        ChatTemplate.from_dir(tmp_path).render([{"role": "system", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_metrics_of_a_request_and_of_the_cluster():
    directory = Directory(meta=None)
    directory.members["decode"]["d.r0"] = Member(
        "decode",
        "d.r0",
        "a",
        None,
        None,
        beat={"running": 3, "waiting": 1, "free_blocks": 25, "total_blocks": 100},
    )
    directory.pool_nodes["pool-0"] = PoolMember("a", 0.0, {"num_slots": 10, "free_slots": 4})
    metrics = RouterMetrics("m", directory)
    track = metrics.track("http", t0=0.0)
    track.message(generate_pb2.GenerateResponse(token_ids=[1]))
    track.message(generate_pb2.GenerateResponse(token_ids=[2]))
    track.message(generate_pb2.GenerateResponse(token_ids=[3], finished=finished(cached=32, pool=16)))
    track.done("CANCELLED")  # a finished request counts as OK whatever the stream's end
    metrics.rejected("grpc", "RESOURCE_EXHAUSTED")
    text = metrics.exposition().decode()
    want = [
        'kvferry:time_to_first_token_seconds_count{model_name="m"} 1.0',
        'kvferry:inter_token_latency_seconds_count{model_name="m"} 2.0',
        'kvferry:request_prefill_time_seconds_count{model_name="m"} 1.0',
        'kvferry:request_success_total{finished_reason="length",model_name="m"} 1.0',
        'kvferry:requests_total{api="http",code="OK",model_name="m"} 1.0',
        'kvferry:requests_total{api="grpc",code="RESOURCE_EXHAUSTED",model_name="m"} 1.0',
        'kvferry:prefix_cache_hits_total{model_name="m",source="local"} 16.0',
        'kvferry:prefix_cache_hits_total{model_name="m",source="pool"} 16.0',
        'kvferry:num_requests_running{model_name="m"} 3.0',
        'kvferry:kv_cache_usage_perc{model_name="m",role="decode",worker="d.r0"} 0.75',
        'kvferry:pool_slab_usage_perc{model_name="m",node="pool-0"} 0.6',
    ]
    for line in want:
        assert line in text, line
    assert "_created" not in text


def test_grafana_dashboard_reads_only_exported_series():
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parents[2] / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"kvferry:[a-z0-9_]+", e)}
    directory = Directory(meta=None)
    directory.members["decode"]["d"] = Member("decode", "d", "a", None, None, beat={"total_blocks": 4})
    directory.pool_nodes["p"] = PoolMember("a", 0.0, {"num_slots": 4})
    metrics = RouterMetrics("m", directory)
    track = metrics.track("grpc", t0=0.0)
    track.message(generate_pb2.GenerateResponse(token_ids=[1]))
    track.message(generate_pb2.GenerateResponse(token_ids=[2], finished=finished()))
    track.done("OK")
    exported = {line.split("{")[0] for line in metrics.exposition().decode().splitlines() if line[:1] != "#"}
    assert len(used) >= 15 and used <= exported, used - exported


def test_structured_output_fields_map_to_one_constraint():
    schema = {"type": "object"}

    def spec(**fields):
        return CompletionRequest(prompt="x", **fields).structured()

    assert spec() is None and spec(response_format={"type": "text"}) is None
    assert spec(response_format={"type": "json_object"}) == ("response_format", "json_object", "")
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    assert spec(response_format=rf) == (
        "response_format.json_schema.schema",
        "json_schema",
        json.dumps(schema),
    )
    assert spec(guided_json=schema)[1:] == ("json_schema", json.dumps(schema))
    assert spec(guided_choice=["a", "b"])[1:] == ("choice", '["a", "b"]')
    assert spec(structured_outputs={"regex": "a+"})[1:] == ("regex", "a+")
    assert spec(structured_outputs={"grammar": "root ::= x"})[1:] == ("grammar", "root ::= x")
    (req,) = CompletionRequest(prompt="x", guided_choice=["a"]).generate_requests("r")
    assert list(req.sampling.structured.choice.choices) == ["a"]
    for bad, words in [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured output per request"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"xml": "x"}}, "structured_outputs.xml is not supported"),
        ({"guided_choice": []}, "non-empty list"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ]:
        with pytest.raises(InvalidRequestError, match=words):
            CompletionRequest(prompt="x", **bad).generate_requests("r")


def test_tool_choice_becomes_a_schema_and_auto_is_refused():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    msgs = [{"role": "user", "content": "x"}]
    named = ChatCompletionRequest(
        messages=msgs, tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}
    )
    assert named.tool_mode() == ("named", "f") and named.structured()[1] == "json_schema"
    required = ChatCompletionRequest(messages=msgs, tools=[tool], tool_choice="required")
    schema = json.loads(required.structured()[2])
    assert schema["type"] == "array" and schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "f"}
    assert ChatCompletionRequest(messages=msgs, tools=[tool], tool_choice="none").structured() is None
    for choice, words in [
        ("auto", "tool_choice=auto"),
        (None, "tool_choice=auto"),
        ({"type": "function", "function": {"name": "g"}}, "not one of the tools"),
    ]:
        with pytest.raises(InvalidRequestError, match=words):
            ChatCompletionRequest(messages=msgs, tools=[tool], tool_choice=choice).structured()
    shape = ResponseShape(True, "c", "m", False, tools=("required", None))
    state = ChoiceState()
    shape.add(0, state, message('[{"name": "f", "parameters": {"a": 1}}]', [1], finished(reason="stop")))
    choice = shape.whole([state])["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_best_of_keeps_each_prompts_most_likely_and_their_own_prompt(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    prompts = [tok.encode("first prompt"), tok.encode("second one here")]
    k, n = 3, 1
    shape = ResponseShape(
        False,
        "c",
        "m",
        True,
        tok,
        prompts=[Echo("", p) for p in prompts for _ in range(k)],
        prompt_logprobs=True,
        per_prompt=k,
        keep=n,
    )
    states = [ChoiceState() for _ in range(len(prompts) * k)]
    scores = [-3.0, -1.0, -2.0, -0.5, -4.0, -0.7]
    for i, (state, score) in enumerate(zip(states, scores, strict=True)):
        p = prompts[i // k]
        prompt_lps = [lp(t, -1.0) for t in p[1:]]
        shape.add(i, state, message(f"s{i}", [i], finished(), [lp(i, score)], prompt_lps))
    choices = shape.whole(states)["choices"]
    assert [c["text"] for c in choices] == ["s1", "s3"] and [c["index"] for c in choices] == [0, 1]
    for c, p in zip(choices, prompts, strict=True):  # each answer's prompt logprobs are its own prompt's
        assert [next(iter(e)) for e in c["prompt_logprobs"][1:]] == [str(t) for t in p[1:]]
