"""Conversions between the protobuf API and the engine's dataclasses (one place for the defaults)."""

from __future__ import annotations

import json
from collections.abc import Iterable

from kvferry.engine.request import SamplingParams
from kvferry.model.sampler import TokenLogprob
from kvferry.v1 import generate_pb2

DEFAULT_MAX_TOKENS = 16


def sampling_from_proto(p: generate_pb2.SamplingParams, defaults: dict | None = None) -> SamplingParams:
    """Proto -> SamplingParams, filling unset fields with `defaults` (the model's generation config: see
    `model.config.generation_defaults`), else the API defaults (not validated). top_k and min_p are unset
    at 0."""
    d = defaults or {}
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else d.get("max_tokens", DEFAULT_MAX_TOKENS),
        temperature=p.temperature if p.HasField("temperature") else d.get("temperature", 1.0),
        top_k=p.top_k or d.get("top_k", 0),
        top_p=p.top_p if p.HasField("top_p") else d.get("top_p", 1.0),
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        min_p=p.min_p or d.get("min_p", 0.0),
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=(
            p.repetition_penalty if p.HasField("repetition_penalty") else d.get("repetition_penalty", 1.0)
        ),
        min_tokens=p.min_tokens,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        allowed_token_ids=tuple(p.allowed_token_ids),
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        structured=structured_from_proto(p.structured) if p.HasField("structured") else None,
        n=max(p.n, 1),
    )


def structured_from_proto(p: generate_pb2.StructuredOutput) -> tuple[str, str] | None:
    """(kind, value) of engine.structured; None when no kind is set."""
    kind = p.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return (kind, "") if p.json_object else None
    if kind == "choice":
        return kind, json.dumps(list(p.choice.choices))
    return kind, getattr(p, kind)


def structured_to_proto(kind: str, value: str) -> generate_pb2.StructuredOutput:
    if kind == "json_object":
        return generate_pb2.StructuredOutput(json_object=True)
    if kind == "choice":
        return generate_pb2.StructuredOutput(choice=generate_pb2.Choices(choices=json.loads(value)))
    return generate_pb2.StructuredOutput(**{kind: value})


def sampling_to_proto(s: SamplingParams) -> generate_pb2.SamplingParams:
    out = generate_pb2.SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        max_tokens=s.max_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        min_tokens=s.min_tokens,
        logit_bias=dict(s.logit_bias),
        allowed_token_ids=list(s.allowed_token_ids),
        include_stop_str_in_output=s.include_stop_str_in_output,
    )
    if s.seed is not None:
        out.seed = s.seed
    if s.logprobs is not None:
        out.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        out.prompt_logprobs = s.prompt_logprobs
    if s.structured is not None:
        out.structured.CopyFrom(structured_to_proto(*s.structured))
    if s.n > 1:
        out.n = s.n
    return out


def logprob_to_proto(lp: TokenLogprob) -> generate_pb2.TokenLogprob:
    ids, values = zip(*lp.top, strict=True) if lp.top else ((), ())
    return generate_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top_ids=ids, top_logprobs=values
    )


def logprobs_to_proto(lps: Iterable[TokenLogprob]) -> list[generate_pb2.TokenLogprob]:
    return [logprob_to_proto(lp) for lp in lps]


def logprob_from_proto(p: generate_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(p.token_id, p.logprob, p.rank, list(zip(p.top_ids, p.top_logprobs, strict=True)))
