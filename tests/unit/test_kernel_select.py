"""kernels.select: the one place that picks the kernels a model runs on, per device, dtype and flag."""

from __future__ import annotations

import pytest
import torch

from kvferry.kernels import cpu, select
from kvferry.kernels.select import KernelsUnavailable, choose

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_picks_the_fastest_path_of_each_device():
    native = "cpu" if cpu.load() else "torch"
    assert choose(CPU, torch.float32) == native
    assert choose(CPU, torch.float16) == "torch"  # the C++ kernels serve float32 (and bf16 with AVX512-BF16)
    assert choose(CPU, torch.float32, "torch") == "torch"
    expected = "triton" if select.triton_installed() else "torch"
    assert choose(CUDA, torch.bfloat16) == expected  # no C++ kernels on CUDA


def test_triton_on_a_cpu_only_under_the_interpreter(monkeypatch):
    if not select.triton_installed():
        with pytest.raises(KernelsUnavailable, match="triton is not installed"):
            choose(CPU, torch.float32, "triton")
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose(CPU, torch.float32, "triton") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(KernelsUnavailable, match="TRITON_INTERPRET=1"):
        choose(CPU, torch.float32, "triton")


def test_block_pack_uses_the_triton_kernel_only_for_a_cache_on_cuda():
    assert select.triton_pack_ops(CPU) is None  # torch's strided copies
    ops = select.triton_pack_ops(CUDA)
    assert (ops is not None) == select.triton_installed()
