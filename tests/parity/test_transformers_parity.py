"""kvferry's model and engine against transformers on the same checkpoint (float32): Qwen3-MoE (two
shapes), dense Qwen3 and Llama 3 (`Qwen3ForCausalLM`, `LlamaForCausalLM`), DeepSeek-V3 (two shapes:
with and without a q LoRA)."""

from __future__ import annotations

import json

import pytest
import torch

from kvferry.engine.engine import EngineConfig, EngineConfigError, LLMEngine
from kvferry.engine.request import InvalidRequestError, SamplingParams
from kvferry.model.attention import AttentionMetadata, PrefillChunk
from kvferry.model.config import ModelConfig
from kvferry.model.loader import load_model
from kvferry.model.quant import w8a8_linear as reference_w8a8

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(
    scope="module",
    params=[
        "tiny_model_dir",
        "second_model_dir",
        "tiny_qwen3_dir",
        "tiny_llama_dir",
        "tiny_deepseek_dir",
        "tiny_deepseek_nolora_dir",
    ],
)
def checkpoint(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(hf_model):
    """8 prompts of mixed lengths; the last two share a 3-block (48-token) prefix with the first."""
    gen = torch.Generator().manual_seed(3)
    vocab = hf_model.config.vocab_size
    out = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in (5, 17, 33, 64, 9, 40, 0, 0)]
    shared = torch.randint(3, vocab, (48,), generator=gen).tolist()
    out[0] = shared + out[0]
    out[6] = [*shared, 11, 12, 13]
    out[7] = shared + list(range(20, 40))
    return out


@pytest.fixture(scope="module")
def reference(checkpoint, prompts, hf_greedy):
    return hf_greedy(checkpoint, prompts, NEW_TOKENS)


def make_engine(checkpoint, **overrides) -> LLMEngine:
    cfg = dict(model=str(checkpoint), dtype="float32", max_model_len=256, num_kv_blocks=256)
    return LLMEngine(EngineConfig(**(cfg | overrides)))


def run_all(engine: LLMEngine, prompts, stagger: int = 0) -> list[list[int]]:
    """Submit prompts (one every `stagger` steps if > 0), run to completion, tokens in prompt order."""
    results: dict[str, list[int]] = {}
    ids: list[str] = []
    pending = list(prompts)
    while pending or engine.has_unfinished():
        if pending and (stagger == 0 or engine.num_steps % stagger == 0 or not engine.has_unfinished()):
            batch = pending if stagger == 0 else pending[:1]
            for p in batch:
                ids.append(engine.add_request(params=GREEDY, prompt_token_ids=p))
            pending = pending[len(batch) :]
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants()
    return [results[i] for i in ids]


