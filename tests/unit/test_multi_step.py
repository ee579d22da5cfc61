"""Multi-step decode (`num_scheduler_steps`) at the edges of the block manager: a full prefix hit's
recomputed token (the shared block is never written) and a burst the free blocks cannot hold (no
request takes blocks for it). Both step once there, with the tokens of one step at a time."""

from __future__ import annotations

import torch

from kvferry.engine.request import SamplingParams

BS = 16


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def count_bursts(engine) -> list[int]:
    """The steps of each burst the runner runs (appended as they run)."""
    calls: list[int] = []
    run_burst = engine.runner.run_burst

    def counted(reqs, steps):
        calls.append(steps)
        return run_burst(reqs, steps)

    engine.runner.run_burst = counted
    return calls


def alone(make_engine, model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    engine = make_engine(model_dir)
    return engine.generate([{"prompt_token_ids": prompt}], greedy(max_tokens))[0].output_token_ids


def test_a_full_hit_after_a_preemption_steps_once_and_leaves_the_shared_block(
    make_engine, tiny_deepseek_nolora_dir
):
    """A preempted request whose 32 tokens are all cached (another request committed them) comes back
    with only its last token to compute, into the sink: that step is not a burst (a burst would write
    the token's K/V into the shared block); the bursts go on after it, exact."""
    prompt = torch.randint(3, 1000, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    expect = alone(make_engine, tiny_deepseek_nolora_dir, prompt, 40)
    engine = make_engine(tiny_deepseek_nolora_dir, num_scheduler_steps=8)
    bursts = count_bursts(engine)
    first = engine.generate([{"prompt_token_ids": prompt}], greedy(20))[0].output_token_ids
    assert first == expect[:20] and bursts  # its blocks of positions 0-31: committed, cached
    rid = engine.add_request(params=greedy(40), prompt_token_ids=prompt)
    req = engine.states[rid].req
    outputs = [*engine.step(), *engine.step()]  # its prompt (a hit), then a burst of 8: 32 tokens
    assert req.num_tokens == 2 * BS and req.num_computed_tokens == 2 * BS - 1
    engine.scheduler.running.remove(req)
    engine.scheduler._preempt(req)
    shared = engine.block_manager.cached_prefix(req)
    assert len(shared) == 2  # every token of it cached: a full hit
    before = engine.runner.kv_cache[:, :, :, shared].clone()
    calls = len(bursts)
    outputs += engine.step()
    assert req.num_committed_blocks == 2 and req.block_ids[:2] == shared
    assert len(bursts) == calls  # stepped once, its K/V to the sink
    assert torch.equal(engine.runner.kv_cache[:, :, :, shared], before)
    while engine.has_unfinished():
        outputs += engine.step()
    assert len(bursts) > calls
    assert [t for out in outputs for t in out.new_token_ids] == expect
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_burst_the_free_blocks_cannot_hold_takes_none_of_them(make_engine, tiny_deepseek_nolora_dir):
    """Two requests of 2 blocks each and 1 block free: a burst from position 30 (of 3 tokens, then 2)
    would need a third block each, so none runs and neither request takes the free block for it (the
    steps' own decodes need none); the tokens are those of one step at a time."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 1000, (30,), generator=gen).tolist() for _ in range(2)]
    expect = [alone(make_engine, tiny_deepseek_nolora_dir, p, 4) for p in prompts]
    engine = make_engine(tiny_deepseek_nolora_dir, num_scheduler_steps=8, num_kv_blocks=5, max_model_len=64)
    bursts = count_bursts(engine)
    free_at_run = []
    run = engine.runner.run

    def recording(batch):
        free_at_run.append(engine.block_manager.num_free_blocks)
        return run(batch)

    engine.runner.run = recording
    done = engine.generate([{"prompt_token_ids": p} for p in prompts], greedy(4))
    assert [d.output_token_ids for d in done] == expect
    assert not bursts and free_at_run[1:3] == [1, 1]  # the decodes at positions 30 and 31
