"""Shared fixtures: built-in models are created once per test session into a temporary cache."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from kvferry.model.create import create_from_spec, create_model

if not torch.cuda.is_available():
    # the Triton kernels' tests run them on CPU tensors through Triton's interpreter; it must be on
    # before their @triton.jit decorators run (at import), so for the whole session. Nothing else reads
    # it: `--kernels auto` never picks Triton on a CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

SECOND_SPEC = {
    # a different shape from tiny: 3 layers, 6 experts top-3 without renormalisation, a dense layer,
    # tied embeddings, rope given as rope_parameters; written as sharded safetensors
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 160,
    "num_experts": 6,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 64,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="session", autouse=True)
def kvferry_cache(tmp_path_factory, monkeypatch_session) -> Path:
    cache = tmp_path_factory.mktemp("kvferry-cache")
    monkeypatch_session.setenv("KVFERRY_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="session")
def monkeypatch_session():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="session")
def tiny_model_dir(kvferry_cache) -> Path:
    return create_model("tiny", kvferry_cache / "models" / "tiny")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(kvferry_cache) -> Path:
    """A dense Qwen3 (Qwen3ForCausalLM) of the tiny model's size."""
    return create_model("tiny-qwen3", kvferry_cache / "models" / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_llama_dir(kvferry_cache) -> Path:
    """A dense Llama 3 (LlamaForCausalLM: no q/k norms, Llama 3.1's RoPE scaling) of that size."""
    return create_model("tiny-llama", kvferry_cache / "models" / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_deepseek_dir(kvferry_cache) -> Path:
    """A DeepSeek-V3 (DeepseekV3ForCausalLM: MLA with a q LoRA, YaRN, a dense layer, shared experts,
    noaux_tc routing over 4 groups) of that size."""
    return create_model("tiny-deepseek", kvferry_cache / "models" / "tiny-deepseek")


@pytest.fixture(scope="session")
def tiny_deepseek_nolora_dir(kvferry_cache) -> Path:
    """A DeepSeek-V3 without a q LoRA, one expert group, two shared experts."""
    return create_model("tiny-deepseek-nolora", kvferry_cache / "models" / "tiny-deepseek-nolora")


@pytest.fixture(scope="session")
def second_model_dir(kvferry_cache) -> Path:
    out = kvferry_cache / "models" / "second"
    return create_from_spec(SECOND_SPEC, out, seed=7, max_shard_bytes=1_000_000)


def _tiny_with_experts(kvferry_cache, num_experts: int) -> Path:
    from kvferry.model.create import load_spec

    out = kvferry_cache / "models" / f"tiny-{num_experts}-experts"
    spec = dict(load_spec("tiny"), num_experts=num_experts, torch_dtype="float32")
    return create_from_spec(spec, out, seed=num_experts)


@pytest.fixture(scope="session")
def five_expert_model_dir(kvferry_cache) -> Path:
    """tiny with 5 experts: expert parallelism of 2 holds 3 | 2 (an uneven map)."""
    return _tiny_with_experts(kvferry_cache, 5)


@pytest.fixture(scope="session")
def eight_expert_model_dir(kvferry_cache) -> Path:
    """tiny with 8 experts: expert parallelism of 3 holds 3 | 3 | 2."""
    return _tiny_with_experts(kvferry_cache, 8)


@pytest.fixture(scope="session")
def trained_model(kvferry_cache):
    """`kvferry model create trained` (the real training run: minutes), run once per session, as a user runs
    it; every test that needs the trained weights shares them. Returns (the command's CompletedProcess:
    stdout names the model's directory, stderr has the progress bar; the model's directory)."""
    import subprocess
    import sys

    made = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", "model", "create", "trained"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    return made, kvferry_cache / "models" / "trained"


def transformers_greedy(
    model_dir: Path, prompts: list[list[int]], new_tokens: int, **generate_kwargs
) -> list[list[int]]:
    """The `transformers` reference: greedy continuations (no EOS stop) of each prompt, float32;
    `generate_kwargs` go to `generate` (a repetition_penalty, say)."""
    import torch

    hf = _hf_model(str(model_dir))
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                **generate_kwargs,
            )
            refs.append(out[0, len(ids) :].tolist())
    return refs


def transformers_log_softmax(model_dir: Path, ids: list[int]):
    """The `transformers` reference's log-softmax at every position of `ids` ([len, vocab], float32)."""
    import torch

    with torch.inference_mode():
        return torch.log_softmax(_hf_model(str(model_dir))(torch.tensor([ids])).logits[0].float(), -1)


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_log_softmax():
    """transformers_log_softmax as a fixture."""
    return transformers_log_softmax


@pytest.fixture(scope="session")
def hf_greedy():
    """transformers_greedy as a fixture (test modules cannot import conftest helpers by name)."""
    return transformers_greedy
