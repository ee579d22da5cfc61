"""The network: Qwen3-MoE config and checkpoint loading, layers over a paged KV cache, sampler."""
