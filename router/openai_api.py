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
(401 with an OpenAI error body otherwise). A body over --max-request-bytes is refused (413) unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import re
import uuid

import grpc
from fastapi import BackgroundTasks, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvferry.engine.request import InvalidRequestError
from kvferry.engine.structured import StructuredOutputError
from kvferry.model.chat_template import ChatTemplate, ChatTemplateError
from kvferry.router.limits import max_prompt_chars
from kvferry.router.metrics import CONTENT_TYPE
from kvferry.router.openai_protocol import (
    ChatCompletionRequest,
    ChoiceState,
    CompletionRequest,
    DetokenizeRequest,
    Echo,
    ResponseShape,
    TokenizeRequest,
    error_body,
)
from kvferry.router.server import Inflight, RequestRejected, Router
from kvferry.v1 import generate_pb2

log = logging.getLogger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers need no API key


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, retry_after_s: float | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        headers = None if self.retry_after_s is None else {"Retry-After": str(math.ceil(self.retry_after_s))}
        return JSONResponse(
            error_body(self.status, self.message, self.param), status_code=self.status, headers=headers
        )

    @classmethod
    def of(cls, err: Exception, prompt_field: str = "prompt") -> ApiError:
        """The HTTP error for a router error; the message names the OpenAI field."""
        if isinstance(err, InvalidRequestError):
            message = _openai_field_names(str(err), prompt_field)
            return cls(400, message, re.match(r"[\w.\[\]]*", message).group(0) or None)
        if isinstance(err, RequestRejected):
            return cls(HTTP_STATUS.get(err.code, 500), str(err), retry_after_s=err.retry_after_s)
        return cls(500, f"internal error: {err}")


def _openai_field_names(message: str, prompt_field: str) -> str:
    """'sampling.top_p must ...' -> 'top_p must ...'; 'prompt.token_ids ...' -> 'prompt ...'."""
    message = message.removeprefix("sampling.")
    for name in ("prompt.text", "prompt.token_ids", "prompt"):
        if message.startswith(name):
            return prompt_field + message[len(name) :]
    return message


class Fanout:
    """Runs admitted requests as tasks and yields (choice index, message) as they arrive; a request that
    fails raises its error here. `cancel()` (the client went away) releases every request."""

    def __init__(self, router: Router, handles: list[Inflight], per_prompt: int = 1):
        self.per_prompt = per_prompt  # sequences per request: message i of request r is choice r * this + i
        self.queue: asyncio.Queue = asyncio.Queue()
        self.open = len(handles)
        self.started = [False] * len(handles)
        self.tasks = []
        for i, handle in enumerate(handles):
            task = asyncio.create_task(self._pump(router, i, handle))
            task.add_done_callback(functools.partial(self._never_ran, router, i, handle))
            self.tasks.append(task)

    def _never_ran(self, router: Router, index: int, handle: Inflight, task: asyncio.Task) -> None:
        """A task cancelled before its first step never entered `router.run`: withdraw its request."""
        if not self.started[index]:
            router.withdraw(handle)

    async def _pump(self, router: Router, index: int, handle: Inflight) -> None:
        self.started[index] = True  # from here on, router.run's own cleanup releases the request
        try:
            async with contextlib.aclosing(router.run(handle)) as stream:
                async for message in stream:
                    self.queue.put_nowait((index * self.per_prompt + message.index, message))
        except (InvalidRequestError, RequestRejected) as err:
            self.queue.put_nowait((index, err))
        except Exception as err:
            log.exception("request %s failed", handle.request_id)
            self.queue.put_nowait((index, err))
        finally:
            self.queue.put_nowait((index, None))

    async def __aiter__(self):
        while self.open:
            index, item = await self.queue.get()
            if item is None:
                self.open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


class Gate:
    """API keys first (nothing is read for a caller without one), then the body's size. A plain ASGI
    middleware: Starlette's `@app.middleware("http")` would pass every chunk of a streamed response
    through a queue of its own (CPU per token on the router)."""

    def __init__(self, app, router: Router):
        self.app, self.router = app, router

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refused = self.refuse(scope)
            if refused is not None:
                return await refused(scope, receive, send)
        await self.app(scope, receive, send)

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


