"""The transport's floor under `bench/router_cpu.py`: what gRPC alone costs a process that relays a stream,
measured on the same machine in the same run.

Two processes stand in for the request path with nothing of kvferry's in them: an upstream ("decode")
server whose streams yield one message per token, every stream on one shared step clock (as a decode
batch sends: all its requests' tokens at each step), and a relay (the router's place, on the router's
event loop) that serves `Generation.Generate` by opening one upstream stream per call and yielding
each message on. The caller drives the relay with the same client load as the router and reads its CPU.
A `source` serves `Generate` alone, its tokens from its own step clock: what the client's side of the
stream costs by itself, with no upstream call at all.

`split` is the least a disaggregated router of kvferry's design can do: for each `Generate`, one unary
`Prefill` call (its first token), then the rest of the stream from one long-lived `Relay` link to the
`workers` process, which sends one `RelayBatch` per step with a token for every stream on it; the relay
takes each stream's items from its own queue and yields one message per token. No admission, routing,
detokenization, stop strings, metrics or Redis: what is left is gRPC's, and asyncio's, cost.

    python bench/grpc_floor.py upstream PORT TOKENS STEP_S
    python bench/grpc_floor.py relay PORT UPSTREAM_PORT EVENT_LOOP
    python bench/grpc_floor.py source PORT TOKENS STEP_S EVENT_LOOP
    python bench/grpc_floor.py workers PORT TOKENS STEP_S
    python bench/grpc_floor.py split PORT WORKERS_PORT EVENT_LOOP
"""

from __future__ import annotations

import asyncio
import itertools
import sys

import grpc

from kvferry.router.server import loop_factory
from kvferry.v1 import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc


class StepClock:
    """Wakes every waiter at each step, as a decode step ends for its whole batch."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.tick = asyncio.Event()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            tick, self.tick = self.tick, asyncio.Event()
            tick.set()

    async def next(self) -> None:
        await self.tick.wait()


class Upstream(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, tokens: int, clock: StepClock):
        self.tokens, self.clock = tokens, clock

    async def Decode(self, request, context):
        for i in range(self.tokens):
            await self.clock.next()
            last = i == self.tokens - 1
            yield worker_pb2.DecodeResponse(token_ids=[100 + i], finish_reason="length" if last else "")


class Relay(generate_pb2_grpc.GenerationServicer):
    def __init__(self, stub: worker_pb2_grpc.DecodeWorkerStub):
        self.stub = stub

    async def Generate(self, request, context):
        call = self.stub.Decode(worker_pb2.DecodeRequest(request_id=request.request_id))
        async for msg in call:
            yield generate_pb2.GenerateResponse(
                request_id=request.request_id, token_ids=msg.token_ids, text="x"
            )


class Source(generate_pb2_grpc.GenerationServicer):
    def __init__(self, tokens: int, clock: StepClock):
        self.tokens, self.clock = tokens, clock

    async def Generate(self, request, context):
        for i in range(self.tokens):
            await self.clock.next()
            yield generate_pb2.GenerateResponse(request_id=request.request_id, token_ids=[100 + i], text="x")


class Workers(worker_pb2_grpc.PrefillWorkerServicer, worker_pb2_grpc.DecodeWorkerServicer):
    """A prefill worker (a unary first token) and a decode worker (a Relay link: one batch per step)."""

    def __init__(self, tokens: int, clock: StepClock):
        self.tokens, self.clock = tokens, clock

    async def Prefill(self, request, context):
        return worker_pb2.PrefillResponse(first_token_id=100)

    async def Relay(self, request_iterator, context):
        left: dict[str, int] = {}  # request id -> tokens still to send

        async def take() -> None:
            async for req in request_iterator:
                if req.WhichOneof("kind") == "start":
                    left[req.start.request_id] = self.tokens - 1
                else:
                    left.pop(req.cancel, None)

        taking = asyncio.create_task(take())
        try:
            while True:
                await self.clock.next()
                if not left:
                    continue
                batch = worker_pb2.RelayBatch()
                for rid, n in list(left.items()):
                    item = batch.items.add(request_id=rid)
                    item.response.token_ids.append(100 + self.tokens - n)
                    if n == 1:
                        item.response.finish_reason = "length"
                        del left[rid]
                    else:
                        left[rid] = n - 1
                yield batch
        finally:
            taking.cancel()


class Split(generate_pb2_grpc.GenerationServicer):
    """The router's least: a Prefill call, then the stream's tokens from the shared Relay link."""

    def __init__(self, channel: grpc.aio.Channel):
        self.prefill = worker_pb2_grpc.PrefillWorkerStub(channel)
        self.decode = worker_pb2_grpc.DecodeWorkerStub(channel)
        self.streams: dict[str, asyncio.Queue] = {}
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.link = self.reader = None
        self.ids = itertools.count()

    async def _requests(self):
        while True:
            yield await self.outgoing.get()

    async def _read(self) -> None:
        async for batch in self.link:
            for item in batch.items:
                queue = self.streams.get(item.request_id)
                if queue is not None:
                    queue.put_nowait(item.response)

    async def Generate(self, request, context):
        rid = request.request_id or f"r{next(self.ids)}"  # (as the router assigns one)
        first = await self.prefill.Prefill(worker_pb2.PrefillRequest(request_id=rid))
        yield generate_pb2.GenerateResponse(request_id=rid, token_ids=[first.first_token_id], text="x")
        if self.link is None:
            self.link = self.decode.Relay(self._requests())
            self.reader = asyncio.create_task(self._read())
        queue = self.streams[rid] = asyncio.Queue()
        self.outgoing.put_nowait(worker_pb2.RelayRequest(start=worker_pb2.DecodeRequest(request_id=rid)))
        try:
            while True:
                msg = await queue.get()
                yield generate_pb2.GenerateResponse(request_id=rid, token_ids=msg.token_ids, text="x")
                if msg.finish_reason:
                    return
        finally:
            del self.streams[rid]


async def serve_clocked(port: int, step_s: float, add) -> None:
    """Serve `add(server, clock)`'s servicer on `port`, its streams paced by a `step_s` StepClock."""
    clock = StepClock(step_s)
    ticking = asyncio.create_task(clock.run())
    server = grpc.aio.server()
    add(server, clock)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()
    ticking.cancel()


