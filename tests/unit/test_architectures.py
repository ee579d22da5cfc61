"""Which checkpoints kvferry serves (`model.config.ARCHITECTURES`), what each one's config turns on, and
the clear refusal of the rest: a field kvferry cannot honour is an error naming it, never ignored."""

from __future__ import annotations

import math

import pytest
import torch

from kvferry.model.config import ModelConfig, ModelConfigError
from kvferry.model.create import load_spec
from kvferry.model.layers import RotaryEmbedding, llama3_inv_freq


def test_every_built_in_spec_loads_as_a_config():
    """Every spec `kvferry model create` takes reads as the architecture it names (a bench-sized one of
    each: Qwen3-MoE, dense Qwen3, Llama, DeepSeek-V3)."""
    from kvferry.model.create import SPECS

    archs = {n: ModelConfig.from_dict(load_spec(n)).architecture for n in SPECS}
    assert {archs[n] for n in ("bench", "bench-qwen3", "bench-llama", "bench-deepseek")} == {
        "Qwen3MoeForCausalLM",
        "Qwen3ForCausalLM",
        "LlamaForCausalLM",
        "DeepseekV3ForCausalLM",
    }


def test_each_built_in_spec_is_its_architecture():
    moe, qwen3, llama = (ModelConfig.from_dict(load_spec(n)) for n in ("tiny", "tiny-qwen3", "tiny-llama"))
    assert (moe.architecture, moe.qk_norm, moe.num_experts > 0) == ("Qwen3MoeForCausalLM", True, True)
    assert (qwen3.architecture, qwen3.qk_norm, qwen3.num_experts) == ("Qwen3ForCausalLM", True, 0)
    assert not any(qwen3.is_moe_layer(i) for i in range(qwen3.num_layers))
    assert (llama.architecture, llama.qk_norm, llama.num_experts) == ("LlamaForCausalLM", False, 0)
    assert llama.rope_llama3 == (8.0, 1.0, 4.0, 2048.0) and moe.rope_llama3 == ()


@pytest.mark.parametrize(
    "change, words",
    [
        ({"architectures": ["DeepseekV2ForCausalLM"]}, "architectures='DeepseekV2ForCausalLM' is not"),
        ({"architectures": ["MistralForCausalLM"]}, "kvferry serves Qwen3MoeForCausalLM, Qwen3ForCausalLM"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "\\(yarn\\) has no 'original_max_pos"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type='longrope' is not"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "\\(llama3\\) has no 'low_freq_factor'"),
        ({"use_sliding_window": True}, "sliding"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"architectures": None, "model_type": "mistral"}, "model_type='mistral' is not supported"),
    ],
)
def test_what_kvferry_cannot_honour_is_refused_by_name(change, words):
    with pytest.raises(ModelConfigError, match=words):
        ModelConfig.from_dict(load_spec("tiny-llama") | change)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
        ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
        ({"kv_lora_rank": None}, "kv_lora_rank must be > 0"),
        ({"kv_lora_rank": 47}, "must be even"),
        ({"n_group": 3}, "n_group=3 does not divide n_routed_experts=8"),
        ({"topk_group": 5}, "topk_group=5 must be in \\[1, n_group=4\\]"),
        ({"n_group": 8, "topk_group": 4}, "n_group=8: a group needs 2 experts"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 must be in \\[1, .* = 4\\]"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic' is not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config \\(fp8\\) is not supported"),
    ],
)
def test_deepseek_fields_kvferry_cannot_honour_are_refused_by_name(change, words):
    with pytest.raises(ModelConfigError, match=words):
        ModelConfig.from_dict(load_spec("tiny-deepseek") | change)


