"""`kvferry up` with vLLM's spellings of its flags, as a user coming from `vllm serve` types them:
several --served-model-name, --max-model-len, --max-num-seqs, --no-enable-prefix-caching,
--chat-template, --generation-config DIR, --uvicorn-log-level."""

from __future__ import annotations

import json
import urllib.request

import pytest
from cluster_helpers import kvferry_up, post

from kvferry.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow


def test_up_takes_vllms_flags(tiny_model_dir, tmp_path):
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}USER: {{ m['content'] }}\n{% endfor %}ASSISTANT:")
    flags = ["--served-model-name", "shown", "also", "--max-model-len", "512", "--max-num-seqs", "8"]
    flags += ["--no-enable-prefix-caching", "--chat-template", str(template)]
    flags += ["--generation-config", str(gen), "--uvicorn-log-level", "info", "--dtype", "float32"]
    with kvferry_up(tiny_model_dir, tmp_path / "logs", *flags) as up:
        with urllib.request.urlopen(up.api_url + "/models", timeout=10) as reply:
            (card,) = json.load(reply)["data"]
        assert card["id"] == "shown" and card["max_model_len"] == 512
        # every name is accepted; the first is the one shown
        code, reply = post(up.api_url + "/completions", {"model": "also", "prompt": "def f(x):"})
        assert code == 200 and reply["model"] == "shown", reply
        # the generation config's defaults for what the request left unset: greedy, 5 tokens
        assert reply["usage"]["completion_tokens"] == 5 and reply["choices"][0]["finish_reason"] == "length"
        code, again = post(up.api_url + "/completions", {"model": "shown", "prompt": "def f(x):"})
        assert again["choices"][0]["text"] == reply["choices"][0]["text"]
        code, capped = post(up.api_url + "/completions", {"prompt": "def f(x):", "max_tokens": 2})
        assert capped["usage"]["completion_tokens"] == 2  # a field the request sets wins
        # the chat template file renders the chat
        code, tokens = post(up.http_url + "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
        assert tokens["tokens"] == Tokenizer(tiny_model_dir).encode("USER: hi\nASSISTANT:")
        code, bad = post(up.api_url + "/completions", {"prompt": "x", "max_tokens": 600})
        assert code == 400 and "max_model_len is 512" in bad["error"]["message"]
    logs = "".join(up.lines)
    assert up.proc.returncode == 0, logs
