"""A decode worker's faults under real gRPC: abort bookkeeping that outlives its request, and how many
streams one worker holds at once while its unary calls (GetStats, Abort) still answer at once."""

from __future__ import annotations

import asyncio
import statistics
import time

import grpc
import pytest
import torch
from cluster_helpers import ENGINE, wait_for

from kvferry.deploy.config import WorkerGroupSettings
from kvferry.kvpool.metadata import MetadataStore
from kvferry.rpc import aio_channel, channel
from kvferry.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

STREAMS = 300
STREAM_TOKENS = 200
# one decode worker that batches every stream at once: 300 x (8 + 200 tokens) needs 13 blocks each
DECODE_ENGINE = {**ENGINE, "max_num_seqs": 320, "num_kv_blocks": 4400}

# a shared cluster of conftest's (this module is its only user), its decode worker called directly
pytestmark = [
    pytest.mark.slow,
    pytest.mark.shared_cluster(decode=WorkerGroupSettings(replicas=1, engine=DECODE_ENGINE)),
]


@pytest.fixture(scope="module")
def decode_addr(cluster):
    meta = MetadataStore(cluster.redis_url, cluster.cfg.namespace)
    members = wait_for(lambda: meta.members("decode"), what="decode registry")
    (info,) = members.values()
    return info["addr"]


@pytest.fixture(scope="module")
def decode(decode_addr):
    with channel(decode_addr) as ch:
        yield worker_pb2_grpc.DecodeWorkerStub(ch)


def colocated(request_id: str, max_tokens: int, seed: int = 0, n: int = 8) -> worker_pb2.DecodeRequest:
    """A Decode call that computes its own prompt (no prefill worker, no pool): greedy, no EOS."""
    ids = torch.randint(3, 8192, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    sampling = generate_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=ids, sampling=sampling, prefill_here=True
    )


def run(stream) -> tuple[int, str]:
    tokens, reason = 0, ""
    for msg in stream:
        tokens += len(msg.token_ids)
        reason = msg.finish_reason or reason
    return tokens, reason


def held(decode) -> list[str]:
    return list(decode.GetStats(worker_pb2.WorkerStatsRequest(), timeout=10).active_request_ids)


def test_a_finished_request_id_can_be_used_again_at_once(decode):
    for _ in range(4):  # each call ends normally: none may leave an abort behind for the next
        assert run(decode.Decode(colocated("reused", 4), timeout=60)) == (4, "length")


def test_a_cancelled_stream_is_aborted_and_its_id_is_free_again(decode):
    stream = decode.Decode(colocated("cancelled", 900), timeout=120)
    assert next(stream).token_ids
    stream.cancel()
    wait_for(lambda: "cancelled" not in held(decode), 30, "the cancelled stream's request to go")
    assert run(decode.Decode(colocated("cancelled", 4), timeout=60)) == (4, "length")


def test_an_abort_that_comes_before_its_decode_call_aborts_it(decode):
    reply = decode.Abort(worker_pb2.WorkerAbortRequest(request_id="early"), timeout=10)
    assert not reply.found
    assert run(decode.Decode(colocated("early", 4), timeout=60)) == (0, "abort")
    # used up: the id is served normally afterwards
    assert run(decode.Decode(colocated("early", 4), timeout=60)) == (4, "length")


def test_an_abort_after_its_request_finished_leaves_nothing_behind(decode):
    assert run(decode.Decode(colocated("late-abort", 4), timeout=60)) == (4, "length")
    reply = decode.Abort(worker_pb2.WorkerAbortRequest(request_id="late-abort"), timeout=10)
    assert not reply.found
    assert run(decode.Decode(colocated("late-abort", 4), timeout=60)) == (4, "length")


async def _many_streams(addr: str) -> dict:
    async with aio_channel(addr) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        second_token: list[float] = []
        results: list[tuple[int, str]] = []

        async def one(i: int) -> None:
            started, tokens, reason = time.perf_counter(), 0, ""
            async for msg in stub.Decode(colocated(f"many-{i}", STREAM_TOKENS, seed=i), timeout=300):
                before, tokens = tokens, tokens + len(msg.token_ids)
                if before < 2 <= tokens:
                    second_token.append(time.perf_counter() - started)
                reason = msg.finish_reason or reason
            results.append((tokens, reason))

        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        # once every stream is open and streaming, the unary calls must not queue behind them
        while len(second_token) < STREAMS and not any(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        unary_s, held_then = [], 0
        for i in range(5):
            t = time.perf_counter()
            stats = await stub.GetStats(worker_pb2.WorkerStatsRequest(), timeout=10)
            await stub.Abort(worker_pb2.WorkerAbortRequest(request_id=f"not-here-{i}"), timeout=10)
            unary_s.append(time.perf_counter() - t)
            held_then = max(held_then, len(stats.active_request_ids))
        await asyncio.gather(*tasks)
        return {"results": results, "second_token": second_token, "unary_s": unary_s, "held": held_then}


@pytest.mark.timeout(600)  # its streams have 300 s each: they give the telling failure first
def test_one_decode_worker_serves_300_streams_and_still_answers_unary_calls(decode_addr):
    out = asyncio.run(_many_streams(decode_addr))
    assert len(out["results"]) == STREAMS
    assert all(r == (STREAM_TOKENS, "length") for r in out["results"]), set(out["results"])
    assert out["held"] > STREAMS // 2  # measured while the streams ran
    assert max(out["unary_s"]) < 1.0, out["unary_s"]
    q = statistics.quantiles(out["second_token"], n=10)
    print(f"\n{STREAMS} streams: second token p50 {q[4]:.2f}s p90 {q[8]:.2f}s; unary {out['unary_s']}")


def test_an_invalid_decode_request_is_invalid_argument(decode):
    with pytest.raises(grpc.RpcError) as err:
        run(decode.Decode(worker_pb2.DecodeRequest(request_id="bad", prefill_here=True), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
