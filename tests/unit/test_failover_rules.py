"""The router's failover rules (router.failover): which worker failures are retried, the code a client
sees, the choice of another worker, and the DecodeRequest that resumes a broken stream, checked by
running the resumed request in a real engine against an uninterrupted one."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
import torch

from kvferry.engine.engine import LLMEngine
from kvferry.engine.request import SamplingParams
from kvferry.router.directory import Directory, Member
from kvferry.router.failover import pick_excluding, relay_code, resume_request, retryable
from kvferry.v1 import generate_pb2, pool_pb2, worker_pb2

Code = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(
    ("code", "details", "prefill", "decode", "relayed"),
    [
        (Code.UNAVAILABLE, "Connection reset by peer", True, True, Code.UNAVAILABLE),
        (Code.RESOURCE_EXHAUSTED, "queue full", True, True, Code.RESOURCE_EXHAUSTED),
        (Code.CANCELLED, "Cancelled", True, True, Code.UNAVAILABLE),
        (Code.INTERNAL, "Received RST_STREAM with error code 2", True, True, Code.UNAVAILABLE),
        (Code.INTERNAL, "decode of r failed: engine step failed", False, False, Code.INTERNAL),
        (
            Code.INVALID_ARGUMENT,
            "prompt_token_ids must lie in [0, 8192)",
            False,
            False,
            Code.INVALID_ARGUMENT,
        ),
        (Code.DEADLINE_EXCEEDED, "Deadline Exceeded", False, False, Code.DEADLINE_EXCEEDED),
        (Code.UNAUTHENTICATED, "missing or invalid cluster secret", False, False, Code.INTERNAL),
    ],
)
def test_what_is_retried_and_what_the_client_sees(code, details, prefill, decode, relayed):
    err = rpc_error(code, details)
    assert retryable("prefill", err) is prefill
    assert retryable("decode", err) is decode
    assert relay_code(err) == relayed


def add(directory: Directory, member_id: str, group: str = "", inflight: int = 0) -> Member:
    member = Member("decode", member_id, "addr", None, None, group=group or member_id, free_blocks=100)
    member.inflight = inflight
    directory.members["decode"][member_id] = member
    return member


def test_pick_never_returns_a_tried_worker_or_group():
    d = Directory(meta=None)
    add(d, "a", inflight=0)
    add(d, "b", inflight=5)
    add(d, "ep.r0", "ep", inflight=9)
    assert pick_excluding(d, "decode", set()).member_id == "a"  # least loaded
    assert pick_excluding(d, "decode", {"a"}).member_id == "b"
    assert pick_excluding(d, "decode", {"a", "b"}).member_id == "ep.r0"
    assert pick_excluding(d, "decode", {"a", "b", "ep"}) is None  # a tried group excludes its ranks
    picked = pick_excluding(d, "decode", {"a"}, blocks=10)
    assert picked.member_id == "b" and picked.free_blocks == 90
    assert d.members["decode"]["a"].free_blocks == 100  # the excluded pick's blocks are given back


def first_dispatch(prompt, first_token, max_tokens, prefill_here=False) -> worker_pb2.DecodeRequest:
    blocks = [pool_pb2.BlockLocation(key=bytes([i]) * 8) for i in range(2)]
    return worker_pb2.DecodeRequest(
        request_id="r",
        prompt_token_ids=prompt,
        first_token_id=first_token,
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        blocks=[] if prefill_here else blocks,
        num_kv_tokens=0 if prefill_here else len(prompt),
        prefill_here=prefill_here,
    )


def test_resumed_request_fields():
    first = first_dispatch([1, 2, 3], first_token=7, max_tokens=10)
    resumed = resume_request(first, [1, 2, 3], [7, 8, 9], 10)
    assert list(resumed.prompt_token_ids) == [1, 2, 3, 7, 8]
    assert resumed.first_token_id == 9
    assert resumed.sampling.max_tokens == 8  # 10 in all, 2 already made before the first token here
    assert resumed.blocks == first.blocks and resumed.num_kv_tokens == 3  # the pool still covers the prompt
    assert list(first.prompt_token_ids) == [1, 2, 3]  # the first dispatch is left as it was

    colocated = resume_request(first_dispatch([1, 2, 3], 0, 10, prefill_here=True), [1, 2, 3], [7, 8, 9], 10)
    assert list(colocated.prompt_token_ids) == [1, 2, 3, 7, 8, 9] and colocated.prefill_here
    assert colocated.sampling.max_tokens == 7


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def run(engine: LLMEngine, request_id: str) -> list[int]:
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("cut", [1, 5, 17])  # tokens streamed before the worker died
def test_resumed_greedy_decode_equals_an_uninterrupted_one(engine, cut):
    prompt = torch.randint(3, 8192, (21,), generator=torch.Generator().manual_seed(cut)).tolist()
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    whole = [t for out in engine.stream(params=params, prompt_token_ids=prompt) for t in out.new_token_ids]
    assert len(whole) == 30
    produced = whole[:cut]  # the first token (from the prefill) and what the dead worker streamed
    first = first_dispatch(prompt, whole[0], 30)
    resumed = resume_request(first, prompt, produced, 30)
    # as the decode worker admits it when the pool covers nothing: the whole prompt is recomputed
    resumed_params = replace(params, max_tokens=resumed.sampling.max_tokens)
    req = engine.make_request(None, resumed_params, list(resumed.prompt_token_ids), f"resumed-{cut}")
    engine.kv.await_kv(req)
    engine.kv.kv_arrived(req, resumed.first_token_id, [], 0)
    rest = run(engine, req.request_id)
    assert produced + rest == whole
