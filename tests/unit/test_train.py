"""The trained built-in model's pieces: the corpus split, the training network (HF's numerics), a short
training run (it learns, deterministically), and held-out perplexity through the engine."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from kvferry.model.config import ModelConfig
from kvferry.model.corpus import corpus_files, token_stream
from kvferry.model.create import create_from_spec, load_spec, train_tokenizer, training_spec
from kvferry.model.train import TrainConfig, forward, rope_tables


def test_corpus_split_is_disjoint_and_stable():
    train, heldout = corpus_files("train"), corpus_files("heldout")
    assert heldout and len(train) > 10 * len(heldout)
    assert not set(train) & set(heldout)
    assert corpus_files("heldout") == heldout
    assert not any("site-packages" in p.parts or "test" in p.parts for p in train + heldout)
    with pytest.raises(ValueError, match="split must be one of"):
        corpus_files("validation")


def test_token_stream_stops_at_the_budget():
    tok = train_tokenizer(512)
    longer = token_stream(tok, "heldout", eos_id=0, max_tokens=200_000)
    assert token_stream(tok, "heldout", eos_id=0, max_tokens=5000) == longer[:5000]
    assert longer.count(0) >= 2  # files are joined by the eos id


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "second_model_dir"])
def test_training_network_matches_transformers(request, fixture, hf_log_softmax):
    model_dir = request.getfixturevalue(fixture)
    cfg = ModelConfig.from_dir(model_dir)
    weights = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        weights |= {k: v.float() for k, v in load_file(str(path)).items()}
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    rope = rope_tables(cfg.head_dim, 64, cfg.rope_theta)
    logits, balance = forward(weights, cfg, torch.tensor([ids]), rope)
    ours = torch.log_softmax(logits[0], -1)
    torch.testing.assert_close(ours, hf_log_softmax(model_dir, ids), atol=2e-4, rtol=1e-4)
    assert balance.item() >= 0.99 * (cfg.num_layers - len(cfg.mlp_only_layers))  # >= 1 per MoE layer


def _short_run(out, steps: int = 12):
    spec = dict(load_spec("tiny"), torch_dtype="float32")
    settings = dict(training_spec("trained"), steps=steps, batch_size=4, seq_len=64, warmup_steps=3)
    settings |= {"threads": 1, "eval_windows": 2, "max_train_tokens": 40_000}
    return create_from_spec(spec, out, seed=5, training=settings)


def test_a_short_training_run_learns_and_is_deterministic(tmp_path):
    import json

    first, second = _short_run(tmp_path / "a"), _short_run(tmp_path / "b")
    record = json.loads((first / "training.json").read_text())
    assert record["steps"] == 12 and record["tokens_seen"] == 12 * 4 * 64
    assert record["final_train_loss"] < record["first_loss"] - 0.3, record
    assert math.isfinite(record["heldout_loss"])
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    seeded = create_from_spec(dict(load_spec("tiny"), torch_dtype="float32"), tmp_path / "c", seed=5)
    assert (first / "model.safetensors").read_bytes() != (seeded / "model.safetensors").read_bytes()


def test_train_config_refuses_unknown_settings():
    with pytest.raises(ValueError, match="unknown training settings: stepz"):
        TrainConfig.from_dict({"stepz": 3})


def test_eval_perplexity_is_the_reference_nll(tiny_model_dir, hf_log_softmax):
    from kvferry.engine.engine import EngineConfig, LLMEngine
    from kvferry.evaluate import heldout_tokens, perplexity

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    tokens = heldout_tokens(engine, 100)
    result = perplexity(engine, tokens, context=40)
    assert result["windows"] == 3 and result["tokens_scored"] == 39 + 39 + 19
    nll = 0.0
    for at in range(0, 100, 40):
        window = tokens[at : at + 40]
        ref = hf_log_softmax(tiny_model_dir, window)
        nll -= sum(ref[i, window[i + 1]].item() for i in range(len(window) - 1))
    assert result["nll_per_token"] == pytest.approx(nll / 97, rel=1e-4)
    assert result["perplexity"] == pytest.approx(math.exp(nll / 97), rel=1e-3)
    with pytest.raises(ValueError, match="context must be in"):
        perplexity(engine, tokens, context=1)


def test_eval_command_names_a_bad_context(tiny_model_dir, capsys):
    from kvferry.cli import main

    assert main(["eval", "--model", str(tiny_model_dir), "--context", "1", "--max-eval-tokens", "64"]) == 2
    assert "context must be in [2, " in capsys.readouterr().err
