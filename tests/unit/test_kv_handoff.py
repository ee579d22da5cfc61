"""The engine's KV hand-off API (engine/kv_handoff.py): a request waiting on remote KV is the
scheduler's (WAITING_FOR_REMOTE_KV: held, counted, never scheduled), resumes from the KV that arrived,
and an abort there finishes it without touching the blocks its transfer holds; pulled blocks become
prefix-cache hits; an exported request's blocks are readable in the finish callback."""

from __future__ import annotations

import pytest
import torch

from kvferry.engine.engine import LLMEngine
from kvferry.engine.request import RequestStatus, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture()
def engine(make_engine):
    return make_engine(detokenize=False)


def prompt(seed: int, n: int = 40) -> list[int]:
    return torch.randint(3, 8000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drain(engine: LLMEngine) -> dict[str, list]:
    """Step until nothing is left: every request's tokens and finish reason."""
    out: dict[str, list] = {}
    for _ in range(200):
        if not engine.has_unfinished():
            return out
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                out[o.request_id].append(o.finish_reason)
    raise AssertionError("the engine did not finish")


def test_a_request_waiting_on_remote_kv_is_held_not_scheduled_then_resumes_exactly(engine):
    ids = prompt(1)
    whole = drain_one(engine, ids, "whole")
    kv = engine.kv
    req = engine.make_request(None, GREEDY, ids, "remote")
    kv.await_kv(req)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV and kv.awaiting("remote")
    assert engine.has_request("remote") and not engine.has_unfinished()  # nothing to step for it
    assert kv.load()["waiting_for_kv"] == 1 and kv.load()["waiting"] == 0
    assert engine.step() == []  # never scheduled while its KV is on the way

    # its KV "arrives": computed here by another request, pulled into reserved blocks by key
    keys = kv.prompt_keys(req)
    assert len(keys) == len(ids) // kv.block_size
    held = kv.hold_cached(keys)  # the "whole" run left them in the local prefix cache
    assert len(held) == len(keys)
    kv.kv_arrived(req, whole[0], held, len(held) * kv.block_size)
    assert not kv.awaiting("remote") and req.status == RequestStatus.WAITING
    assert drain(engine)["remote"] == [*whole[1:], "length"]
    engine.block_manager.check_invariants()
    assert kv.blocks_in_use() == 0


def drain_one(engine: LLMEngine, ids: list[int], rid: str) -> list[int]:
    engine.add_request(None, GREEDY, prompt_token_ids=ids, request_id=rid)
    tokens = drain(engine)[rid]
    assert tokens[-1] == "length"
    return tokens[:-1]


def test_abort_while_waiting_on_remote_kv_finishes_it_and_leaves_the_transfer_blocks(engine):
    kv = engine.kv
    req = engine.make_request(None, GREEDY, prompt(2), "gone")
    kv.await_kv(req)
    reserved = kv.reserve(3)  # the transfer's blocks: the worker holds them until the pull ends
    assert engine.abort("gone")
    assert drain(engine) == {"gone": ["abort"]}
    assert not engine.has_request("gone") and not kv.awaiting("gone")
    assert kv.blocks_in_use() == 3  # still the transfer's
    kv.release(reserved)
    assert kv.blocks_in_use() == 0
    engine.block_manager.check_invariants()


def test_a_request_finished_by_its_first_token_ends_on_arrival(engine):
    kv = engine.kv
    req = engine.make_request(None, SamplingParams(max_tokens=1, ignore_eos=True), prompt(3), "one")
    kv.await_kv(req)
    blocks = kv.reserve(2)
    kv.kv_arrived(req, 5, blocks, 2 * kv.block_size)
    assert drain(engine) == {"one": ["length"]}  # the first token was streamed elsewhere
    assert kv.blocks_in_use() == 0


def test_pulled_blocks_become_prefix_hits_and_the_finish_callback_sees_the_prompt_blocks(engine):
    kv = engine.kv
    ids = prompt(4, 48)
    seen = []
    kv.on_finished(lambda req: seen.append(kv.block_ids(req, range(len(kv.prompt_keys(req))))))
    drain_one(engine, ids, "first")
    assert len(seen) == 1 and len(seen[0]) == 3  # 48 tokens: three full blocks, read before freed
    kv.on_finished(None)

    other = engine.make_request(None, GREEDY, prompt(5, 48), "other")
    keys = kv.prompt_keys(other)
    assert kv.hold_cached(keys) == []  # nothing of it here yet
    landed = kv.reserve(len(keys))  # a pull lands its KV in these
    kv.arrived(landed, keys)
    kv.release(landed)
    assert kv.hold_cached(keys) == landed  # findable by key now
    kv.release(landed)
    engine.block_manager.check_invariants()


def test_keys_hashed_elsewhere_are_adopted_only_for_their_own_prompt(engine):
    from kvferry.engine.block_hash import block_keys

    kv, ids = engine.kv, prompt(6, 50)
    keys = block_keys(ids, kv.block_size, engine.fingerprint)
    req = engine.make_request(None, GREEDY, ids, "adopt")
    assert kv.adopt_keys(req, keys) and kv.prompt_keys(req) == keys
    other = engine.make_request(None, GREEDY, prompt(7, 50), "other")
    assert not kv.adopt_keys(other, keys)  # another prompt's keys: hashed here instead
    assert kv.prompt_keys(other) == block_keys(other.prompt_token_ids, kv.block_size, engine.fingerprint)
    too_many = engine.make_request(None, GREEDY, ids[:20], "short")
    assert not kv.adopt_keys(too_many, keys)  # more keys than the prompt has full blocks


@pytest.mark.parametrize("checkpoint", ["tiny_model_dir", "tiny_deepseek_dir"])
def test_the_layer_hook_hears_every_layer_when_a_prompt_ends_on_a_one_token_chunk(
    request, make_engine, checkpoint
):
    """The streaming hook (`kv.on_layers`) hears every layer of each step, the MTP layer's last where
    there is one, also when every row of the step is one token and the step runs as one decode call:
    here a 16-token prompt's last chunk, one token that completes its first block."""
    engine = make_engine(request.getfixturevalue(checkpoint), detokenize=False, max_num_batched_tokens=15)
    every = list(range(engine.kv.cache.shape[0]))
    heard: list[tuple[list, list[int]]] = []  # per step: (its rows: (size, a prompt's?)), the layers heard)

    def hook(batch):
        rows = [(n, req.num_computed_tokens < req.num_prompt_tokens) for req, n in batch.work]
        heard.append((rows, []))
        return heard[-1][1].append

    engine.kv.on_layers(hook)
    engine.add_request(params=GREEDY, prompt_token_ids=list(range(20, 36)))
    drain(engine)
    assert heard[:3] == [([(15, True)], every), ([(1, True)], every), ([(1, False)], every)]
    assert all(layers == every for _, layers in heard)