def build_app(router: Router) -> FastAPI:
    app = FastAPI(title="kvferry", summary="OpenAI-compatible API of a kvferry cluster")
    chat_template = ChatTemplate.load(router.model_dir, router.cfg.chat_template)
    names = router.model_names

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return ApiError(
                400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
            ).response()
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
        return ApiError(400, f"{where}: {first.get('msg', 'invalid')}", where).response()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    app.add_middleware(Gate, router=router)

    @app.get("/health")
    async def health() -> Response:
        if router.directory.ready:
            return Response(status_code=200)
        return ApiError(503, "the cluster is not ready: no prefill/decode workers yet").response()

    @app.get("/v1/models")
    async def models() -> dict:
        info = router.directory.model
        card = {
            "id": router.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvferry",
            "root": router.served_model_name,  # never the checkpoint's path
            "parent": None,
        }
        if info is not None:
            card.update(max_model_len=info.max_model_len, vocab_size=info.vocab_size)
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.exposition(), media_type=CONTENT_TYPE)

    async def check_structured(body) -> None:
        """Compile the request's structured output (cached; off the loop): a constraint the library
        refuses is a 400 naming the field it came in."""
        spec = body.structured()
        if spec is None or router.directory.model is None:  # (not ready: admission answers 503)
            return
        field, kind, value = spec
        try:
            await asyncio.to_thread(router.grammars().check, kind, value)
        except StructuredOutputError as err:
            raise ApiError(400, f"{field}: {err}", field) from None

    def check_model(model: str | None) -> None:
        if model is not None and model not in names:
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves `{router.served_model_name}`",
                "model",
            )

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        """vLLM's /tokenizer_info: the tokenizer's special tokens and chat template (what lm-eval's
        remote tokenizer reads)."""
        config_path = router.model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        info = {k: v for k, v in config.items() if k != "added_tokens_decoder"}
        eos = router.tokenizer.eos_token_id
        if "eos_token" not in info and eos is not None:
            info["eos_token"] = router.tokenizer.decode([eos], skip_special_tokens=False)
        info.setdefault("eos_token", None)
        info["chat_template"] = chat_template.source if chat_template is not None else None
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        return info

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """vLLM's /tokenize: a prompt's token ids (or a chat's, rendered with the chat template)."""
        check_model(body.model)
        if body.messages is not None:
            if chat_template is None:
                raise ApiError(400, f"model {router.served_model_name} has no chat template", "messages")
            try:
                text = chat_template.render(
                    [m.as_template_input(i) for i, m in enumerate(body.messages)], body.add_generation_prompt
                )
            except (InvalidRequestError, ChatTemplateError) as err:
                raise ApiError(400, str(err), "messages") from None
        elif body.prompt is not None:
            text = body.prompt
        else:
            raise ApiError(400, "give prompt or messages", "prompt")
        info = router.directory.model
        limit = max_prompt_chars(info.max_model_len if info is not None else 4096)
        if len(text) > limit:
            raise ApiError(400, f"prompt: at most {limit} characters", "prompt")
        ids = await asyncio.to_thread(router.tokenizer.encode, text, body.add_special_tokens)
        return {
            "count": len(ids),
            "max_model_len": info.max_model_len if info is not None else None,
            "tokens": ids,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: the text of token ids."""
        check_model(body.model)
        vocab = router.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens must lie in [0, {vocab}); got {bad[0]}", "tokens")
        return {"prompt": router.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            reqs = body.generate_requests(rid)
        except InvalidRequestError as err:
            raise ApiError.of(err) from None
        await check_structured(body)
        shape = ResponseShape(
            False,
            f"cmpl-{rid}",
            router.served_model_name,
            body.return_token_ids,
            router.tokenizer,
            logprobs=body.logprobs,
            echo=body.echo,
            drop_output=body.echo and body.max_tokens == 0,
            prompt_logprobs=body.prompt_logprobs is not None,
            per_prompt=body.sequences,
            keep=body.n,
        )
        return await respond(request, body, reqs, shape, "prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if chat_template is None:
            raise ApiError(
                400,
                f"model {router.served_model_name} has no chat template (tokenizer_config.json chat_template "
                "or chat_template.jinja); use /v1/completions",
                "messages",
            )
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            body.check_supported()
            sampling = body.sampling(body.max_new_tokens)
        except InvalidRequestError as err:
            raise ApiError.of(err) from None
        await check_structured(body)
        try:
            kwargs = body.template_kwargs()
        except InvalidRequestError as err:
            raise ApiError(400, str(err), "chat_template_kwargs") from None
        if body.tools:  # templates that know tools render them (Qwen's do)
            kwargs.setdefault("tools", body.tools)
        try:
            text = chat_template.render(body.template_messages(), body.add_generation_prompt, **kwargs)
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
            router.served_model_name,
            body.return_token_ids,
            router.tokenizer,
            logprobs=body.output_logprobs,
            prompt_logprobs=body.prompt_logprobs is not None,
            tools=body.tool_mode(),
            per_prompt=body.n,
            keep=body.n,
        )
        return await respond(request, body, [req], shape, "messages", fill_max_tokens=True)

    async def respond(
        request: Request, body, reqs, shape: ResponseShape, prompt_field: str, fill_max_tokens: bool = False
    ) -> Response:
        handles: list[Inflight] = []
        try:
            for req in reqs:
                handles.append(await router.admit(req, None, "http", fill_max_tokens))
        except BaseException as err:  # a refusal, or the client left while a prompt was tokenized
            for handle in handles:
                router.withdraw(handle)
            if isinstance(err, (InvalidRequestError, RequestRejected)):
                raise ApiError.of(err, prompt_field) from None
            raise
        k = shape.per_prompt
        if shape.echo or shape.prompt_logprobs:
            shape.prompts = [
                Echo(r.text if r.HasField("text") else router.tokenizer.decode(h.ids), h.ids)
                for r, h in zip(reqs, handles, strict=True)
                for _ in range(k)
            ]
        fanout = Fanout(router, handles, k)
        if body.stream:
            events = sse(fanout, shape, len(reqs) * k, body.include_usage, prompt_field)
            # the background task runs however the response ends: a stream that never started
            # (the client left at once) still cancels its requests
            cleanup = BackgroundTasks()
            cleanup.add_task(fanout.cancel)
            return StreamingResponse(events, media_type="text/event-stream", background=cleanup)
        return await collect(request, fanout, shape, len(reqs) * k, prompt_field)

    return app


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def sse(fanout: Fanout, shape: ResponseShape, n: int, include_usage: bool, prompt_field: str):
    """The stream's events: a chunk per message (the last of a choice carries its finish_reason and
    timings), then usage when asked for, then [DONE]. Closing it (a disconnect) cancels the requests."""
    states = [ChoiceState() for _ in range(n)]
    try:
        async for index, msg in fanout:
            chunk = shape.chunk(index, states[index], msg)
            if include_usage:
                chunk["usage"] = None
            yield _event(chunk)
        if include_usage:
            yield _event(shape.usage_chunk([s.finished for s in states]))
    except (InvalidRequestError, RequestRejected) as err:  # headers are sent: the error is an event
        yield _event(error_body(ApiError.of(err, prompt_field).status, str(err)))
    finally:
        fanout.cancel()
    yield "data: [DONE]\n\n"


async def collect(
    request: Request, fanout: Fanout, shape: ResponseShape, n: int, prompt_field: str
) -> Response:
    """The whole response, or nothing if the client goes away first (its requests are then released)."""
    states = [ChoiceState() for _ in range(n)]

    async def gather() -> None:
        async for index, msg in fanout:
            shape.add(index, states[index], msg)

    gathering = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({gathering, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not gathering.done():
            return Response(status_code=499)  # nobody is listening any more
        try:
            gathering.result()
        except (InvalidRequestError, RequestRejected) as err:
            return ApiError.of(err, prompt_field).response()
    finally:
        gone.cancel()
        gathering.cancel()
        fanout.cancel()
    return JSONResponse(shape.whole(states))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
