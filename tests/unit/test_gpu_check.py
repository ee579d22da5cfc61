"""bench/gpu_check.py on a machine without CUDA: it says so, skips what needs a GPU, still prints its JSON
line and report, and with TRITON_INTERPRET=1 runs the Triton kernels' parity checks under the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
KERNELS = ("decode_attention", "prefill_attention", "moe_route", "fused_moe", "w8a8", "pack_unpack")

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the no-CUDA paths (a GPU runs the real check)"
)


def gpu_check(out_dir: Path, *args: str, interpret: bool) -> tuple[list[str], dict]:
    """Run the script with $OUT = out_dir; (its stdout lines, the JSON of the last one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest sets it for itself
    env["OUT"] = str(out_dir)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=out_dir,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert json.loads((out_dir / "gpu_check.json").read_text()) == result  # --out defaults into $OUT
    assert (out_dir / "gpu_check_report.md").read_text().startswith("# gpu_check report")
    return lines, result


def test_without_cuda_everything_is_skipped(tmp_path):
    lines, result = gpu_check(tmp_path, interpret=False)
    assert "gpu_check: no CUDA device (torch.cuda.is_available() is False)" in lines
    assert result["cuda"] is False and result["ok"] is None
    assert result["triton"].startswith("skipped: no CUDA")
    assert result["engine"] == result["handoff"] == "skipped: no CUDA"
    assert result["nccl"] == "skipped: needs 2 GPUs (found 0)"
    env = result["env"]
    assert env["torch"] == torch.__version__ and isinstance(env["amx"], bool) and "cpu_model" in env


def test_triton_parity_under_the_interpreter(tmp_path):
    lines, result = gpu_check(tmp_path, "--sections", "triton", interpret=True)
    assert lines[0] == "gpu_check: no CUDA device (torch.cuda.is_available() is False)"
    assert result["engine"] == result["handoff"] == result["nccl"] == "skipped: not in --sections"
    triton = result["triton"]
    assert triton["interpreter"] is True and triton["speed"].startswith("omitted")
    assert "error" not in triton and triton["ok"] is True and result["ok"] is True
    assert sorted(triton["kernels"]) == sorted(KERNELS)
    for kernel, entries in triton["kernels"].items():
        assert entries, kernel
        for entry in entries:
            assert entry["ok"] is True and "error" not in entry and "skipped" not in entry, (kernel, entry)
            assert "triton_ms" not in entry  # no speed figures under the interpreter
            if kernel == "pack_unpack":
                assert entry["bit_exact"] is True
            else:
                assert entry["max_abs_err"] <= entry["atol"], (kernel, entry)
    w8a8 = triton["kernels"]["w8a8"]
    assert all(e["bit_exact"] for e in w8a8)
