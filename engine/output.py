"""Per-request output state: incremental text, stop checks, and the deltas a stream yields."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.engine.request import Request, RequestStatus
from kvferry.engine.structured import first_line
from kvferry.model.sampler import TokenLogprob
from kvferry.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    """One streamed increment; the last one for a request has finished=True and a finish_reason."""

    request_id: str
    new_token_ids: list[int]
    text: str  # text increment
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # one per new token when the request asks for logprobs
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # on a request's first output, when it asks for them: one per prompt token from the second on
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str = ""  # finish_reason "error": why (the request's output is not to be used as done)


@dataclass
class Completion:
    """A whole finished request."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "prompt_token_ids": self.prompt_token_ids,
            "output_token_ids": self.output_token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "num_cached_tokens": self.num_cached_tokens,
        }


class OutputState:
    """Detokenizes a request's tokens and decides when it stops.

    Text that could still turn out to be the start of a stop string is held back from the stream, so a
    client never receives characters that the final text does not contain.
    """

    def __init__(self, req: Request, tokenizer: Tokenizer, eos_ids: tuple[int, ...], max_model_len: int):
        self.req = req
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids) if tokenizer else None
        self.stop_ids = set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else set(eos_ids))
        self.holdback = max((len(s) for s in req.params.stop), default=1) - 1
        self.max_model_len = max_model_len
        self.text = ""
        self.sent_chars = 0
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs_sent = req.params.prompt_logprobs is None
        if req.params.min_tokens:
            req.banned_until_min = tuple(sorted(self.stop_ids))

    def add_token(self, token: int, logprob: TokenLogprob | None = None) -> RequestStatus | None:
        """Append a sampled token (and its logprob, when the request asks for them); return the finished
        status it causes, if any."""
        req = self.req
        matcher = req.matcher
        if matcher is not None and (not matcher.consume_token(token) or matcher.is_error()):
            # past its grammar's budget (engine.structured.LIMITS; a mask that failed allowed only EOS),
            # or a token it does not allow: the request ends in error (without that token) rather than
            # with text its constraint does not match
            why = first_line(matcher.get_error()) or f"token {token} is not allowed"
            req.error = f"the structured output failed at output token {len(req.output_token_ids)}: {why}"
            return RequestStatus.FINISHED_ERROR
        req.output_token_ids.append(token)
        self.pending_ids.append(token)
        if logprob is not None and req.params.logprobs is not None:
            self.pending_logprobs.append(logprob)
            req.output_logprobs.append(logprob)
        # before min_tokens, no stop rule applies (the sampler never picks a stop id then)
        stops = len(req.output_token_ids) >= req.params.min_tokens
        if stops and token in self.stop_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.detok is not None:
            delta = self.detok.add(token)
            if delta and stops and req.params.stop and self._cut_at_stop(delta):
                return RequestStatus.FINISHED_STOPPED
            self.text += delta
        if matcher is not None and matcher.is_stopped():  # the structured output is complete
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _cut_at_stop(self, delta: str) -> bool:
        candidate = self.text + delta
        window = max(0, len(self.text) - self.holdback)
        hits = [i for s in self.req.params.stop if (i := candidate.find(s, window)) >= 0]
        if not hits:
            return False
        at = min(hits)
        if self.req.params.include_stop_str_in_output:
            at += len(next(s for s in self.req.params.stop if candidate.find(s, window) == at))
        self.text = candidate[:at]
        return True

    def emit(self) -> RequestOutput:
        req = self.req
        finished = req.status.is_finished
        visible = len(self.text) if finished else max(self.sent_chars, len(self.text) - self.holdback)
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=self.pending_ids,
            text=self.text[self.sent_chars : visible],
            finished=finished,
            finish_reason=req.status.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=self.pending_logprobs,
            error=req.error,
        )
        if not self.prompt_logprobs_sent:
            out.prompt_logprobs = req.prompt_logprobs
            self.prompt_logprobs_sent = True
        self.sent_chars = visible
        self.pending_ids = []
        self.pending_logprobs = []
        return out

    def completion(self) -> Completion:
        req = self.req
        return Completion(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            text=self.text,
            finish_reason=req.status.finish_reason,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=req.output_logprobs if req.params.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
        )
