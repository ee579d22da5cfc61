"""Conversions between the protobuf API and the engine's dataclasses (one place for the defaults)."""

from __future__ import annotations

from kvferry.engine.request import SamplingParams
from kvferry.v1 import generate_pb2

DEFAULT_MAX_TOKENS = 16


def sampling_from_proto(p: generate_pb2.SamplingParams) -> SamplingParams:
    """Proto -> SamplingParams, filling unset optional fields with the API defaults (not validated)."""
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_k=p.top_k,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )


def sampling_to_proto(s: SamplingParams) -> generate_pb2.SamplingParams:
    out = generate_pb2.SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        max_tokens=s.max_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )
    if s.seed is not None:
        out.seed = s.seed
    return out
