"""bench/prefill_profile.py: the profile of a prefill step adds up to the step, group by group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "prefill_profile.py"


@pytest.mark.slow  # a subprocess that builds an engine and profiles it (~15 s)
def test_the_profile_accounts_for_the_profiled_step():
    run = subprocess.run(
        [sys.executable, str(BENCH), "--model", "tiny", "--rounds", "1", "--prompt-len", "32"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    parts = result["profile_ms"]
    assert result["prompt_len"] == 32 and result["profiled_ms"] > 0
    assert "dense projections" in parts and "engine Python (outside ops)" in parts
    assert abs(sum(parts.values()) - result["profiled_ms"]) <= 0.05 * result["profiled_ms"] + 0.1
    assert "prefill of 32 tokens" in run.stderr


def test_ops_fall_into_their_groups():
    sys.path.insert(0, str(BENCH.parent))
    from prefill_profile import group_of

    assert group_of("kvferry_cpu::packed_linear") == "dense projections"
    assert group_of("kvferry_cpu::moe_experts") == "MoE experts"
    assert group_of("kvferry_cpu::paged_prefill_attention") == "attention"
    assert group_of("kvferry_cpu::add_rms_norm") == "norms, RoPE, KV store"
    assert group_of("aten::empty") == "other ops"
