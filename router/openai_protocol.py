"""The OpenAI request and response shapes, and their conversion to and from the public gRPC messages.

Requests are validated in two steps: their shape here (pydantic: types, fields kvferry does not
serve), then every value by the router's own admission (`Router.admit`), exactly as a gRPC request
is. Sampling fields keep their gRPC names (temperature, top_p, top_k, seed, max_tokens, stop,
stop_token_ids, ignore_eos: vLLM's extensions included), so a message that names a field names the
OpenAI field too.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from kvferry.convert import structured_to_proto
from kvferry.engine.request import MAX_N, InvalidRequestError
from kvferry.v1 import generate_pb2

INT32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]  # what the gRPC messages carry

# Fields of the OpenAI API that kvferry does not implement: accepted at their neutral value (what
# clients such as `vllm bench serve` send by default), refused with a 400 naming them otherwise. A field
# that would change the output is never accepted and ignored.
NEUTRAL = {
    "echo": (None, False),  # (a completions field: the chat API has none)
    "best_of": (None, 1),  # (a completions field: the chat API has none)
    "suffix": (None, ""),
    "tools": (None, []),  # (a chat field: completions have none)
    "tool_choice": (None, "none"),
    "guided_decoding_backend": (None, "auto", "guidance", "llguidance"),  # kvferry's is llguidance
    "bad_words": (None, []),
    "prompt_embeds": (None,),
    "truncate_prompt_tokens": (None,),
    "modalities": (None, ["text"]),  # (audio out: not served)
    "skip_special_tokens": (None, True),  # vLLM's; kvferry always leaves special tokens out of text
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "functions": (None, []),  # the chat API's old spelling of tools
    "function_call": (None, "none"),
}
# Fields that change nothing a client gets back here: accepted and not used. Any other field kvferry
# does not know is a 400 naming it (`reasoning_effort`, `prediction`, `audio`, a typo...): a field that
# might change the output is never accepted and ignored.
HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
# vLLM's structured-output fields (the older `guided_*` spellings and the `structured_outputs` object's
# keys) -> engine.structured's kinds
GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
# the fields read from a request's extras (not declared on the models): every other extra is refused
KNOWN_EXTRAS = frozenset(
    {*NEUTRAL, *GUIDED, *HARMLESS, "response_format", "structured_outputs", "guided_json_object"}
)


def _structured_value(field: str, kind: str, value) -> str:
    """The engine's text of a constraint given as JSON (a schema object or text, a list of choices)."""
    if kind == "json_schema":
        if isinstance(value, str):
            return value
        if isinstance(value, (dict, bool)):
            return json.dumps(value)
        raise InvalidRequestError(f"{field} must be a JSON schema (an object, or its JSON text)")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(f"{field} must be a non-empty list of strings")
        return json.dumps(value)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(f"{field} must be true")
        return ""
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{field} must be a non-empty string")
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class SloTargets(BaseModel):
    """kvferry extension `slo`: the request's latency targets in milliseconds (unset: the cluster's)."""

    model_config = ConfigDict(extra="forbid")
    ttft_ms: Annotated[float, Field(ge=0, le=86_400_000)] = 0.0
    tpot_ms: Annotated[float, Field(ge=0, le=86_400_000)] = 0.0


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
    priority: INT32 = 0  # vLLM extension: lower first in each worker's queue (may preempt higher values)
    slo: SloTargets | None = None  # kvferry extension: TTFT / TPOT targets (router.slo)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False  # vLLM extension: each choice carries its token ids

    def slo_proto(self) -> generate_pb2.Slo | None:
        return (
            None if self.slo is None else generate_pb2.Slo(ttft_ms=self.slo.ttft_ms, tpot_ms=self.slo.tpot_ms)
        )

    def structured(self) -> tuple[str, str, str] | None:
        """The one structured-output constraint the request asks for, as (field, kind, value), from
        `response_format`, vLLM's `structured_outputs` or its `guided_*` fields (the chat API adds
        `tool_choice`); None for free text. Two constraints are a 400."""
        found = []
        extra = self.model_extra or {}
        rf = extra.get("response_format")
        if rf is not None:
            kind = rf.get("type") if isinstance(rf, dict) else None
            if kind == "json_object":
                found.append(("response_format", "json_object", ""))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict):
                    raise InvalidRequestError(
                        "response_format.json_schema must be an object with the schema under 'schema'"
                    )
                schema = spec.get("schema")
                if not isinstance(schema, dict):
                    raise InvalidRequestError(
                        "response_format.json_schema.schema must be a JSON schema object"
                    )
                found.append(("response_format.json_schema.schema", "json_schema", json.dumps(schema)))
            elif kind != "text":
                raise InvalidRequestError(
                    f"response_format.type must be text, json_object or json_schema, got {kind!r}"
                )
        so = extra.get("structured_outputs")
        if so is not None:
            if not isinstance(so, dict):
                raise InvalidRequestError("structured_outputs must be an object")
            for key, value in so.items():
                if value is None or value is False:
                    continue
                if key not in STRUCTURED_KEYS:
                    raise InvalidRequestError(
                        f"structured_outputs.{key} is not supported; one of {', '.join(STRUCTURED_KEYS)}"
                    )
                kind = STRUCTURED_KEYS[key]
                found.append(
                    (
                        f"structured_outputs.{key}",
                        kind,
                        _structured_value(f"structured_outputs.{key}", kind, value),
                    )
                )
        for name, kind in GUIDED.items():
            value = extra.get(name)
            if value is not None:
                found.append((name, kind, _structured_value(name, kind, value)))
        if extra.get("guided_json_object"):
            found.append(("guided_json_object", "json_object", ""))
        found += self._tool_constraint()
        if len(found) > 1:
            raise InvalidRequestError(
                f"{found[1][0]}: one structured output per request, and {found[0][0]} is given too"
            )
        return found[0] if found else None

    def _tool_constraint(self) -> list[tuple[str, str, str]]:
        return []

    def check_supported(self) -> None:
        given = self.model_extra or {}  # NEUTRAL's fields are not declared: they arrive as extras
        for name, neutral in NEUTRAL.items():
            value = given.get(name)
            if not any(value == v and type(value) is type(v) for v in neutral):
                raise InvalidRequestError(f"{name}={value!r} is not supported by kvferry")
        unknown = sorted(set(given) - KNOWN_EXTRAS)
        if unknown:
            raise InvalidRequestError(
                f"{unknown[0]} is not a field kvferry knows (it is refused, not ignored: it might change "
                "the output); see the README's table of OpenAI fields"
            )
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true")

    @property
    def sequences(self) -> int:
        """Sequences sampled per prompt (best_of of them when given, of which the n best are answered)."""
        return self.n

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
        spec = self.structured()
        if spec is not None:
            p.structured.CopyFrom(structured_to_proto(spec[1], spec[2]))
        if self.sequences > 1:
            p.n = self.sequences
            if self.sequences > self.n and not p.HasField("logprobs"):
                p.logprobs = 0  # best_of ranks the sequences by their logprobs
        return p

    @property
    def output_logprobs(self) -> int | None:
        """The top alternatives per output token asked for (None: no logprobs)."""
        return None


