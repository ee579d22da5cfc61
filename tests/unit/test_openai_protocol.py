"""OpenAI request shapes -> gRPC requests, the fields kvferry refuses, response and chunk shapes,
chat templates, and the router's Prometheus metrics (no processes)."""

from __future__ import annotations

import json

import pydantic
import pytest

from kvferry.engine.request import InvalidRequestError
from kvferry.model.chat_template import CHATML, ChatTemplate, ChatTemplateError
from kvferry.router.directory import Directory, Member, PoolMember
from kvferry.router.metrics import RouterMetrics
from kvferry.router.openai_protocol import ChatCompletionRequest, CompletionRequest, ResponseShape
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
    assert default.max_tokens == 16 and not default.HasField("temperature") and not default.HasField("seed")


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", 1), ("echo", True), ("best_of", 2), ("presence_penalty", 0.5), ("logit_bias", {"1": 2})],
)
def test_unimplemented_fields_are_refused_by_name_unless_neutral(field, value):
    with pytest.raises(InvalidRequestError, match=f"^{field}="):
        CompletionRequest(prompt="x", **{field: value}).generate_requests("r")
    neutral = {"logprobs": None, "echo": False, "best_of": 1, "presence_penalty": 0.0, "logit_bias": None}
    CompletionRequest(prompt="x", **{field: neutral[field]}).generate_requests("r")  # what clients send


def test_shape_errors_name_the_field():
    with pytest.raises(pydantic.ValidationError, match="max_tokens"):
        CompletionRequest(prompt="x", max_tokens=2**40)
    with pytest.raises(pydantic.ValidationError, match="seed"):
        CompletionRequest(prompt="x", seed=-1)
    with pytest.raises(InvalidRequestError, match=r"^n must be 1"):
        CompletionRequest(prompt="x", n=3).generate_requests("r")
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


def test_chunks_usage_and_whole_responses_have_openai_shapes():
    shape = ResponseShape(chat=True, response_id="chatcmpl-1", model="m", return_token_ids=True)
    first = shape.chunk(0, "hi", [7], first=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "hi",
    }
    last = shape.chunk(0, "", [8], finished(), first=False)
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
    whole = text.whole(["abc"], [[1, 2, 3]], [finished(reason="stop")])
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "abc"
    assert whole["choices"][0]["finish_reason"] == "stop" and "token_ids" not in whole["choices"][0]
    json.dumps(whole)  # serialisable as is


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
