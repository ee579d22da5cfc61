"""kvferry: disaggregated prefill/decode LLM serving with a distributed KV pool."""

__version__ = "0.1.0"
