"""DeepSeek-V3's multi-token-prediction layer (`model.qwen3_moe.MtpLayer`, `engine.mtp_proposer`): its
drafts against the layer computed from scratch by transformers' own DeepSeek-V3 decoder layer, and its
cache rows, written by the target's forward, that travel with the blocks."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors import safe_open

from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.engine.request import SamplingParams
from kvferry.model.config import ModelConfig

MTP = '{"method": "mtp", "num_speculative_tokens": 2}'


def checkpoint_tensors(model_dir, prefix: str) -> dict[str, torch.Tensor]:
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        return {
            k.removeprefix(prefix): f.get_tensor(k).float() for k in set(f.keys()) if k.startswith(prefix)
        }


class MtpReference:
    """vLLM's DeepSeek MTP from scratch, on transformers' modules. An entry i takes a token (its embedding
    zeroed at entry 0) and a hidden state, at RoPE position i; its logits propose the token two after the
    one whose hidden state it took. Entry i of a sequence S: token S[i + 1] and the target's final hidden
    state at i; a second pass chains, its last entry taking the first pass's draft and output."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        self.hf = hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        cfg = hf.config
        weights = checkpoint_tensors(model_dir, f"model.layers.{cfg.num_hidden_layers}.")
        self.block = DeepseekV3DecoderLayer(cfg, cfg.num_hidden_layers).eval()
        experts = range(cfg.n_routed_experts)
        weights["mlp.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat([weights.pop(f"mlp.experts.{e}.{n}_proj.weight") for n in ("gate", "up")])
                for e in experts
            ]
        )
        weights["mlp.experts.down_proj"] = torch.stack(
            [weights.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts]
        )
        own = set(self.block.state_dict())
        self.block.load_state_dict({k: v for k, v in weights.items() if k in own}, strict=True)
        self.norms = {}
        for name in ("enorm", "hnorm", "shared_head.norm"):
            self.norms[name] = DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.norms[name].weight.data.copy_(weights[f"{name}.weight"])
        self.eh_proj = weights["eh_proj.weight"]

    @torch.inference_mode()
    def hidden(self, seq: list[int]) -> torch.Tensor:
        """The target's final hidden states (after its norm) at every position of `seq`: [N, H]."""
        return self.hf.model(torch.tensor([seq])).last_hidden_state[0]

    @torch.inference_mode()
    def run(self, tokens: list[int], prevs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries 0..m-1 of (tokens [m], hidden states [m, H]): (the last entry's logits [V], its output
        before the head's norm [H], what a next pass takes)."""
        n = len(tokens)
        embeds = self.hf.model.embed_tokens(torch.tensor(tokens))
        embeds[0] = 0.0
        x = torch.cat((self.norms["enorm"](embeds), self.norms["hnorm"](prevs)), -1) @ self.eh_proj.t()
        positions = torch.arange(n)[None]
        rope = self.hf.model.rotary_emb(x[None], positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.block(x[None], attention_mask=mask, position_ids=positions, position_embeddings=rope)[
            0, -1
        ]
        return self.hf.lm_head(self.norms["shared_head.norm"](out)), out


@pytest.fixture(scope="module")
def reference(tiny_deepseek_dir) -> MtpReference:
    return MtpReference(tiny_deepseek_dir)


def recording(engine: LLMEngine) -> list[tuple]:
    """Every MTP pass the engine runs from now on: (tokens, hidden states in, entry positions, logits,
    hidden states out), one row per request drafting."""
    model, seen = engine.runner.model, []
    draft = model.draft

    def record(tokens, prev, kv_cache, meta):
        logits, out = draft(tokens, prev, kv_cache, meta)
        seen.append((tokens.clone(), prev.clone(), meta.context_lens - 2, logits.clone(), out.clone()))
        return logits, out

    model.draft = record
    return seen


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_first_draft_equals_the_layer_from_scratch(tiny_deepseek_dir, reference, kernels):
    """The first proposal after a prefill: kvferry's MTP pass over its paged cache rows (written by the
    prefill) gives the logits the MTP layer computed from scratch gives."""
    engine = LLMEngine(
        EngineConfig(model=str(tiny_deepseek_dir), dtype="float32", kernels=kernels, speculative_config=MTP),
        detokenize=False,
    )
    seen = recording(engine)
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 8000, (37,), generator=gen).tolist()
    (done,) = engine.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    )
    assert seen  # (the first proposal: one pass, the request had room for one draft more)
    seq = [*prompt, done.output_token_ids[0]]
    want, _ = reference.run(seq[1:], reference.hidden(seq)[:-1])
    torch.testing.assert_close(seen[0][3][0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["one-chunk", "chunked", "prefix-hit", "torch-ops"])
def test_every_draft_of_every_pass_equals_the_layer_from_scratch(tiny_deepseek_dir, reference, mode):
    """Every MTP pass of a whole generation (2 drafts a step), one request at a time, against the layer
    from scratch: a first pass takes the last accepted token and the target's hidden state before it
    (kept from the verification, or from the step before a chunk, or recomputed after a prefix hit)
    and attends over MTP rows the target's forward wrote (in one chunk, in chunks of 16, after a cached
    prefix); a second pass chains on the first's draft and output."""
    settings = {"chunked": {"max_num_batched_tokens": 16}, "torch-ops": {"kernels": "torch"}}.get(mode, {})
    engine = LLMEngine(
        EngineConfig(model=str(tiny_deepseek_dir), dtype="float32", speculative_config=MTP, **settings),
        detokenize=False,
    )
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(3, 8000, (37,), generator=gen).tolist()
    prompts = [first] if mode != "prefix-hit" else [first, first[:32] + list(range(40, 50))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    chained, cached = 0, []
    for prompt in prompts:
        seen = recording(engine)
        (done,) = engine.generate([{"prompt_token_ids": prompt}], params)
        cached.append(done.num_cached_tokens)
        seq = prompt + done.output_token_ids
        hidden = reference.hidden(seq)
        assert len(seen) >= 4
        before = None
        for tokens, prev, entry, logits, out in seen:
            (e,), (t,) = entry.tolist(), tokens.tolist()
            if before is not None and torch.equal(prev, before):  # a second pass: the first's output
                chained += 1
                want = reference.run([*seq[1 : e + 1], t], torch.cat((hidden[:e], prev)))
            else:
                assert t == seq[e + 1]
                torch.testing.assert_close(prev[0], hidden[e], rtol=1e-4, atol=1e-4)
                want = reference.run(seq[1 : e + 2], hidden[: e + 1])
            torch.testing.assert_close(logits[0], want[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out[0], want[1], rtol=1e-4, atol=1e-4)
            before = out
    assert cached[-1] == (32 if mode == "prefix-hit" else 0)
    assert chained >= 2


def test_mtp_rows_are_the_caches_last_layer(tiny_deepseek_dir):
    """The MTP layer's rows live in the cache's last layer: a pool block has one layer more than the
    decoder, the prefill writes the prompt's rows, and a checkpoint whose config names MTP layers it does
    not ship gets none."""
    from kvferry.kvpool.transfer import BlockLayout

    cfg = ModelConfig.from_dir(tiny_deepseek_dir)
    assert (cfg.num_mtp_layers, cfg.num_cache_layers) == (1, cfg.num_layers + 1)
    assert BlockLayout.for_model(cfg, 16, torch.float32).num_layers == cfg.num_layers + 1
    engine = LLMEngine(EngineConfig(model=str(tiny_deepseek_dir), dtype="float32"), detokenize=False)
    prompt = list(range(100, 140))
    engine.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0))
    cache = engine.runner.kv_cache
    assert cache.shape[0] == cfg.num_layers + 1
    blocks = [b for b in range(engine.block_manager.num_blocks) if cache[-1, :, :, b].abs().sum() > 0]
    assert len(blocks) == 3  # the prompt's 40 tokens: slot 0 is never written, slots 1..39 are
    # a config naming an MTP layer whose weights the checkpoint lacks: no MTP layer
    raw = json.loads((tiny_deepseek_dir / "config.json").read_text())
    assert ModelConfig.from_dict(raw).num_mtp_layers == 1
    assert ModelConfig.from_dict(raw | {"num_nextn_predict_layers": 0}).num_cache_layers == cfg.num_layers


def bigram_mtp_checkpoint(model_dir, out_dir, pairs: dict[int, int]):
    """A copy of `model_dir` whose MTP layer proposes `pairs[t]` after token t: eh_proj maps t's normalised
    embedding onto the LM head's row of pairs[t] (the hidden-state half zero), and the block adds nothing
    (its attention output and MLP down projections zero), so the draft after t is pairs[t]."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(model_dir, out_dir)
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in set(f.keys())}
    mtp = f"model.layers.{json.loads((model_dir / 'config.json').read_text())['num_hidden_layers']}."
    embed, head = tensors["model.embed_tokens.weight"].float(), tensors["lm_head.weight"].float()
    hidden = embed.shape[1]
    eh = torch.zeros(hidden, 2 * hidden)
    for a, b in pairs.items():
        e = embed[a] / embed[a].pow(2).mean().sqrt()  # enorm's output (weight one)
        eh[:, :hidden] += torch.outer(head[b], e) / hidden
    tensors[mtp + "eh_proj.weight"] = eh.to(torch.bfloat16)
    for name in tensors:
        if name.startswith(mtp) and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / ".kvferry-digest.json").unlink(missing_ok=True)
    return out_dir


def test_drafts_the_target_agrees_with_are_accepted(tiny_deepseek_dir, tmp_path):
    """With an MTP layer that knows the target's next-token pairs, most drafts are accepted (their
    numbers, pass by pass: the from-scratch test above), the blocks taken for them line up with the
    accepted tokens', and the output is still exactly the non-speculative one."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [
        torch.randint(3, 8000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 30)
    ]
    plain = LLMEngine(EngineConfig(model=str(tiny_deepseek_dir), dtype="float32"), detokenize=False)
    want = [c.output_token_ids for c in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    seen: dict[int, set[int]] = {}
    for prompt, out in zip(prompts, want, strict=True):
        seq = prompt[-1:] + out
        for a, b in itertools.pairwise(seq):
            seen.setdefault(a, set()).add(b)
    pairs = {a: next(iter(bs)) for a, bs in seen.items() if len(bs) == 1}
    model = bigram_mtp_checkpoint(tiny_deepseek_dir, tmp_path / "bigram", pairs)
    engine = LLMEngine(
        EngineConfig(model=str(model), dtype="float32", speculative_config=MTP, max_num_batched_tokens=16),
        detokenize=False,
    )
    got = [c.output_token_ids for c in engine.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    assert engine.spec_accepted > 0.8 * engine.spec_proposed > 0