class CompletionRequest(_Common):
    prompt: str | list[INT32] | list[str] | list[list[INT32]]
    logprobs: INT32 | None = None  # the top alternatives per token (0: the sampled token's only)
    echo: bool = False  # the prompt comes first in each choice (its logprobs too, with `logprobs`)
    best_of: INT32 | None = None  # sample this many, answer the n with the highest log-probability

    @property
    def sequences(self) -> int:
        best_of = self.best_of or self.n
        if best_of < self.n or best_of > MAX_N:
            raise InvalidRequestError(f"best_of must be in [n={self.n}, {MAX_N}], got {best_of}")
        if best_of > self.n and self.stream:
            raise InvalidRequestError("best_of > n cannot be streamed (the best are known at the end)")
        return best_of

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
                request_id=f"{request_id}-{i}",
                sampling=sampling,
                cache_salt=self.cache_salt or "",
                priority=self.priority,
                slo=self.slo_proto(),
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
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None

    def tool_mode(self) -> tuple[str, str | None] | None:
        """("named", the function) or ("required", None) when the output must be tool calls, else None.
        The model's free choice (`auto`, the default with tools) needs a tool-call parser: a 400."""
        choice = self.tool_choice
        if choice == "none" or (choice is None and not self.tools):
            return None
        if not self.tools:
            raise InvalidRequestError("tool_choice needs tools")
        names = self.tool_schemas()
        if choice is None or choice == "auto":
            raise InvalidRequestError(
                "tool_choice=auto (the default with tools) is not supported by kvferry: it has no tool-call "
                'parser; name a function ({"type": "function", "function": {"name": ...}}) or use required'
            )
        if choice == "required":
            return "required", None
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                'tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}'
            )
        if name not in names:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not one of the tools")
        return "named", name

    def tool_schemas(self) -> dict[str, dict]:
        """Each tool's name -> its parameters' JSON schema."""
        out = {}
        for i, tool in enumerate(self.tools or []):
            function = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type") != "function" or not isinstance(function, dict) or not function.get("name"):
                raise InvalidRequestError(
                    f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}'
                )
            params = function.get("parameters") or {"type": "object"}
            if not isinstance(params, dict):
                raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
            out[function["name"]] = params
        return out

    def _tool_constraint(self) -> list[tuple[str, str, str]]:
        mode = self.tool_mode()
        if mode is None:
            return []
        schemas = self.tool_schemas()
        if mode[0] == "named":
            return [("tool_choice", "json_schema", json.dumps(schemas[mode[1]]))]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, params in schemas.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return [("tool_choice", "json_schema", json.dumps(schema))]

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
    tool_call_id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")
    cum_logprob: float = 0.0  # of its output tokens (best_of ranks by it)


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
        tools: tuple[str, str | None] | None = None,
        per_prompt: int = 1,
        keep: int = 1,
    ):
        self.chat = chat
        self.tools = tools  # ChatCompletionRequest.tool_mode(): the output is tool calls
        self.per_prompt, self.keep = per_prompt, keep  # sequences per prompt; answered: the best `keep`
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
        if echo is not None:  # the prompt first: its first token has no logprob
            text, ids = echo.text + text, echo.token_ids + ids
            prompt_lps = [None, *state.prompt_logprobs][: len(echo.token_ids)]
            lps = prompt_lps + [None] * (len(echo.token_ids) - len(prompt_lps)) + lps
        if self.logprobs is not None:
            if self.chat:
                logprobs = self.lp.chat(lps)
            else:
                logprobs, state.offset = self.lp.completion(ids, lps, state.offset)
        return text, ids, logprobs

    def chunk(self, index: int, state: ChoiceState, msg: generate_pb2.GenerateResponse) -> dict:
        """The stream's chunk of one message of choice `index` (the last carries its finish reason)."""
        first = not state.started
        finished = msg.finished if msg.HasField("finished") else None
        text, token_ids, logprobs = self._piece(index, state, msg)
        choice: dict = {"index": index}
        if self.chat and self.tools is not None:
            state.text += text
            choice["delta"] = self._tool_delta(state, text, first, finished is not None)
            choice["logprobs"] = None if logprobs is None else {"content": logprobs}
        elif self.chat:
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

    def _tool_delta(self, state: ChoiceState, text: str, first: bool, last: bool) -> dict:
        """A chunk's delta when the output is tool calls: a named function's arguments stream as they
        come; `required`'s list of calls is parsed whole, at the end."""
        delta: dict = {"role": "assistant"} if first else {}
        mode, name = self.tools
        if mode == "named":
            call: dict = {"index": 0, "function": {"arguments": text}}
            if first:
                call.update(id=state.tool_call_id, type="function")
                call["function"]["name"] = name
            delta["tool_calls"] = [call]
        elif last:
            calls = self.tool_calls(state)
            if calls is None:
                delta["content"] = state.text
            else:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        return delta

    def tool_calls(self, state: ChoiceState) -> list[dict] | None:
        """The tool calls of a choice's output (None: the output is not complete calls)."""
        mode, name = self.tools
        if mode == "named":
            return [
                {
                    "id": state.tool_call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": state.text},
                }
            ]
        try:
            parsed = json.loads(state.text)
            calls = [(c["name"], c["parameters"]) for c in parsed]
        except (ValueError, TypeError, KeyError):
            return None  # cut short (max_tokens): the text is the answer
        return [
            {
                "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
                "type": "function",
                "function": {"name": n, "arguments": json.dumps(p, ensure_ascii=False)},
            }
            for n, p in calls
        ]

    def echo_ids(self, index: int) -> list[int]:
        return self.prompts[index].token_ids if self.prompts is not None else []

    def add(self, index: int, state: ChoiceState, msg: generate_pb2.GenerateResponse) -> None:
        """Fold one message into its choice (the whole response)."""
        state.cum_logprob += sum(lp.logprob for lp in msg.logprobs)
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

    def best(self, states: list[ChoiceState]) -> list[tuple[int, ChoiceState]]:
        """(index among all sequences, state) of the answered ones: best_of keeps, of each prompt's
        sequences, the `keep` with the highest log-probability, in that order."""
        indexed = list(enumerate(states))
        if self.per_prompt == self.keep:
            return indexed
        out = []
        for start in range(0, len(states), self.per_prompt):
            group = indexed[start : start + self.per_prompt]
            out += sorted(group, key=lambda item: -item[1].cum_logprob)[: self.keep]
        return out

    def whole(self, states: list[ChoiceState]) -> dict:
        finished = [s.finished for s in states]  # usage counts every sequence made (best_of's too)
        choices = []
        for i, (made, state) in enumerate(self.best(states)):
            f = state.finished
            choice: dict = {"index": i}
            calls = self.tool_calls(state) if self.tools is not None else None
            if self.chat:
                choice["message"] = {"role": "assistant", "content": state.text}
                if calls is not None:
                    choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
                choice["logprobs"] = None if self.logprobs is None else {"content": state.logprobs}
            else:
                choice["text"] = state.text
                choice["logprobs"] = state.logprobs if self.logprobs is not None else None
            choice["finish_reason"] = "length" if self.drop_output else f.finish_reason
            if calls is not None and self.tools[0] == "required" and f.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
            if self.return_token_ids:
                choice["token_ids"] = state.token_ids
            if self.prompt_logprobs and self.lp is not None:
                choice["prompt_logprobs"] = self.lp.prompt(self.echo_ids(made), state.prompt_logprobs)
            choice["timings"] = timings(f)
            choices.append(choice)
        out = self._head(self.object)
        out["choices"] = choices
        out["usage"] = self.usage(finished)
        return out


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        408: "RequestTimeoutError",
        409: "ConflictError",
        413: "RequestTooLargeError",
        429: "RateLimitError",
        503: "ServiceUnavailableError",
        504: "TimeoutError",
    }.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