def test_prefill_logits_match(checkpoint, hf_model, prompts):
    model = load_model(checkpoint, torch.float32)
    bs = 16
    for ids in prompts[:4]:
        n = len(ids)
        blocks = list(range(-(-n // bs)))
        cfg = model.cfg
        kv = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, len(blocks), bs, cfg.kv_cache_dim)
        meta = AttentionMetadata.build(
            [blocks[p // bs] for p in range(n)],
            [p % bs for p in range(n)],
            [],
            [],
            [PrefillChunk(0, n, n, torch.tensor(blocks))],
            kv.device,
        )
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(n), kv, meta))
        with torch.inference_mode():
            theirs = hf_model(torch.tensor([ids])).logits[0].float()
        assert (ours - theirs).abs().max().item() <= 1e-4


def test_greedy_alone_matches_transformers(checkpoint, prompts, reference):
    engine = make_engine(checkpoint, enable_prefix_caching=False)
    for ids, ref in zip(prompts, reference, strict=True):
        assert run_all(engine, [ids]) == [ref]


def test_batched_staggered_chunked(checkpoint, prompts, reference):
    engine = make_engine(checkpoint, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert run_all(engine, prompts, stagger=3) == reference


def test_all_at_once(checkpoint, prompts, reference):
    assert run_all(make_engine(checkpoint), prompts) == reference


def test_multi_step_decode(checkpoint, prompts, reference):
    """num_scheduler_steps=8: decode bursts (one call of the C++ step for DeepSeek-V3 without an MTP layer,
    a forward pass a step for the others; none with an MTP layer), exact all at once and staggered (a
    waiting request stops bursts until it is admitted); a stop token inside a burst ends each request at
    it, the K/V of the burst's later steps freed with its blocks."""
    engine = make_engine(checkpoint, num_scheduler_steps=8)
    bursts = []
    run_burst = engine.runner.run_burst

    def counted(reqs, steps):
        out = run_burst(reqs, steps)
        bursts.append(out is not None and len(out) == steps)
        return out

    engine.runner.run_burst = counted
    assert run_all(engine, prompts) == reference
    assert run_all(engine, prompts, stagger=3) == reference
    model = engine.runner.model
    assert engine.runner.bursts == (model.mtp is None)
    assert all(bursts) and len(bursts) >= (4 if model.mtp is None else 0)  # (31 decode steps: 4 bursts)
    stop = reference[3][11]  # a token inside the fourth prompt's second burst
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
    done = engine.generate([{"prompt_token_ids": p} for p in prompts], params)
    expect = [ref[: ref.index(stop) + 1] if stop in ref else ref for ref in reference]
    assert [d.output_token_ids for d in done] == expect
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants()


def test_after_prefix_cache_hit(checkpoint, prompts, reference):
    engine = make_engine(checkpoint)
    assert run_all(engine, prompts[:1]) == reference[:1]
    before = engine.block_manager.hits
    assert run_all(engine, prompts[6:]) == reference[6:]
    assert engine.block_manager.hits - before == 2 * 48  # both reuse the shared 3 blocks


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_identical_repeats_compute_only_what_is_not_cached(checkpoint, prompts, reference, kernels):
    """Every prompt again: its full blocks all hit, so it computes its partial tail, or its last token
    alone when the length is a multiple of the block size (prompts[3]: 64 tokens; the K/V of that token
    goes to the sink block). Staggered with a small budget, so full hits share steps with chunks."""
    engine = make_engine(checkpoint, kernels=kernels, max_num_batched_tokens=7)
    assert run_all(engine, prompts) == reference
    before = engine.block_manager.hits
    assert run_all(engine, prompts, stagger=2) == reference
    tails = [len(p) % 16 or 1 for p in prompts]
    assert engine.block_manager.hits - before == sum(len(p) for p in prompts) - sum(tails)


def test_after_preemption_and_recompute(checkpoint, prompts, reference):
    # 16 blocks of 16 tokens cannot hold 8 requests of up to ~100 tokens: some must be preempted
    engine = make_engine(checkpoint, num_kv_blocks=16, max_model_len=256, enable_prefix_caching=False)
    assert run_all(engine, prompts) == reference
    assert engine.scheduler.num_preemptions > 0


def test_priorities_preempt_and_every_output_stays_exact(checkpoint, prompts, reference):
    """Each later request more urgent than the ones before it (a lower priority value), on a cache and a
    seat count too small for all: running requests are preempted for higher-priority arrivals and
    recomputed (from their prefix-cache hits), and every output is still the reference's."""
    engine = make_engine(checkpoint, num_kv_blocks=16, max_model_len=256, max_num_seqs=3)
    results: dict[str, list[int]] = {}
    ids: list[str] = []
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending and (engine.num_steps % 2 == 0 or not engine.has_unfinished()):
            i, p = pending.pop(0)
            ids.append(engine.add_request(params=GREEDY, prompt_token_ids=p, priority=len(prompts) - i))
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [results[i] for i in ids] == reference
    assert engine.scheduler.num_priority_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    with pytest.raises(InvalidRequestError, match="priority must be an integer"):
        engine.add_request(params=GREEDY, prompt_token_ids=prompts[0], priority=1.5)


def test_cpu_kernels_and_torch_ops_both_match(checkpoint, prompts, reference):
    """The C++ CPU kernels (the default on CPU) and the plain torch ops give the same greedy tokens."""
    from kvferry.kernels import cpu

    for kernels in ("auto", "torch"):
        engine = make_engine(checkpoint, kernels=kernels, max_num_batched_tokens=7)
        assert engine.cpu_kernels == (kernels == "auto" and cpu.load())
        assert run_all(engine, prompts, stagger=3) == reference


@pytest.mark.slow  # the interpreter: about 20 s per checkpoint
def test_triton_kernels_match_transformers(checkpoint, prompts, reference):
    """The engine on the Triton kernels (`--kernels triton`: attention, routing, fused MoE) gives the
    reference's greedy tokens, chunked and staggered (decodes and prefill chunks in one step), then from
    the prefix cache (a cached prefix + new tokens). On a CPU they run under TRITON_INTERPRET=1
    (tests/conftest.py sets it): the same kernels CUDA compiles."""
    pytest.importorskip("triton")
    engine = make_engine(checkpoint, kernels="triton", max_num_batched_tokens=24)
    assert engine.kernel_backend == "triton" and not engine.cpu_kernels
    picked = [0, 1, 3]  # 53, 17 and 64 tokens
    assert run_all(engine, [prompts[i] for i in picked], stagger=3) == [reference[i] for i in picked]
    before = engine.block_manager.hits
    assert run_all(engine, prompts[6:]) == reference[6:]  # both share prompt 0's first 3 blocks
    assert engine.block_manager.hits - before == 2 * 48


LOGPROB_TOL = 2e-4  # float32 logits of two implementations (absolute, in nats)


def log_softmax_of(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)


def test_logprobs_and_prompt_logprobs_match_transformers(checkpoint, hf_model, prompts, reference):
    """The sampled tokens' logprobs (and top 3), and every prompt token's, are transformers' log-softmax;
    a second run of the same prompts (a prefix-cache hit for most) scores the prompt all the same."""
    engine = make_engine(checkpoint)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for _ in range(2):
        done = engine.generate([{"prompt_token_ids": p, "params": params} for p in prompts[:4]])
        for prompt, ref, c in zip(prompts, reference, done, strict=False):
            assert c.output_token_ids == ref[:8]
            full = log_softmax_of(hf_model, prompt + ref[:8])
            for i, (token, lp) in enumerate(zip(c.output_token_ids, c.logprobs, strict=True)):
                row = full[len(prompt) - 1 + i]
                assert lp.token_id == token and lp.rank == 1
                assert lp.logprob == pytest.approx(row[token].item(), abs=LOGPROB_TOL)
                assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
            assert len(c.prompt_logprobs) == len(prompt) - 1
            for j, lp in enumerate(c.prompt_logprobs, 1):
                assert lp.token_id == prompt[j]
                assert lp.logprob == pytest.approx(full[j - 1, prompt[j]].item(), abs=LOGPROB_TOL)
                assert lp.rank == int((full[j - 1] > full[j - 1, prompt[j]]).sum()) + 1
                assert len(lp.top) == 2


def test_repetition_penalty_matches_transformers_generate(checkpoint, prompts, hf_greedy):
    """Greedy with a repetition penalty (over prompt and output tokens, as transformers applies it)."""
    engine = make_engine(checkpoint)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.8)
    done = engine.generate([{"prompt_token_ids": p, "params": params} for p in prompts[:3]])
    want = hf_greedy(checkpoint, prompts[:3], 16, repetition_penalty=1.8)
    assert [c.output_token_ids for c in done] == want


NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"kernels": "torch"},
        {"max_num_batched_tokens": 7},  # drafts cut to the budget, shared with prefill chunks
        {"num_kv_blocks": 16, "enable_prefix_caching": False},  # preemptions: drafts never cause one
    ],
    ids=["auto", "torch", "small-budget", "preempting"],
)
def test_speculative_ngram_greedy_matches_transformers(checkpoint, prompts, reference, hf_greedy, overrides):
    """n-gram speculative decoding gives the non-speculative greedy tokens (transformers'), with drafts
    proposed and accepted; prompts that repeat themselves are added so proposals come often."""
    gen = torch.Generator().manual_seed(5)
    vocab = 4096
    loops = [(torch.randint(3, vocab, (n,), generator=gen).tolist() * 4)[: 3 * n + 2] for n in (3, 5, 7)]
    want = reference + hf_greedy(checkpoint, loops, NEW_TOKENS)
    engine = make_engine(checkpoint, speculative_config=NGRAM, **overrides)
    assert run_all(engine, prompts + loops) == want
    assert engine.spec_proposed > 0 and 0 < engine.spec_accepted <= engine.spec_proposed


