"""The router's admission: cheap limits checked before any work (router.limits), the --max-inflight slot
taken before tokenizing, tokenizing off the event loop, status codes of duplicates, the default
deadline, and a model name that never shows a filesystem path. A real Router on the tiny model, whose
directory is filled by hand (no Redis is contacted: nothing here reaches a worker)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import replace

import grpc
import pytest

from kvferry.engine.request import InvalidRequestError
from kvferry.router.directory import Member
from kvferry.router.inflight import RequestRejected
from kvferry.router.limits import MAX_STOP_STRINGS, check_limits
from kvferry.router.server import Router, RouterConfig, public_model_name
from kvferry.v1 import generate_pb2, worker_pb2

MAX_LEN = 128


def request(text=None, ids=None, request_id="", **sampling) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(
        request_id=request_id, sampling=generate_pb2.SamplingParams(**sampling)
    )
    if ids is not None:
        req.token_ids.ids.extend(ids)
    else:
        req.text = text
    return req


@pytest.mark.parametrize(
    ("req", "words"),
    [
        (request("x", request_id="r" * 257), "request_id: at most 256 characters"),
        (request("x" * (MAX_LEN * 64 + 1)), "prompt.text: at most"),
        (request(ids=[1] * MAX_LEN), "prompt.token_ids: at most 127 tokens"),
        (request("x", stop=["s"] * (MAX_STOP_STRINGS + 1)), "sampling.stop: at most 16 stop strings"),
        (request("x", stop=["ok", "s" * 257]), "sampling.stop[1]: at most 256 characters"),
        (request("x", stop_token_ids=list(range(129))), "sampling.stop_token_ids: at most 128 ids"),
    ],
)
def test_limits_name_the_field(req, words):
    with pytest.raises(InvalidRequestError, match=re.escape(words)):
        check_limits(req, MAX_LEN)


def test_requests_within_the_limits_pass():
    check_limits(request("x" * MAX_LEN * 64, request_id="r" * 256, stop=["s" * 256] * 16), MAX_LEN)
    check_limits(request(ids=[1] * (MAX_LEN - 1), stop_token_ids=list(range(128))), MAX_LEN)


def test_model_name_is_never_a_path():
    assert public_model_name("/home/me/.cache/kvferry/models/tiny") == "tiny"
    assert public_model_name("/models/qwen3-0.6b/") == "qwen3-0.6b"
    assert public_model_name("./ckpt/llama") == "llama"
    assert public_model_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a hub name is no path
    assert public_model_name("tiny") == "tiny"


@pytest.fixture
def router(tiny_model_dir):
    r = Router(
        RouterConfig(
            model=str(tiny_model_dir), redis_url="redis://127.0.0.1:1/0", max_inflight=1, request_timeout_s=42
        )
    )
    r.directory.model = worker_pb2.WorkerInfo(
        model="tiny", vocab_size=8192, max_model_len=MAX_LEN, block_size=16, eos_token_ids=[2]
    )
    for role in ("prefill", "decode"):
        r.directory.members[role]["w"] = Member(role, "w", "addr", None, None)
    r.directory.pool_nodes["p"] = object()
    assert r.directory.ready
    return r


def test_model_info_and_metrics_name_the_model_not_its_path(router, tiny_model_dir):
    assert router.served_model_name == tiny_model_dir.name
    assert "/" not in router.served_model_name


def test_over_limit_requests_are_refused_before_tokenizing(router, monkeypatch):
    calls = []
    monkeypatch.setattr(router.tokenizer, "encode", lambda text: calls.append(text) or [5])
    with pytest.raises(InvalidRequestError, match=r"prompt\.text: at most"):
        asyncio.run(router.admit(request("x" * (MAX_LEN * 64 + 1)), None, "grpc"))
    with pytest.raises(InvalidRequestError, match=r"sampling\.stop"):
        asyncio.run(router.admit(request("hi", stop=["s"] * 17), None, "grpc"))
    assert calls == [] and router.admission.inflight == {}


def test_slot_is_taken_before_tokenizing_and_the_loop_keeps_running(router, monkeypatch):
    release = threading.Event()
    entered = threading.Event()

    def slow_encode(text):
        entered.set()
        release.wait(10)
        return [5, 6, 7]

    monkeypatch.setattr(router.tokenizer, "encode", slow_encode)

    async def scenario():
        first = asyncio.create_task(router.admit(request("a long prompt", request_id="a"), None, "grpc"))
        await asyncio.to_thread(entered.wait, 10)
        ticks = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.2:  # the loop is free while the prompt is being tokenized
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks >= 5
        with pytest.raises(RequestRejected) as full:  # --max-inflight 1: the tokenizing one holds it
            await router.admit(request("b", request_id="b"), None, "grpc")
        assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        return await first

    handle = asyncio.run(scenario())
    assert handle.ids == [5, 6, 7] and handle.request_id == "a"
    assert 41 < handle.remaining() <= 42  # no client deadline: --request-timeout-s
    with pytest.raises(RequestRejected) as dup:
        asyncio.run(router.admit(request(ids=[1, 2], request_id="a"), 5.0, "grpc"))
    # the full router refuses first; with room, the duplicate id is ALREADY_EXISTS
    assert dup.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    router.admission.cfg = replace(router.cfg, max_inflight=4)
    with pytest.raises(RequestRejected) as dup:
        asyncio.run(router.admit(request(ids=[1, 2], request_id="a"), 5.0, "grpc"))
    assert dup.value.code == grpc.StatusCode.ALREADY_EXISTS
    router.withdraw(handle)
    assert router.admission.inflight == {}


def test_a_failed_tokenization_frees_its_slot(router, monkeypatch):
    monkeypatch.setattr(router.tokenizer, "encode", lambda text: [])
    with pytest.raises(InvalidRequestError, match="encodes to no tokens"):
        asyncio.run(router.admit(request("x"), None, "grpc"))
    assert router.admission.inflight == {}
