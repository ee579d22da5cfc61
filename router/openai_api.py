"""The OpenAI-compatible HTTP API and Prometheus `/metrics`, served by the router process on the same
asyncio loop as its gRPC server (FastAPI on uvicorn).

A completion or chat completion becomes one gRPC-shaped `GenerateRequest` per prompt. Each is admitted
by `Router.admit` (the validation and --max-inflight of the gRPC path), then run as its own task that
feeds one queue; the response streams that queue as server-sent events or collects it into one JSON
body. A client that disconnects cancels those tasks, which releases the requests in the workers and
the pool exactly as a gRPC cancel does.

    POST /v1/completions        prompt: text, token ids, or a list of either
    POST /v1/chat/completions   messages rendered with the checkpoint's chat template
    POST /tokenize, /detokenize vLLM's: a prompt's (or a chat's) token ids, and token ids' text
    GET  /v1/models, GET /health (503 until the cluster is ready), GET /metrics

Given API keys (--api-key), every route but /health and /metrics asks for `Authorization: Bearer <key>`
(401 with an OpenAI error body otherwise). A body over --max-request-bytes is refused (413): unread when
its Content-Length says so, cut off when a chunked body passes it; a body that stalls is dropped (408).

`OpenAIServing` answers the routes, one method each (`ROUTES`); `build_app` registers them on a FastAPI
app behind `Gate` (keys, body size). `Fanout` runs a response's requests; `sse` and `collect` shape it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from typing import TYPE_CHECKING

from fastapi import BackgroundTasks, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvferry.auth import owner_of
from kvferry.engine.request import InvalidRequestError
from kvferry.engine.structured import StructuredOutputError
from kvferry.model.chat_template import ChatTemplate, ChatTemplateError
from kvferry.router.inflight import Inflight, RequestRejected
from kvferry.router.limits import max_prompt_chars
from kvferry.router.metrics import CONTENT_TYPE
from kvferry.router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Echo,
    ResponseShape,
    TokenizeRequest,
)
from kvferry.router.openai_stream import ApiError, Fanout, collect, sse
from kvferry.v1 import generate_pb2

if TYPE_CHECKING:
    from kvferry.router.server import Router

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers need no API key


class Gate:
    """API keys first (nothing is read for a caller without one), then the body: read here, counted as it
    arrives whatever its framing (a `Transfer-Encoding: chunked` body has no length to check up front)
    and cut at --max-request-bytes (413), each piece awaited at most --body-timeout-s (408). Every
    response of 400 or more is counted (`kvferry:request_errors_total`); an exception that escapes a
    route is logged, answered 500 with an OpenAI error body, and the connection stays usable. A plain
    ASGI middleware (not BaseHTTPMiddleware, which would pass every streamed chunk through a queue of its
    own: CPU per token on the router)."""

    def __init__(self, app, router: Router):
        self.app, self.router = app, router
        self._logged: set[tuple[str, str]] = set()  # (type, where) of escaped exceptions already logged

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status: list[int] = []

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                if message["status"] >= 400:
                    self.router.metrics.request_error("http", str(message["status"]))
            await send(message)

        try:
            refused = self.refuse(scope)
            if refused is None:
                try:
                    body = await self.read_body(receive)
                except ApiError as err:
                    refused = err.response()
            if refused is not None:
                return await refused(scope, receive, counted)
            if body is None:
                return  # the client went away before its body ended
            where = unencodable(body)
            if where is not None:
                response = ApiError(
                    400, f"{where} is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff)", where
                ).response()
                return await response(scope, receive, counted)
            await self.app(scope, _replay(body, receive), counted)
        except Exception as err:
            self._log(err)
            if not status:
                response = ApiError(500, f"internal error ({type(err).__name__}); it is logged").response()
                await response(scope, receive, counted)
            # (a response under way is cut off: the server closes that connection)

    def refuse(self, scope) -> JSONResponse | None:
        cfg = self.router.cfg
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        if (
            cfg.api_keys
            and scope["path"] not in OPEN_PATHS
            and self.router.credentials.check(headers) is not None
        ):
            return ApiError(
                401, "missing or invalid API key (send the header 'Authorization: Bearer <key>')"
            ).response()
        length = next((v for k, v in headers if k == "content-length"), "")
        if length.isdigit() and int(length) > cfg.max_request_bytes:
            return ApiError(
                413, f"the body has {length} bytes; at most {cfg.max_request_bytes} are accepted"
            ).response()
        return None

    async def read_body(self, receive) -> bytes | None:
        """The whole body, or None if the client disconnected first; ApiError 413 past the limit, 408
        when a piece takes longer than --body-timeout-s."""
        cfg = self.router.cfg
        limit, pieces, size = cfg.max_request_bytes, [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), cfg.body_timeout_s)
            except TimeoutError:
                raise ApiError(
                    408, f"the body stalled: no part of it came for {cfg.body_timeout_s:g} s"
                ) from None
            if message["type"] == "http.disconnect":
                return None
            piece = message.get("body", b"")
            size += len(piece)
            if size > limit:
                raise ApiError(413, f"the body passed {limit} bytes; at most {limit} are accepted")
            pieces.append(piece)
            if not message.get("more_body", False):
                return b"".join(pieces)

    def _log(self, err: Exception) -> None:
        """The traceback the first time an exception of this type escapes from this place, one line
        after that (a client that repeats the request does not flood the log)."""
        tb = err.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"
        key = (type(err).__name__, where)
        if key in self._logged:
            log.error("an HTTP request failed again with %s at %s: %s", key[0], where, err)
        else:
            self._logged.add(key)
            log.exception("an HTTP request failed (answered 500)", exc_info=err)


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
SURROGATE_ESCAPE_TEXT = re.compile(r"\\u[dD][89a-fA-F]")


def unencodable(body: bytes) -> str | None:
    """Where a JSON body holds a string that no UTF-8 text can carry (a lone surrogate, which only a
    \\u escape can write): its field path, e.g. 'messages[0].content'; None for none (the usual
    case, UTF-8, costs one scan of the bytes), or a body that is not JSON (the app answers that). A
    UTF-16 or UTF-32 body (JSON may come so) is decoded first."""
    encoding = json.detect_encoding(body)
    if encoding == "utf-8":
        if SURROGATE_ESCAPE.search(body) is None:
            return None
        text = body
    else:
        try:
            text = body.decode(encoding)
        except UnicodeDecodeError:
            return None
        if SURROGATE_ESCAPE_TEXT.search(text) is None:
            return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # (too deep: the app's own parser answers 400)
        return None
    todo = [(data, "")]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                todo.append((key, path or "body"))
                todo.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            todo.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


def _replay(body: bytes, receive):
    """The app's `receive`: the body read by the Gate as one message, then the connection's own (its
    disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class OpenAIServing:
    """The OpenAI-compatible API over one router: a method per route (`ROUTES`), each answering with
    JSON or server-sent events, or raising ApiError. The routes admit and run requests through the
    router's own `admit` / `run` (the gRPC path's validation, --max-inflight and release)."""

    def __init__(self, router: Router):
        self.router = router
        self.chat_template = ChatTemplate.load(router.model_dir, router.cfg.chat_template)
        self.names = router.model_names

    async def health(self) -> Response:
        if self.router.draining:
            return ApiError(
                503, "this router is stopping: its streams finish, new requests go elsewhere"
            ).response()
        if self.router.directory.ready:
            return Response(status_code=200)
        return ApiError(503, "the cluster is not ready: no prefill/decode workers yet").response()

    async def models(self) -> dict:
        info = self.router.directory.model
        card = {
            "id": self.router.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvferry",
            "root": self.router.served_model_name,  # never the checkpoint's path
            "parent": None,
        }
        if info is not None:
            card.update(max_model_len=info.max_model_len, vocab_size=info.vocab_size)
        return {"object": "list", "data": [card]}

    async def metrics(self) -> Response:
        return Response(self.router.metrics.exposition(), media_type=CONTENT_TYPE)

    async def _check_structured(self, body) -> None:
        """Compile the request's structured output (cached; off the loop): a constraint the library
        refuses is a 400 naming the field it came in."""
        spec = body.structured()
        if spec is None or self.router.directory.model is None:  # (not ready: admission answers 503)
            return
        field, kind, value = spec
        try:
            await self.router.admission.compile(kind, value)
        except StructuredOutputError as err:
            raise ApiError(400, f"{field}: {err}", field) from None
        except RequestRejected as err:
            raise ApiError.of(err) from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.router.served_model_name}`",
                "model",
            )

    async def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's special tokens and chat template (what lm-eval's
        remote tokenizer reads)."""
        config_path = self.router.model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        info = {k: v for k, v in config.items() if k != "added_tokens_decoder"}
        eos = self.router.tokenizer.eos_token_id
        if "eos_token" not in info and eos is not None:
            info["eos_token"] = self.router.tokenizer.decode([eos], skip_special_tokens=False)
        info.setdefault("eos_token", None)
        info["chat_template"] = self.chat_template.source if self.chat_template is not None else None
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        return info

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's /tokenize: a prompt's token ids (or a chat's, rendered with the chat template)."""
        self._check_model(body.model)
        if body.messages is not None:
            if self.chat_template is None:
                raise ApiError(400, f"model {self.router.served_model_name} has no chat template", "messages")
            try:
                text = self.chat_template.render(
                    [m.as_template_input(i) for i, m in enumerate(body.messages)], body.add_generation_prompt
                )
            except (InvalidRequestError, ChatTemplateError) as err:
                raise ApiError(400, str(err), "messages") from None
        elif body.prompt is not None:
            text = body.prompt
        else:
            raise ApiError(400, "give prompt or messages", "prompt")
        info = self.router.directory.model
        limit = max_prompt_chars(info.max_model_len if info is not None else 4096)
        if len(text) > limit:
            raise ApiError(400, f"prompt: at most {limit} characters", "prompt")
        ids = await asyncio.to_thread(self.router.tokenizer.encode, text, body.add_special_tokens)
        return {
            "count": len(ids),
            "max_model_len": info.max_model_len if info is not None else None,
            "tokens": ids,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: the text of token ids."""
        self._check_model(body.model)
        vocab = self.router.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens must lie in [0, {vocab}); got {bad[0]}", "tokens")
        return {"prompt": self.router.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            reqs = body.generate_requests(rid)
        except InvalidRequestError as err:
            raise ApiError.of(err) from None
        await self._check_structured(body)
        shape = ResponseShape(
            False,
            f"cmpl-{rid}",
            self.router.served_model_name,
            body.return_token_ids,
            self.router.tokenizer,
            logprobs=body.logprobs,
            echo=body.echo,
            drop_output=body.echo and body.max_tokens == 0,
            prompt_logprobs=body.prompt_logprobs is not None,
            per_prompt=body.sequences,
            keep=body.n,
        )
        return await self._respond(request, body, reqs, shape, "prompt")

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        if self.chat_template is None:
            raise ApiError(
                400,
                f"model {self.router.served_model_name} has no chat template (tokenizer_config.json "
                "chat_template or chat_template.jinja); use /v1/completions",
                "messages",
            )
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            body.check_supported()
            sampling = body.sampling(body.max_new_tokens)
        except InvalidRequestError as err:
            raise ApiError.of(err) from None
        await self._check_structured(body)
        try:
            kwargs = body.template_kwargs()
        except InvalidRequestError as err:
            raise ApiError(400, str(err), "chat_template_kwargs") from None
        if body.tools:  # templates that know tools render them (Qwen's do)
            kwargs.setdefault("tools", body.tools)
        try:
            text = self.chat_template.render(body.template_messages(), body.add_generation_prompt, **kwargs)
        except (InvalidRequestError, ChatTemplateError) as err:
            raise ApiError(400, str(err), "messages") from None
        # the router tokenizes the rendered text (off the loop, after admission); an unset max_tokens
        # means as many as fit
        req = generate_pb2.GenerateRequest(
            request_id=f"{rid}-0",
            text=text,
            sampling=sampling,
            cache_salt=body.cache_salt or "",
            priority=body.priority,
            slo=body.slo_proto(),
        )
        shape = ResponseShape(
            True,
            f"chatcmpl-{rid}",
            self.router.served_model_name,
            body.return_token_ids,
            self.router.tokenizer,
            logprobs=body.output_logprobs,
            prompt_logprobs=body.prompt_logprobs is not None,
            tools=body.tool_mode(),
            per_prompt=body.n,
            keep=body.n,
        )
        return await self._respond(request, body, [req], shape, "messages", fill_max_tokens=True)

    async def _respond(
        self,
        request: Request,
        body,
        reqs,
        shape: ResponseShape,
        prompt_field: str,
        fill_max_tokens: bool = False,
    ) -> Response:
        owner = owner_of(request.headers.items())
        # a stream of one plain-text choice can be resumed exactly (tool calls, logprobs' text offsets
        # and echoed prompts carry state of the whole output that a resume does not rebuild)
        plain = shape.tools is None and shape.logprobs is None
        plain = plain and not shape.echo and not shape.prompt_logprobs
        resumable = body.stream and len(reqs) == 1 and shape.per_prompt == 1 and plain
        last = request.headers.get("last-event-id", "") if resumable else ""
        if last:  # the stream of a router that went away, resumed here (router.resume)
            return await self._resume(body, last, shape, owner, prompt_field)
        handles: list[Inflight] = []
        try:
            for req in reqs:
                handles.append(await self.router.admit(req, None, "http", fill_max_tokens, owner=owner))
        except BaseException as err:  # a refusal, or the client left while a prompt was tokenized
            for handle in handles:
                self.router.withdraw(handle)
            if isinstance(err, (InvalidRequestError, RequestRejected)):
                raise ApiError.of(err, prompt_field) from None
            raise
        k = shape.per_prompt
        if shape.echo or shape.prompt_logprobs:
            shape.prompts = [
                Echo(r.text if r.HasField("text") else self.router.tokenizer.decode(h.ids), h.ids)
                for r, h in zip(reqs, handles, strict=True)
                for _ in range(k)
            ]
        fanout = Fanout(self.router, handles, k)
        if body.stream:
            ids = handles[0].client_id if resumable else None
            events = sse(fanout, shape, len(reqs) * k, body.include_usage, prompt_field, ids)
            # the background task runs however the response ends: a stream that never started
            # (the client left at once) still cancels its requests
            cleanup = BackgroundTasks()
            cleanup.add_task(fanout.cancel)
            return StreamingResponse(events, media_type="text/event-stream", background=cleanup)
        return await collect(request, fanout, shape, len(reqs) * k, prompt_field)

    async def _resume(
        self, body, last_event_id: str, shape: ResponseShape, owner: str, field: str
    ) -> Response:
        """A streamed request resumed from SSE's Last-Event-ID (`<request id>:<tokens the client has>`,
        the ids of our events): the rest of its events, nothing recomputed."""
        request_id, _, count = last_event_id.rpartition(":")
        if not request_id or not count.isdigit():
            raise ApiError(400, "Last-Event-ID: expected <request id>:<tokens received>", "Last-Event-ID")
        have = int(count)
        ask = generate_pb2.GenerateRequest(request_id=request_id, resume=generate_pb2.Resume(tokens=have))
        try:
            handle = await self.router.admit_resume(ask, None, "http", owner)
        except (InvalidRequestError, RequestRejected) as err:
            raise ApiError.of(err, "Last-Event-ID") from None
        fanout = Fanout(self.router, [handle], 1, resumed_from=have)
        events = sse(fanout, shape, 1, body.include_usage, field, request_id, have)
        cleanup = BackgroundTasks()
        cleanup.add_task(fanout.cancel)
        return StreamingResponse(events, media_type="text/event-stream", background=cleanup)


# (method, path, OpenAIServing's method): registered in this order (build_app)
ROUTES = (
    ("GET", "/health", "health"),
    ("GET", "/v1/models", "models"),
    ("GET", "/metrics", "metrics"),
    ("GET", "/tokenizer_info", "tokenizer_info"),
    ("POST", "/tokenize", "tokenize"),
    ("POST", "/detokenize", "detokenize"),
    ("POST", "/v1/completions", "completions"),
    ("POST", "/v1/chat/completions", "chat_completions"),
)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body FastAPI could not parse or validate: a 400 naming the field, as OpenAI's."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return ApiError(
            400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        ).response()
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
    return ApiError(400, f"{where}: {first.get('msg', 'invalid')}", where).response()


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


def build_app(router: Router) -> FastAPI:
    """The HTTP app of `router`: the `Gate`, the error handlers and `ROUTES` over an `OpenAIServing`."""
    app = FastAPI(title="kvferry", summary="OpenAI-compatible API of a kvferry cluster")
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(ApiError, _api_error)
    app.add_middleware(Gate, router=router)
    serving = OpenAIServing(router)
    for method, path, name in ROUTES:
        app.add_api_route(path, getattr(serving, name), methods=[method])
    return app