MTP = '{"method": "mtp", "num_speculative_tokens": 3}'


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"kernels": "torch"},
        {"max_num_batched_tokens": 7},
        {"num_kv_blocks": 16, "enable_prefix_caching": False},
    ],
    ids=["auto", "torch", "small-budget", "preempting"],
)
def test_speculative_mtp_greedy_matches_transformers(checkpoint, prompts, reference, overrides):
    """The checkpoint's MTP layer as the proposer (DeepSeek-V3's): the non-speculative greedy tokens
    (transformers'), batched, chunked, after prefix hits (the shared prompts) and preemptions, every
    request drafting from its first decode step on. A checkpoint without an MTP layer is refused."""
    engine_of = lambda: make_engine(checkpoint, speculative_config=MTP, **overrides)  # noqa: E731
    if not ModelConfig.from_dir(checkpoint).num_mtp_layers:
        with pytest.raises(EngineConfigError, match="no MTP layer"):
            engine_of()
        return
    engine = engine_of()
    assert run_all(engine, prompts, stagger=2) == reference
    assert engine.spec_proposed >= 2 * len(prompts)


def test_int8_weights_cpu_kernels_and_torch_reference_agree(checkpoint, prompts, monkeypatch):
    """`--quantization int8`: the C++ kernels (VNNI or AVX2 int8 loop) and the torch W8A8 reference give the
    same greedy tokens, batched, chunked and after prefix hits; the KV fingerprint keeps int8 apart.

    TRITON_INTERPRET (on for this session, for the Triton tests) is off here: under it `--kernels torch`
    int8 layers run the Triton W8A8 kernel in the interpreter (`layers.int8_linear`; over a minute per
    checkpoint) instead of the torch reference this compares with. That kernel and that dispatch are
    checked against the reference in tests/unit/test_triton_kernels.py."""
    from kvferry.kernels import cpu
    from kvferry.model import quant

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch_path = []
    monkeypatch.setattr(quant, "w8a8_linear", lambda *a: torch_path.append(1) or reference_w8a8(*a))

    outputs = []
    for kernels in ("auto", "torch"):
        engine = make_engine(checkpoint, kernels=kernels, max_num_batched_tokens=7, quantization="int8")
        assert engine.cpu_kernels == (kernels == "auto" and cpu.load())
        outputs.append(run_all(engine, prompts, stagger=3))
    assert outputs[0] == outputs[1]
    assert torch_path  # the torch engine's int8 layers ran the torch reference
    assert engine.fingerprint != make_engine(checkpoint, kernels="torch").fingerprint


