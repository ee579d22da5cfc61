"""Kernels for the hot ops, each beside its torch reference: C++ CPU kernels (`cpu.py`, built on first
use), the paged decode attention contract (`paged_attention.py`), and Triton kernels for the GPU path
(`triton_attention.py`: paged decode and chunked-prefill attention; `triton_moe.py`: top-k routing,
sorted expert alignment, fused grouped-GEMM MoE, expert-parallel dispatch layout; `triton_pack.py`: KV
block pack/unpack). The Triton modules import triton at the top: import them only on CUDA, or on CPU
tensors under TRITON_INTERPRET=1 (tests/unit/test_triton_kernels.py); `select.py` picks the kernels."""
