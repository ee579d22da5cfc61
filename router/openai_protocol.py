"""The OpenAI request and response shapes, and their conversion to and from the public gRPC messages.

Requests are validated in two steps: their shape here (pydantic: types, fields kvferry does not
serve), then every value by the router's own admission (`Router.admit`), exactly as a gRPC request
is. Sampling fields keep their gRPC names (temperature, top_p, top_k, seed, max_tokens, stop,
stop_token_ids, ignore_eos: vLLM's extensions included), so a message that names a field names the
OpenAI field too.
"""

from __future__ import annotations

import time
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from kvferry.engine.request import InvalidRequestError
from kvferry.v1 import generate_pb2

INT32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]  # what the gRPC messages carry

# Fields of the OpenAI API that kvferry does not implement: accepted at their neutral value (what
# clients such as `vllm bench serve` send by default), refused with a 400 naming them otherwise.
NEUTRAL = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "min_tokens": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
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
        return p


class CompletionRequest(_Common):
    prompt: str | list[INT32] | list[str] | list[list[INT32]]

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
        sampling = self.sampling(16 if self.max_tokens is None else self.max_tokens)  # OpenAI's default
        out = []
        for i, prompt in enumerate(self.prompts()):
            req = generate_pb2.GenerateRequest(request_id=f"{request_id}-{i}", sampling=sampling)
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

    @property
    def max_new_tokens(self) -> int | None:
        """None: as many as fit (the chat API has no fixed default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.as_template_input(i) for i, m in enumerate(self.messages)]


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


class ResponseShape:
    """Builds the chunks and the whole response of one completion or chat completion."""

    def __init__(self, chat: bool, response_id: str, model: str, return_token_ids: bool):
        self.chat = chat
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.return_token_ids = return_token_ids
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def chunk(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finished: generate_pb2.Finished | None = None,
        first: bool = False,
    ) -> dict:
        choice: dict = {"index": index}
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finished.finish_reason if finished is not None else None
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = [choice]
        if finished is not None:
            out["timings"] = timings(finished)
        return out

    def usage_chunk(self, finished: list[generate_pb2.Finished]) -> dict:
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = usage(finished)
        return out

    def whole(
        self, texts: list[str], token_ids: list[list[int]], finished: list[generate_pb2.Finished]
    ) -> dict:
        choices = []
        for i, (text, ids, f) in enumerate(zip(texts, token_ids, finished, strict=True)):
            choice: dict = {"index": i}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = None
            choice["finish_reason"] = f.finish_reason
            if self.return_token_ids:
                choice["token_ids"] = ids
            choice["timings"] = timings(f)
            choices.append(choice)
        out = self._head(self.object)
        out["choices"] = choices
        out["usage"] = usage(finished)
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
