"""Prefill workers: tensor-parallel prefill that writes KV blocks to the pool (built in a later issue)."""
