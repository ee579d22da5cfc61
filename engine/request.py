"""A request's state: its tokens, its place in the KV cache and its sampling settings."""

from __future__ import annotations

import enum
import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvferry.model.sampler import SamplingSpec

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")  # engine.structured
MAX_LOGPROBS = 20  # top alternatives per token at most (vLLM's default --max-logprobs is 20)
MAX_N = 64  # sequences per request (n, best_of)


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as asked (the message names the field)."""


class RequestStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is finished."""

    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1  # its prompt KV is being computed or pulled elsewhere
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # it could not go on as asked (its structured output failed): `Request.error` says why

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS, stop ids and stop strings do not end the output before this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token
    logprobs: int | None = None  # per output token: None none, 0 the sampled token's, k and the top k
    prompt_logprobs: int | None = None  # per prompt token (the first has none), as `logprobs`
    include_stop_str_in_output: bool = False
    structured: tuple[str, str] | None = None  # (kind, value): the output follows it (engine.structured)
    n: int = 1  # first tokens drawn from the prompt's logits (the rest: Request.sibling_samples)

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # also false for NaN
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a tuple of non-empty strings")
        if not isinstance(self.stop_token_ids, tuple) or any(type(t) is not int for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be a tuple of integers")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 100.0:  # also false for NaN
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}"
            )
        if type(self.min_tokens) is not int or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for token, bias in self.logit_bias:
            if type(token) is not int or not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(
                    f"logit_bias must map token ids to numbers in [-100, 100], got {token!r}: {bias!r}"
                )
        if any(type(t) is not int for t in self.allowed_token_ids):
            raise InvalidRequestError("allowed_token_ids must be integers")
        if type(self.n) is not int or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.structured is not None:
            kind, value = self.structured
            if kind not in STRUCTURED_KINDS or not isinstance(value, str):
                raise InvalidRequestError(
                    f"structured must be one of {', '.join(STRUCTURED_KINDS)} with a text, got {kind!r}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @cached_property  # (frozen: built once, not at each step of each request)
    def spec(self) -> SamplingSpec:
        return SamplingSpec(
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.logit_bias,
            self.allowed_token_ids,
            self.logprobs,
        )


def validate_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    *,
    prompt_field: str = "prompt_token_ids",
    sampling_field: str = "",
    max_tokens_fit: bool = False,
) -> list[int]:
    """The one check of a request against a model, run by the router (on the API's field names) and
    by the engine (on every request it is given): the prompt's ids as a list of ints, or an
    InvalidRequestError naming the field. `max_tokens_fit`: max_tokens must fit in max_model_len (the
    router's API contract); without it the engine ends a request at max_model_len with "length"."""
    try:
        params.validate()
    except InvalidRequestError as err:
        raise InvalidRequestError(f"{sampling_field}{err}") from None
    try:
        ids = [operator.index(t) for t in prompt_token_ids]
    except TypeError:
        raise InvalidRequestError(f"{prompt_field} must be integers") from None
    if not ids:
        raise InvalidRequestError(f"{prompt_field} must not be empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"{prompt_field} must lie in [0, {vocab_size}); got {bad[0]}")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(ids)} tokens; max_model_len is {max_model_len}, leaving no room to generate"
        )
    room = max_model_len - len(ids)
    if max_tokens_fit and params.max_tokens > room:
        raise InvalidRequestError(
            f"{sampling_field}max_tokens {params.max_tokens} is over the limit: the prompt has {len(ids)} "
            f"tokens and max_model_len is {max_model_len}, so at most {room} can be generated"
        )
    for name, tokens in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("allowed_token_ids", params.allowed_token_ids),
    ):
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"{sampling_field}{name} must lie in [0, {vocab_size}); got {bad[0]}")
    return ids


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower first (vLLM's semantics): the scheduler's order, and who is preempted for whom
    arrival_seq: int = -1  # its arrival at the scheduler (engine.scheduler), kept through preemption
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # keys of the full blocks so far
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    num_committed_blocks: int = 0  # leading blocks full of KV, taken from or offered to the prefix cache
    generator: torch.Generator | None = None
    # the last `output_offset` tokens of prompt_token_ids were generated (a stream resumed on another
    # worker): the penalties count them as outputs (max_tokens and min_tokens were cut by as many)
    output_offset: int = 0
    banned_until_min: tuple[int, ...] = ()  # EOS and stop ids, banned while outputs < min_tokens
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob per prompt token from the 2nd on
    output_logprobs: list = field(default_factory=list)  # TokenLogprob per output token (when asked)
    salt_key: bytes | None = None  # the parent of its first block key (engine.block_hash.salt_key)
    matcher: object | None = None  # its structured output's llguidance matcher (engine.structured)
    error: str = ""  # why it ended FINISHED_ERROR (set as the token that failed is added)
    sibling_samples: list = field(default_factory=list)  # params.n > 1: the other first tokens (Sampled)
    spec_tokens: list[int] = field(default_factory=list)  # this step's draft tokens (engine.spec_decode)
    # a model with an MTP layer: (position, the target's final hidden state there) of its last accepted
    # token, what the next step's MTP cache row and the MTP proposer start from (`engine.model_runner`)
    mtp_hidden: tuple[int, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.params.temperature > 0 and self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, count: int) -> list[int]:
        """all_token_ids[start : start + count] without copying the whole sequence."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : start - prompt_len + count]
        if start + count <= prompt_len:
            return self.prompt_token_ids[start : start + count]
        return self.all_token_ids[start : start + count]

    @property
    def generated(self) -> list[int]:
        """Every token generated for this request (outputs of earlier workers included)."""
        if not self.output_offset:
            return self.output_token_ids
        return self.prompt_token_ids[-self.output_offset :] + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