async def source(port: int, tokens: int, step_s: float) -> None:
    await serve_clocked(
        port,
        step_s,
        lambda server, clock: generate_pb2_grpc.add_GenerationServicer_to_server(
            Source(tokens, clock), server
        ),
    )


async def upstream(port: int, tokens: int, step_s: float) -> None:
    await serve_clocked(
        port,
        step_s,
        lambda server, clock: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(
            Upstream(tokens, clock), server
        ),
    )


async def workers(port: int, tokens: int, step_s: float) -> None:
    def add(server, clock) -> None:
        both = Workers(tokens, clock)
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(both, server)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(both, server)

    await serve_clocked(port, step_s, add)


async def split(port: int, workers_port: int) -> None:
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerationServicer_to_server(
        Split(grpc.aio.insecure_channel(f"127.0.0.1:{workers_port}")), server
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def relay(port: int, upstream_port: int) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{upstream_port}")
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerationServicer_to_server(
        Relay(worker_pb2_grpc.DecodeWorkerStub(channel)), server
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str]) -> None:
    role, port = argv[0], int(argv[1])
    if role == "upstream":
        asyncio.run(upstream(port, int(argv[2]), float(argv[3])))
    elif role == "relay":
        with asyncio.Runner(loop_factory=loop_factory(argv[3])) as runner:
            runner.run(relay(port, int(argv[2])))
    elif role == "source":
        with asyncio.Runner(loop_factory=loop_factory(argv[4])) as runner:
            runner.run(source(port, int(argv[2]), float(argv[3])))
    elif role == "workers":
        asyncio.run(workers(port, int(argv[2]), float(argv[3])))
    elif role == "split":
        with asyncio.Runner(loop_factory=loop_factory(argv[3])) as runner:
            runner.run(split(port, int(argv[2])))
    else:
        raise SystemExit(f"unknown role {role!r}: upstream, relay, source, workers or split")


if __name__ == "__main__":
    main(sys.argv[1:])
