"""The OpenAI request and response shapes, and their conversion to and from the public gRPC messages.

Requests are validated in two steps: their shape here (pydantic: types, fields kvferry does not
serve), then every value by the router's own admission (`Router.admit`), exactly as a gRPC request
is. Sampling fields keep their gRPC names (temperature, top_p, top_k, seed, max_tokens, stop,
stop_token_ids, ignore_eos: vLLM's extensions included), so a message that names a field names the
OpenAI field too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from kvferry.engine.request import InvalidRequestError
from kvferry.v1 import generate_pb2

INT32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]  # what the gRPC messages carry

# Fields of the OpenAI API that kvferry does not implement: accepted at their neutral value (what
# clients such as `vllm bench serve` send by default), refused with a 400 naming them otherwise. A field
# that would change the output is never accepted and ignored.
NEUTRAL = {
    "echo": (None, False),  # (a completions field: the chat API has none)
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "bad_words": (None, []),
    "prompt_embeds": (None,),
    "truncate_prompt_tokens": (None,),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as vLLM does

    model: str | None = None
    max_tokens: INT32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: INT32 | None = None  # vLLM extension; -1 or 0 = off
    seed: Annotated[int, Field(ge=0, le=2**64 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[INT32] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    n: int = 1
    min_p: float | None = None  # vLLM extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    min_tokens: INT32 | None = None  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    allowed_token_ids: list[INT32] | None = None  # vLLM extension
    include_stop_str_in_output: bool = False  # vLLM extension
    prompt_logprobs: INT32 | None = None  # vLLM extension
    cache_salt: str | None = None  # vLLM extension: only requests with the same salt share cached prefixes
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False  # vLLM extension: each choice carries its token ids

    def check_supported(self) -> None:
        given = self.model_extra or {}  # NEUTRAL's fields are not declared: they arrive as extras
        for name, neutral in NEUTRAL.items():
            value = given.get(name)
            if not any(value == v and type(value) is type(v) for v in neutral):
                raise InvalidRequestError(f"{name}={value!r} is not supported by kvferry")
        if self.n != 1:
            raise InvalidRequestError(f"n must be 1 (one choice per prompt), got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_tokens: int | None) -> generate_pb2.SamplingParams:
        """The request's sampling fields as the gRPC API takes them (values checked at admission)."""
        p = generate_pb2.SamplingParams(ignore_eos=self.ignore_eos)
        if max_tokens is not None:
            p.max_tokens = max_tokens
        if self.temperature is not None:
            p.temperature = self.temperature
        if self.top_p is not None:
            p.top_p = self.top_p
        if self.top_k is not None:
            p.top_k = 0 if self.top_k == -1 else self.top_k
        if self.seed is not None:
            p.seed = self.seed
        p.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop or [])
        p.stop_token_ids.extend(self.stop_token_ids or [])
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
            if getattr(self, name) is not None:
                setattr(p, name, getattr(self, name))
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}") from None
            if not -(2**31) <= token < 2**31:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}")
            p.logit_bias[token] = bias
        p.allowed_token_ids.extend(self.allowed_token_ids or [])
        p.include_stop_str_in_output = self.include_stop_str_in_output
        if self.output_logprobs is not None:
            p.logprobs = self.output_logprobs
        if self.prompt_logprobs is not None:
            p.prompt_logprobs = self.prompt_logprobs
        return p

    @property
    def output_logprobs(self) -> int | None:
        """The top alternatives per output token asked for (None: no logprobs)."""
        return None


