"""Which checkpoints kvferry serves (`model.config.ARCHITECTURES`), what each one's config turns on, and
the clear refusal of the rest: a field kvferry cannot honour is an error naming it, never ignored."""

from __future__ import annotations

import pytest
import torch

from kvferry.model.config import ModelConfig, ModelConfigError
from kvferry.model.create import load_spec
from kvferry.model.layers import RotaryEmbedding, llama3_inv_freq


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
        (
            {"architectures": ["DeepseekV3ForCausalLM"]},
            "architectures='DeepseekV3ForCausalLM' is not supported",
        ),
        ({"architectures": ["MistralForCausalLM"]}, "kvferry serves Qwen3MoeForCausalLM, Qwen3ForCausalLM"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not supported"),
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
