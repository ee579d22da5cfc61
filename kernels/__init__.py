"""Kernels for the hot ops, each beside its torch reference: C++ CPU kernels (`cpu.py`, built on first
use) and the paged decode attention contract (`paged_attention.py`)."""
