"""A small synchronous client for the public API (used by `kvferry generate --server`, tests, load tests)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvferry.auth import client_interceptors
from kvferry.rpc import CHANNEL_OPTIONS
from kvferry.v1 import generate_pb2, generate_pb2_grpc


@dataclass
class StreamResult:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: generate_pb2.Finished | None = None
    messages: int = 0


def build_request(
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    request_id: str = "",
    **sampling,
) -> generate_pb2.GenerateRequest:
    """sampling: temperature, top_k, top_p, seed, max_tokens, stop, stop_token_ids, ignore_eos."""
    sampling = {k: (list(v) if isinstance(v, tuple) else v) for k, v in sampling.items() if v is not None}
    req = generate_pb2.GenerateRequest(
        request_id=request_id, sampling=generate_pb2.SamplingParams(**sampling)
    )
    if prompt_token_ids is not None:
        req.token_ids.ids.extend(prompt_token_ids)
    elif prompt is not None:
        req.text = prompt
    return req


class Client:
    """The router's public gRPC API. `api_key`: sent as `authorization: Bearer <key>` on every call;
    `root_certificates`: PEM bytes of the CA (or the self-signed certificate) to trust, which makes the
    channel TLS."""

    def __init__(self, target: str, api_key: str | None = None, root_certificates: bytes | None = None):
        self.target = target
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(target, creds, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        if api_key:
            interceptors = client_interceptors([("authorization", f"Bearer {api_key}")])
            self.channel = grpc.intercept_channel(self.channel, *interceptors)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)

    def stream(self, request: generate_pb2.GenerateRequest, timeout: float | None = None) -> Iterator:
        return self.stub.Generate(request, timeout=timeout)

    def generate(self, request: generate_pb2.GenerateRequest, timeout: float | None = None) -> StreamResult:
        result = StreamResult()
        for msg in self.stub.Generate(request, timeout=timeout):
            result.request_id = msg.request_id
            result.token_ids += msg.token_ids
            result.text += msg.text
            result.messages += 1
            if msg.HasField("finished"):
                result.finished = msg.finished
        return result

    def abort(self, request_id: str, timeout: float = 10) -> None:
        self.stub.Abort(generate_pb2.AbortRequest(request_id=request_id), timeout=timeout)

    def model_info(self, timeout: float = 10) -> generate_pb2.ModelInfo:
        return self.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
