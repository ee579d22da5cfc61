"""lm-evaluation-harness (`lm_eval --model local-completions`), a client nobody here wrote, against
`kvferry up`: a multiple-choice loglikelihood task and a generate_until task from local JSON data
(tests/lm_eval_tasks). It runs to completion on the server's own tokenizer (/tokenizer_info, /tokenize,
/detokenize), and every loglikelihood it logs is the one transformers computes for the same checkpoint
and text (float32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cluster_helpers import kvferry_up

from kvferry.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TASKS = Path(__file__).resolve().parent.parent / "lm_eval_tasks"
NAME = "kvferry-tiny"
# summed over a continuation's tokens: float32 logits of two implementations, a few tokens each
LOGLIKELIHOOD_TOL = 1e-3


def loglikelihood(hf, tokenizer: Tokenizer, context: str, continuation: str) -> float:
    """log P(continuation | context) with the tokens lm-eval sends: the context's trailing whitespace
    moved to the continuation, the context encoded alone, the continuation as what the whole adds."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    head = tokenizer.encode(context)
    tokens = head + tokenizer.encode(context + continuation)[len(head) :]
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
    return sum(logp[i - 1, tokens[i]].item() for i in range(len(head), len(tokens)))


@pytest.mark.timeout(900)  # `kvferry up` has 240 s to be ready, lm-eval 600 s to run
def test_lm_eval_runs_and_its_loglikelihoods_equal_transformers(tiny_model_dir, tmp_path):
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM

    with kvferry_up(
        tiny_model_dir, tmp_path / "logs", "--dtype", "float32", "--served-model-name", NAME
    ) as up:
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
        out = tmp_path / "lm-eval"
        argv = [sys.executable, "-m", "lm_eval", "--model", "local-completions"]
        argv += [
            "--model_args",
            f"model={NAME},base_url={up.api_url}/completions,num_concurrent=2,max_retries=1",
        ]
        argv += ["--tasks", "kvferry_mc,kvferry_gen", "--include_path", str(TASKS)]
        argv += ["--output_path", str(out), "--log_samples", "--batch_size", "1"]
        done = subprocess.run(argv, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    print(done.stdout)  # the results table (shown with -s)
    assert "kvferry_mc" in done.stdout and "kvferry_gen" in done.stdout
    assert "Using remote tokenizer backend" in done.stderr or "remote" in done.stderr.lower()
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = Tokenizer(tiny_model_dir)
    checked = 0
    for path in out.rglob("samples_kvferry_mc*.jsonl"):
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
                context, continuation = args["arg_0"], args["arg_1"]
                got = float(resp[0][0])
                assert got == pytest.approx(
                    loglikelihood(hf, tokenizer, context, continuation), abs=LOGLIKELIHOOD_TOL
                )
                checked += 1
    assert checked >= 8 * 3  # every choice of every question
    generated = [
        json.loads(line)
        for p in out.rglob("samples_kvferry_gen*.jsonl")
        for line in p.read_text().splitlines()
    ]
    assert len(generated) == 4 and all(isinstance(s["resps"][0][0], str) for s in generated)
