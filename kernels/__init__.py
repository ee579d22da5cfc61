"""Triton kernels for the GPU path, each beside its torch reference (built in a later issue)."""
