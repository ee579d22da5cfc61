"""A full prefix hit (every full block of the prompt cached, locally or in the pool) computes only the
last prompt token, writes its K/V to the model runner's sink block, and leaves the shared blocks' bytes
alone: on the engine (both kernel paths) and through the prefill worker's stages (lookup -> pull ->
prefill -> KV write), against the `transformers` reference. The pool is an in-process fake here."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

from kvferry.engine.engine import LLMEngine
from kvferry.engine.request import SamplingParams
from kvferry.kvpool.metadata import Location
from kvferry.kvpool.transfer import pack_blocks, unpack_blocks
from kvferry.prefill_worker.handoff import PrefillJob
from kvferry.prefill_worker.worker import PrefillWorker
from kvferry.v1 import generate_pb2, worker_pb2

BS = 16
LAYERS = 2  # the tiny model's
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
LENGTHS = (64, 49, 53)  # a multiple of the block size; a 1-token tail; a 5-token tail


def tail_tokens(n: int) -> int:
    """Prompt tokens an identical repeat computes: its partial tail, or the last token alone."""
    return n % BS or 1


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 8192, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts, hf_greedy) -> list[list[int]]:
    return hf_greedy(tiny_model_dir, prompts, NEW_TOKENS)


def record_prompt_work(engine: LLMEngine) -> dict[str, int]:
    """request id -> tokens computed in its first step (its whole prompt here: the budget holds it)."""
    first: dict[str, int] = {}
    run = engine.runner.run

    def recording(batch):
        for req, n in batch.work:
            first.setdefault(req.request_id, n)
        return run(batch)

    engine.runner.run = recording
    return first


def generate(engine: LLMEngine, *prompt_ids: list[int]) -> list[list[int]]:
    ids = [engine.add_request(params=GREEDY, prompt_token_ids=p) for p in prompt_ids]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [out[i] for i in ids]


def cached_blocks(engine: LLMEngine, ids: list[int]) -> list[int]:
    """The prefix cache's blocks of every full block of `ids` (all must be cached)."""
    req = engine.make_request(None, GREEDY, ids, "probe")
    engine.block_manager.update_keys(req)
    return [engine.block_manager.cached[key] for key in req.block_keys[: len(ids) // BS]]


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_identical_repeat_on_the_engine(make_engine, prompts, reference, kernels):
    engine = make_engine(block_size=BS, kernels=kernels)
    computed = record_prompt_work(engine)
    sink = engine.runner.kv_cache[:, :, :, engine.runner.sink_block]
    assert generate(engine, *prompts) == reference
    assert not sink.any()  # no hit yet: nothing went to the sink
    blocks = [cached_blocks(engine, p) for p in prompts]
    before = [engine.runner.kv_cache[:, :, :, b].clone() for b in blocks]
    hits_before = engine.block_manager.hits
    for ids, ref in zip(prompts, reference, strict=True):
        assert generate(engine, ids) == [ref]
    for b, saved in zip(blocks, before, strict=True):
        assert torch.equal(engine.runner.kv_cache[:, :, :, b], saved)  # the shared blocks' bytes
    assert sink[:, :, :, BS - 1].any()  # the 64-token prompt's last token K/V went here instead
    repeats = list(computed.values())[len(prompts) :]
    assert repeats == [tail_tokens(n) for n in LENGTHS]
    assert engine.block_manager.hits - hits_before == sum(n - tail_tokens(n) for n in LENGTHS)


def test_identical_repeats_in_one_batch(make_engine, prompts, reference):
    """Several full hits in one step write the same sink slot; none reads it."""
    engine = make_engine(block_size=BS)
    long, long_ref = prompts[0], reference[0]
    assert generate(engine, long) == [long_ref]
    computed = record_prompt_work(engine)
    assert generate(engine, long, long, *prompts[1:]) == [long_ref, long_ref, *reference[1:]]
    assert list(computed.values())[:2] == [1, 1]


class FakePool:
    """An in-process stand-in for `PoolClient` with the calls the prefill worker makes: blocks by key
    (shared) or by request (the private tail), every landing and every stored byte checkable."""

    def __init__(self):
        self.blocks: dict[bytes, torch.Tensor] = {}  # key -> [L, 2, H, bs, D]
        self.locations: dict[bytes, Location] = {}
        self.puts = 0
        self.meta = self

    def lookup(self, keys) -> list[Location | None]:
        return [self.locations.get(k) for k in keys]

    def lookup_prefix(self, keys) -> list[Location]:
        out = []
        for loc in self.lookup(keys):
            if loc is None:
                break
            out.append(loc)
        return out

    def pull_into_cache(self, request_id, locations, cache, block_ids, head_begin=0, head_end=None) -> int:
        data = torch.stack([self.blocks[loc.key] for loc in locations])
        unpack_blocks(cache, list(block_ids), data, head_begin)
        return len(locations)

    def put_async(
        self, request_id, keys, data, private=(), node_id=None, head_begin=0, head_end=None, layers=None
    ):
        """A whole-block put, or a layer-wise one (`layers`): a block counts as put with its last layer."""
        out = []
        for key, block in zip(keys, data, strict=True):
            if layers is None:
                self.blocks[key] = block.clone()
            else:
                whole = self.blocks.setdefault(key, torch.full((LAYERS, *block.shape[1:]), float("nan")))
                whole[layers[0] : layers[1]] = block
            if layers is None or layers[1] == LAYERS:
                self.puts += 1
            self.locations.setdefault(key, Location(key, "fake-node", len(self.locations), 1))
            out.append(self.locations[key])
        future = concurrent.futures.Future()
        future.set_result(out)
        return future

    def pick_nodes(self, count=None, wait=True) -> list[str]:
        return ["fake-node"]

    def release(self, request_id) -> int:
        return 0


def prefill(worker: PrefillWorker, ids: list[int], rid: str) -> worker_pb2.PrefillResponse:
    """One Prefill call through the worker's stages, as its gRPC handler submits it."""
    sampling = generate_pb2.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling)
    job = PrefillJob(request, time.perf_counter())
    worker.loop.submit(lambda: worker._admit(job))
    return job.future.result(timeout=120)


def test_identical_repeat_through_the_prefill_worker(make_engine, prompts, reference):
    pool = FakePool()
    workers = [PrefillWorker(make_engine(block_size=BS), pool, f"prefill-{i}") for i in range(2)]
    for w in workers:
        w.start()
    try:
        a, b = workers
        for i, (ids, ref) in enumerate(zip(prompts, reference, strict=True)):
            n, full = len(ids), len(ids) // BS
            cold = prefill(a, ids, f"cold-{i}")
            assert (cold.first_token_id, cold.computed_tokens, cold.cached_tokens) == (ref[0], n, 0)
            blocks = cached_blocks(a.engine, ids)
            before = a.engine.runner.kv_cache[:, :, :, blocks].clone()
            pooled = {k: pool.blocks[k].clone() for k in pool.blocks}
            puts = pool.puts

            local = prefill(a, ids, f"local-{i}")  # every full block in a's own prefix cache
            assert local.first_token_id == ref[0]
            assert (local.computed_tokens, local.cached_tokens) == (tail_tokens(n), n - tail_tokens(n))
            assert local.pool_cached_tokens == 0
            assert torch.equal(a.engine.runner.kv_cache[:, :, :, blocks], before)
            assert pool.puts - puts == (n % BS > 0)  # only a private tail: the full blocks are there

            pulled = prefill(b, ids, f"pulled-{i}")  # b has nothing: every full block from the pool
            assert pulled.first_token_id == ref[0]
            assert (pulled.computed_tokens, pulled.pool_cached_tokens) == (tail_tokens(n), n - tail_tokens(n))
            b_blocks = cached_blocks(b.engine, ids)
            assert torch.equal(
                pack_blocks(b.engine.runner.kv_cache, b_blocks), pack_blocks(a.engine.runner.kv_cache, blocks)
            )
            assert all(torch.equal(pool.blocks[k], v) for k, v in pooled.items())
            assert len(b_blocks) == full
        for w in workers:
            assert w.counters["prompt_tokens_computed"] == sum(
                (n if w is a else 0) + tail_tokens(n) for n in LENGTHS
            )
    finally:
        for w in workers:
            w.stop()


class FailingLayerPool(FakePool):
    """A pool whose layer-wise puts fail (a node gone mid-stream); whole-block puts work."""

    def put_async(
        self, request_id, keys, data, private=(), node_id=None, head_begin=0, head_end=None, layers=None
    ):
        if layers is not None:
            raise RuntimeError("the node went away")
        return super().put_async(request_id, keys, data, private, node_id, head_begin, head_end)


@pytest.mark.parametrize("pool_cls", [FakePool, FailingLayerPool], ids=["streamed", "stream-fails"])
def test_layer_streaming_stores_every_block_or_answers_without_it(make_engine, prompts, reference, pool_cls):
    """Streaming on (chunks of 32 tokens): every full block reaches the pool layer by layer, bit-exact
    with the cache; a failing stream never fails the prefill: it is answered, without those blocks."""
    pool = pool_cls()
    worker = PrefillWorker(make_engine(block_size=BS, max_num_batched_tokens=32), pool, "prefill-s")
    worker.stream_layers("on")
    worker.start()
    try:
        ids, ref = prompts[0], reference[0]
        reply = prefill(worker, ids, "streamed")
        assert reply.first_token_id == ref[0]
        full = len(ids) // BS
        assert worker.counters["blocks_streamed"] == full
        blocks = cached_blocks(worker.engine, ids)
        if pool_cls is FakePool:
            assert len(reply.blocks) == full
            packed = pack_blocks(worker.engine.runner.kv_cache, blocks)
            assert all(torch.equal(pool.blocks[loc.key], packed[i]) for i, loc in enumerate(reply.blocks))
        else:
            assert len(reply.blocks) == 0 and pool.puts == 0  # a miss for the decode: it recomputes
    finally:
        worker.stop()
