"""The trained built-in model as a user makes and measures it: `kvferry model create trained` (the
real training run, minutes) and `kvferry eval`, whose held-out perplexity must be far below the seeded
model's on the same tokenizer and tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def kvferry(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", *argv], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_create_trained_then_eval(kvferry_cache):
    made = kvferry("model", "create", "trained", timeout=1800)
    model_dir = kvferry_cache / "models" / "trained"
    assert made.stdout.strip() == str(model_dir)
    assert "training" in made.stderr  # the progress bar
    record = json.loads((model_dir / "training.json").read_text())
    assert record["steps"] > 0 and record["heldout_loss"] < record["first_loss"] - 3, record

    def perplexity(model: str, *flags: str) -> dict:
        out = kvferry(
            "eval", "--model", model, "--max-eval-tokens", "4096", "--context", "256", *flags, timeout=600
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    trained, seeded = perplexity("trained"), perplexity("bench")
    assert trained["tokens_scored"] == seeded["tokens_scored"] == 4096 - 16  # 16 windows, first unscored
    # the seeded model is worse than guessing uniformly over its 8192 tokens; the trained one has learned
    # (measured on a 2-core AVX-512 Xeon: 68.6 against 2.0e7)
    assert seeded["perplexity"] > 8192
    assert trained["perplexity"] < 120, trained
    assert trained["nll_per_token"] == pytest.approx(record["heldout_loss"], abs=0.3)
    # int8 weights keep quality: within 2% of the default dtype's perplexity (measured: 1.0004x)
    int8 = perplexity("trained", "--quantization", "int8")
    assert int8["perplexity"] == pytest.approx(trained["perplexity"], rel=0.02), (int8, trained)
