"""The transport's floor under `bench/router_cpu.py`: what gRPC alone costs a process that relays a stream,
measured on the same machine in the same run.

Two processes stand in for the request path with nothing of kvferry's in them: an upstream ("decode")
server whose streams yield one message per token, every stream on one shared step clock (as a decode
batch sends: all its requests' tokens at each step), and a relay (the router's place, on the router's
event loop) that serves `Generation.Generate` by opening one upstream stream per call and yielding
each message on. The caller drives the relay with the same client load as the router and reads its CPU.
A `source` serves `Generate` alone, its tokens from its own step clock: what the client's side of the
stream costs by itself, with no upstream call at all.

    python bench/grpc_floor.py upstream PORT TOKENS STEP_S
    python bench/grpc_floor.py relay PORT UPSTREAM_PORT EVENT_LOOP
    python bench/grpc_floor.py source PORT TOKENS STEP_S EVENT_LOOP
"""

from __future__ import annotations

import asyncio
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
    else:
        raise SystemExit(f"unknown role {role!r}: upstream, relay or source")


if __name__ == "__main__":
    main(sys.argv[1:])