def test_int8_kv_cache_cpu_kernels_and_torch_reference_agree(checkpoint, prompts):
    """`--kv-cache-dtype int8`: the C++ kernels and the torch ops read and write the same int8 rows and give
    the same greedy tokens (batched, chunked, prefix hits); the cache is a quarter of float32's bytes and
    the fingerprint keeps its blocks apart."""
    outputs = []
    for kernels in ("auto", "torch"):
        engine = make_engine(checkpoint, kernels=kernels, max_num_batched_tokens=7, kv_cache_dtype="int8")
        assert engine.runner.kv_cache.dtype == torch.int8
        outputs.append(run_all(engine, prompts, stagger=3))
    assert outputs[0] == outputs[1]
    plain = make_engine(checkpoint, kernels="torch")
    assert engine.fingerprint != plain.fingerprint
    d = plain.model.cfg.kv_cache_dim
    int8_block, float_block = (
        engine.runner.kv_cache[:, :, :, 0].nbytes,
        plain.runner.kv_cache[:, :, :, 0].nbytes,
    )
    assert int8_block * 4 * d == float_block * (d + 4)  # a row: D values + a 4-byte scale, against 4 D bytes


def test_int8_kv_cache_keeps_perplexity(checkpoint, prompts):
    """The int8 KV cache's rule (the trained model's is in tests/integration/test_trained_model.py): the
    perplexity of every prompt token given the ones before, through the int8 cache, within 1% of the
    model dtype's cache (here float32; K and V rows, or MLA's latent rows)."""
    import math

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scored = [p for p in prompts if len(p) > 16]
    nll = []
    for cache in ("auto", "int8"):
        engine = make_engine(checkpoint, kv_cache_dtype=cache, enable_prefix_caching=False)
        done = engine.generate([{"prompt_token_ids": p, "params": params} for p in scored])
        logprobs = [lp.logprob for c in done for lp in c.prompt_logprobs]
        nll.append(-sum(logprobs) / len(logprobs))
    assert math.exp(nll[1]) == pytest.approx(math.exp(nll[0]), rel=0.01)


@pytest.mark.parametrize("draft", ["itself", "other"])
def test_speculative_draft_model_greedy_matches_transformers(
    checkpoint, prompts, reference, tiny_model_dir, five_expert_model_dir, draft
):
    """The draft-model proposer gives the non-speculative greedy tokens (transformers'): with the target
    as its own draft every draft is accepted; with another model on the tokenizer some are, some not (a
    dense target with the MoE tiny as its draft, too). A draft with another vocabulary (the second
    checkpoint's 4096 against tiny's 8192) is refused."""
    other = five_expert_model_dir if checkpoint == tiny_model_dir else tiny_model_dir
    model = str(checkpoint if draft == "itself" else other)
    spec = json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": 3})
    vocab = {json.loads((d / "config.json").read_text())["vocab_size"] for d in (checkpoint, other)}
    if draft == "other" and len(vocab) > 1:
        with pytest.raises(EngineConfigError, match="vocabulary"):
            make_engine(checkpoint, speculative_config=spec)
        return
    engine = make_engine(checkpoint, speculative_config=spec, max_num_batched_tokens=7)
    assert run_all(engine, prompts, stagger=3) == reference
    assert engine.spec_proposed > 0
    if draft == "itself":
        assert engine.spec_accepted == engine.spec_proposed
    else:
        assert engine.spec_accepted < engine.spec_proposed
