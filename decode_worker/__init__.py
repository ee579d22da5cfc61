"""Decode worker: the continuous-batching engine (single-process today; decode mode in a later issue)."""
