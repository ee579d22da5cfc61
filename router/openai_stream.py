"""How an OpenAI response is made of the router's streams: `Fanout` runs the response's admitted requests
as tasks feeding one queue, `sse` streams it as server-sent events and `collect` gathers it into one
JSON body; a client that goes away cancels the tasks, which releases the requests as a gRPC cancel
does. `ApiError` is an HTTP error with an OpenAI error body (a router error's status: `ApiError.of`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import re
from typing import TYPE_CHECKING

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvferry.engine.request import InvalidRequestError
from kvferry.router.inflight import Inflight, RequestRejected
from kvferry.router.openai_protocol import ChoiceState, ResponseShape, error_body

if TYPE_CHECKING:
    from kvferry.router.server import Router

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

    def __init__(self, router: Router, handles: list[Inflight], per_prompt: int = 1, resumed_from: int = -1):
        self.per_prompt = per_prompt  # sequences per request: message i of request r is choice r * this + i
        self.resumed_from = resumed_from  # >= 0: one resumed stream, the client has this many tokens
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
            resumed = self.resumed_from >= 0
            stream = router.run_resumed(handle, self.resumed_from) if resumed else router.run(handle)
            async with contextlib.aclosing(stream):
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


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def sse(
    fanout: Fanout,
    shape: ResponseShape,
    n: int,
    include_usage: bool,
    prompt_field: str,
    request_id: str | None = None,
    sent: int = 0,
):
    """The stream's events: a chunk per message (the last of a choice carries its finish_reason and
    timings), then usage when asked for, then [DONE]. Closing it (a disconnect) cancels the requests.
    `request_id` (a stream of one choice): each chunk's SSE id is `<request_id>:<tokens so far>`, what a
    client sends back as Last-Event-ID to resume it through another router; `sent`: tokens before."""
    states = [ChoiceState() for _ in range(n)]
    try:
        async for index, msg in fanout:
            chunk = shape.chunk(index, states[index], msg)
            if include_usage:
                chunk["usage"] = None
            if request_id is None:
                yield _event(chunk)
            else:
                sent += len(msg.token_ids)
                yield f"id: {request_id}:{sent}\n" + _event(chunk)
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