class CompletionRequest(_Common):
    prompt: str | list[INT32] | list[str] | list[list[INT32]]
    logprobs: INT32 | None = None  # the top alternatives per token (0: the sampled token's only)
    echo: bool = False  # the prompt comes first in each choice (its logprobs too, with `logprobs`)

    @property
    def output_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        """One prompt per choice: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty")
        if all(isinstance(x, int) for x in prompt):
            return [prompt]
        return list(prompt)

    def generate_requests(self, request_id: str) -> list[generate_pb2.GenerateRequest]:
        self.check_supported()
        max_tokens = self.max_tokens  # unset: the generation config's max_new_tokens, else OpenAI's 16
        if max_tokens == 0 and self.echo:  # the prompt only (lm-eval's loglikelihood): one token is made
            max_tokens = 1  # and left out of the answer (ResponseShape.drop_output)
        sampling = self.sampling(max_tokens)
        if self.echo_logprobs and not sampling.HasField("prompt_logprobs"):
            sampling.prompt_logprobs = self.logprobs
        out = []
        for i, prompt in enumerate(self.prompts()):
            req = generate_pb2.GenerateRequest(
                request_id=f"{request_id}-{i}", sampling=sampling, cache_salt=self.cache_salt or ""
            )
            if isinstance(prompt, str):
                req.text = prompt
            else:
                req.token_ids.ids.extend(prompt)
            out.append(req)
        return out


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None

    def as_template_input(self, index: int) -> dict:
        content = self.content
        if isinstance(content, list):  # parts: only text parts can be served by a text model
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"messages[{index}].content: only text parts are supported, got {part.get('type')!r}"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: INT32 | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    logprobs: bool = False
    top_logprobs: INT32 | None = None

    @property
    def output_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict:
        """chat_template_kwargs, less the names the template's own arguments take."""
        kwargs = dict(self.chat_template_kwargs or {})
        for name in ("messages", "add_generation_prompt"):
            if name in kwargs:
                raise InvalidRequestError(
                    f"chat_template_kwargs.{name}: set by the request itself, not a template argument"
                )
        return kwargs

    @property
    def max_new_tokens(self) -> int | None:
        """None: as many as fit (the chat API has no fixed default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.as_template_input(i) for i, m in enumerate(self.messages)]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # (the prompts of the completion APIs get none)


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[INT32]


# -- responses ------------------------------------------------------------------------------------------
def usage(finished: list[generate_pb2.Finished]) -> dict:
    prompt = sum(f.prompt_tokens for f in finished)
    completion = sum(f.output_tokens for f in finished)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in finished)},
    }


def timings(finished: generate_pb2.Finished) -> dict:
    """The per-phase times of the gRPC `Finished` message (ms), plus where the prompt's KV came from."""
    t = finished.timings
    out = {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields}
    out["cached_tokens"] = finished.cached_tokens
    out["pool_cached_tokens"] = finished.pool_cached_tokens
    return out


LOGPROB_FLOOR = -9999.0  # -inf is not JSON: vLLM's floor


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


@dataclass
class Echo:
    """A choice's prompt as `echo` puts it before the output: its text and tokens."""

    text: str
    token_ids: list[int]


class Logprobs:
    """Renders tokens and their logprobs (`generate_pb2.TokenLogprob`) in the API's shapes; the token
    strings are each token decoded alone, as vLLM does."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer, self.top = tokenizer, top
        self.offset = 0  # text_offset of the next completion token, per choice (see `completion`)

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, token_ids, logprobs, offset: int) -> tuple[dict, int]:
        """The completions API's `logprobs` of these tokens (a None logprob: the prompt's first token),
        and the text offset after them."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            text = self.token(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_lp(lp.logprob))
            top = {text: _lp(lp.logprob)}
            for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
                top.setdefault(self.token(i), _lp(v))
            out["top_logprobs"].append(top)
        return out, offset

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    def chat(self, logprobs) -> list[dict]:
        """The chat API's `logprobs.content` entries of these tokens."""
        out = []
        for lp in logprobs:
            entry = self._entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [
                self._entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
            ][: self.top]
            out.append(entry)
        return out

    def prompt(self, token_ids, logprobs) -> list:
        """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank,
        decoded_token}} with the token itself and its top alternatives."""
        out: list = [None]
        for token_id, lp in zip(token_ids[1:], logprobs, strict=False):
            entry = {str(token_id): {"logprob": _lp(lp.logprob), "rank": lp.rank}}
            for rank, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
                entry.setdefault(str(i), {"logprob": _lp(v), "rank": rank})
            for tid, item in entry.items():
                item["decoded_token"] = self.token(int(tid))
            out.append(entry)
        return out


@dataclass
class ChoiceState:
    """What a choice has produced so far (the whole response is built from it)."""

    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    finished: generate_pb2.Finished | None = None
    started: bool = False
    offset: int = 0  # text_offset of the next token (completions logprobs)


