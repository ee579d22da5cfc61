"""Which kernels serve a model: decided here, once per engine, from its device, dtype and `--kernels`.

- `cpu`: the C++ CPU kernels (`cpu.py`; float32, or bfloat16 where the CPU has AVX512-BF16), built on
  first use: the fastest CPU path.
- `triton`: the Triton kernels (`triton_attention.py`, `triton_moe.py`, `triton_pack.py`) on CUDA:
  paged decode and prefill attention, fused MoE with top-k routing, KV block pack/unpack. Forced on a
  CPU with `--kernels triton` it runs them under `TRITON_INTERPRET=1` (slow; the parity check).
- `torch`: plain torch ops on any device (the references the kernels are tested against).

`--kernels auto` picks triton on CUDA (when triton imports), cpu on a CPU where the C++ kernels serve
the dtype, torch otherwise. The engine logs its choice and workers report it (`WorkerInfo.kernels`, the
router's `GetModelInfo`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

KERNEL_CHOICES = ("auto", "torch", "triton")


class KernelsUnavailable(RuntimeError):
    """`--kernels triton` where the Triton kernels cannot run."""


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_runs_on(device: torch.device) -> bool:
    """Triton kernels run on CUDA, or on CPU tensors under the interpreter."""
    return triton_installed() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def choose(device: torch.device, dtype: torch.dtype, kernels: str = "auto") -> str:
    """'cpu', 'triton' or 'torch' for a model of `dtype` on `device` (see the module docstring)."""
    if kernels == "torch":
        return "torch"
    if kernels == "triton":
        if not triton_runs_on(device):
            why = "triton is not installed" if not triton_installed() else "set TRITON_INTERPRET=1 on a CPU"
            raise KernelsUnavailable(f"--kernels triton on {device.type}: {why}")
        return "triton"
    if device.type == "cuda" and triton_installed():
        return "triton"
    return "cpu" if cpu_kernels_serve(dtype, device) else "torch"


def cpu_kernels_serve(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the C++ CPU kernels serve a model of `dtype` on `device`: float32 where they build,
    bfloat16 where they also have the bf16 dot product (AVX512-BF16)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    from kvferry.kernels import cpu

    return cpu.load() and (dtype == torch.float32 or cpu.bf16_dot())


def triton_pack_ops(device: torch.device):
    """(pack_blocks, unpack_blocks) of the Triton kernels for a paged cache on `device` (CUDA, triton
    installed: one launch for any block ids and KV-head slice), else None: `kvpool.transfer`'s strided
    torch copies serve it (on a CPU a copy_ per run of blocks is already memory-bound)."""
    if device.type != "cuda" or not triton_installed():
        return None
    from kvferry.kernels import triton_pack

    return triton_pack.pack_blocks, triton_pack.unpack_blocks