def test_deepseek_specs_read_as_mla_with_grouped_routing():
    lora, plain, bench = (
        ModelConfig.from_dict(load_spec(n))
        for n in ("tiny-deepseek", "tiny-deepseek-nolora", "bench-deepseek")
    )
    assert (lora.architecture, lora.mla, lora.q_lora_rank, plain.q_lora_rank) == (
        "DeepseekV3ForCausalLM",
        True,
        64,
        0,
    )
    assert (lora.num_kv_heads, lora.kv_cache_dim, lora.rope_dim) == (1, (48 + 16) // 2, 16)
    assert (lora.n_group, lora.topk_group, lora.sigmoid_routing, lora.n_shared_experts) == (4, 2, True, 1)
    assert [lora.is_moe_layer(i) for i in range(3)] == [False, True, True]  # first_k_dense_replace 1
    assert all(plain.is_moe_layer(i) for i in range(2)) and plain.n_shared_experts == 2
    assert lora.rope_yarn and not plain.rope_yarn and lora.rope_interleave and not plain.rope_interleave
    # the softmax scale carries YaRN's mscale(factor 4, mscale_all_dim 1) squared
    assert lora.softmax_scale == pytest.approx(48**-0.5 * (0.1 * math.log(4) + 1) ** 2)
    assert plain.softmax_scale == pytest.approx(32**-0.5)
    assert bench.kv_lora_rank + bench.qk_rope_head_dim == 80


def test_yarn_rope_equals_transformers():
    """YaRN's frequencies and its cos/sin attention factor, as transformers computes them (DeepSeek-V3's
    mscale ratio, and the plain factor when the config gives no mscale)."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope in (
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096},
    ):  # fmt: skip
        spec = load_spec("tiny-deepseek") | {"rope_scaling": rope}
        cfg = ModelConfig.from_dict(spec)
        theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](DeepseekV3Config(**spec), "cpu")
        ours = RotaryEmbedding(cfg.rope_dim, 8, cfg.rope_theta, yarn=cfg.rope_yarn)
        assert cfg.rope_yarn[4] == pytest.approx(factor)
        positions = torch.arange(8, dtype=torch.float32)
        want = torch.outer(positions, theirs.float())
        torch.testing.assert_close(ours.cos[:, : cfg.rope_dim // 2], want.cos() * factor)


def test_grouped_routing_equals_transformers_router():
    """noaux_tc: the experts transformers' DeepseekV3TopkRouter picks (the bias chooses, groups limit) and
    its weights (renormalised, scaled); the correction bias changes the choice without weighting it."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from kvferry.model.moe import Gating, grouped_route

    spec = load_spec("tiny-deepseek")
    cfg = ModelConfig.from_dict(spec)
    hf = DeepseekV3TopkRouter(DeepseekV3Config(**spec))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(8, 128, generator=gen))
        hf.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.3)
    x = torch.randn(64, 128, generator=gen) * 0.1
    _, want_w, want_ids = hf(x)
    got_w, got_ids = grouped_route(x, hf.weight.t(), hf.e_score_correction_bias, Gating.of(cfg))
    order_w, order_g = want_ids.sort(-1).indices, got_ids.sort(-1).indices
    assert torch.equal(want_ids.gather(1, order_w), got_ids.gather(1, order_g))
    torch.testing.assert_close(want_w.gather(1, order_w), got_w.gather(1, order_g))
    _, plain_ids = grouped_route(x, hf.weight.t(), torch.zeros(8), Gating.of(cfg))
    assert not torch.equal(plain_ids.sort(-1).values, got_ids.sort(-1).values)
    # every token's experts lie in its 2 chosen groups of 4 (2 experts each)
    assert all(len({int(e) // 2 for e in row}) <= 2 for row in got_ids)


def test_a_config_without_architectures_is_named_by_its_model_type():
    spec = load_spec("tiny-llama") | {"architectures": None}
    assert ModelConfig.from_dict(spec).architecture == "LlamaForCausalLM"
    moe = load_spec("tiny") | {"architectures": None}
    assert ModelConfig.from_dict(moe).architecture == "Qwen3MoeForCausalLM"


def test_llama3_rope_scaling_equals_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    spec = load_spec("tiny-llama")
    ours = llama3_inv_freq(
        1.0 / (spec["rope_theta"] ** (torch.arange(0, 32, 2, dtype=torch.int64).float() / 32)),
        *ModelConfig.from_dict(spec).rope_llama3,
    )
    theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**spec), "cpu")
    assert scale == 1.0
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    # and the scaling changes something: the long wavelengths are stretched
    plain = RotaryEmbedding(32, 64, spec["rope_theta"])
    scaled = RotaryEmbedding(32, 64, spec["rope_theta"], (8.0, 1.0, 4.0, 2048.0))
    assert not torch.equal(plain.cos, scaled.cos)