class ResponseShape:
    """Builds the chunks and the whole response of one completion or chat completion.

    `logprobs`: the top alternatives per token asked for (None: no logprobs); `prompts`: each choice's
    prompt (given when `echo` puts it before the output or `prompt_logprobs` are asked for);
    `drop_output`: echo with max_tokens 0 (the one token made is left out); `prompt_logprobs`: vLLM's
    per-prompt-token logprobs field is filled.
    """

    def __init__(
        self,
        chat: bool,
        response_id: str,
        model: str,
        return_token_ids: bool,
        tokenizer=None,
        logprobs: int | None = None,
        prompts: list[Echo] | None = None,
        echo: bool = False,
        drop_output: bool = False,
        prompt_logprobs: bool = False,
    ):
        self.chat = chat
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.return_token_ids = return_token_ids
        self.object = "chat.completion" if chat else "text_completion"
        self.lp = Logprobs(tokenizer, logprobs or 0) if tokenizer is not None else None
        self.logprobs = logprobs
        self.prompts = prompts
        self.echo = echo
        self.drop_output = drop_output
        self.prompt_logprobs = prompt_logprobs

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def _piece(self, index: int, state: ChoiceState, msg: generate_pb2.GenerateResponse) -> tuple:
        """(text, token ids, logprobs or None) one message adds to a choice, echo and drops applied."""
        first = not state.started
        state.started = True
        text, ids = ("", []) if self.drop_output else (msg.text, list(msg.token_ids))
        lps = [] if self.drop_output else list(msg.logprobs)
        logprobs = None
        if msg.prompt_logprobs:
            state.prompt_logprobs = list(msg.prompt_logprobs)
        echo = self.prompts[index] if self.echo and first else None
        if echo is not None:
            text = echo.text + text
            if self.logprobs is not None:
                prompt_lps = [None, *state.prompt_logprobs][: len(echo.token_ids)]
                prompt_lps += [None] * (len(echo.token_ids) - len(prompt_lps))
                ids_all, lps_all = echo.token_ids + ids, prompt_lps + lps
            ids = echo.token_ids + ids
        if self.logprobs is not None:
            if echo is None:
                ids_all, lps_all = ids, lps
            if self.chat:
                logprobs = self.lp.chat(lps_all)
            else:
                logprobs, state.offset = self.lp.completion(ids_all, lps_all, state.offset)
        return text, ids, logprobs

    def chunk(self, index: int, state: ChoiceState, msg: generate_pb2.GenerateResponse) -> dict:
        """The stream's chunk of one message of choice `index` (the last carries its finish reason)."""
        first = not state.started
        finished = msg.finished if msg.HasField("finished") else None
        text, token_ids, logprobs = self._piece(index, state, msg)
        choice: dict = {"index": index}
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
            choice["delta"] = delta
            choice["logprobs"] = None if logprobs is None else {"content": logprobs}
        else:
            choice["text"] = text
            choice["logprobs"] = logprobs
        choice["finish_reason"] = finished.finish_reason if finished is not None else None
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        if first and self.prompt_logprobs and self.lp is not None and msg.prompt_logprobs:
            choice["prompt_logprobs"] = self.lp.prompt(self.echo_ids(index), msg.prompt_logprobs)
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = [choice]
        if finished is not None:
            state.finished = finished
            out["timings"] = timings(finished)
        return out

    def echo_ids(self, index: int) -> list[int]:
        return self.prompts[index].token_ids if self.prompts is not None else []

    def add(self, index: int, state: ChoiceState, msg: generate_pb2.GenerateResponse) -> None:
        """Fold one message into its choice (the whole response)."""
        text, ids, logprobs = self._piece(index, state, msg)
        state.text += text
        state.token_ids += ids
        if logprobs is not None:
            if self.chat:
                state.logprobs += logprobs
            elif not state.logprobs:
                state.logprobs = logprobs
            else:
                for key, value in logprobs.items():
                    state.logprobs[key] += value
        if msg.HasField("finished"):
            state.finished = msg.finished

    def usage_chunk(self, finished: list[generate_pb2.Finished]) -> dict:
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = self.usage(finished)
        return out

    def usage(self, finished: list[generate_pb2.Finished]) -> dict:
        out = usage(finished)
        if self.drop_output:  # the token made for an echo of max_tokens 0 is not the client's
            out["total_tokens"] -= out["completion_tokens"]
            out["completion_tokens"] = 0
        return out

    def whole(self, states: list[ChoiceState]) -> dict:
        choices = []
        for i, state in enumerate(states):
            f = state.finished
            choice: dict = {"index": i}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": state.text}
                choice["logprobs"] = None if self.logprobs is None else {"content": state.logprobs}
            else:
                choice["text"] = state.text
                choice["logprobs"] = state.logprobs if self.logprobs is not None else None
            choice["finish_reason"] = "length" if self.drop_output else f.finish_reason
            if self.return_token_ids:
                choice["token_ids"] = state.token_ids
            if self.prompt_logprobs and self.lp is not None:
                choice["prompt_logprobs"] = self.lp.prompt(self.echo_ids(i), state.prompt_logprobs)
            choice["timings"] = timings(f)
            choices.append(choice)
        out = self._head(self.object)
        out["choices"] = choices
        out["usage"] = self.usage([s.finished for s in states])
        return out


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        409: "ConflictError",
        413: "RequestTooLargeError",
        429: "RateLimitError",
        503: "ServiceUnavailableError",
        504: "TimeoutError",
    }.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
