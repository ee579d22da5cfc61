"""A request as the router holds it while in flight (`Inflight`: an entry of `router.admission`'s table,
handed along the pipeline) and the errors that end one early (`RequestRejected`, `WorkerFailed`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from kvferry.auth import unscoped_id
from kvferry.engine.request import SamplingParams
from kvferry.v1 import worker_pb2

if TYPE_CHECKING:
    from kvferry.kvpool.metadata import Location
    from kvferry.router.decode_link import LinkStream
    from kvferry.router.directory import Member
    from kvferry.router.metrics import RequestTrack
    from kvferry.router.sequences import SharedPrefill
    from kvferry.router.slo import Prediction, Targets


@dataclass
class Inflight:
    request_id: str
    deadline: float  # time.monotonic() by which it must be done (the client's, else --request-timeout-s)
    t0: float  # perf_counter() when it arrived
    ids: list[int] = field(default_factory=list)  # set once tokenized and validated
    params: SamplingParams = field(default_factory=SamplingParams)
    track: RequestTrack | None = None  # set once admitted
    aborted: bool = False
    decode: Member | None = None
    calls: list[grpc.aio.Call | LinkStream] = field(default_factory=list)  # cancelled when it ends early
    linked: bool = False  # its decode runs on a relay link (a cancel there aborts it: no Abort call)
    detachable: bool = False  # its decode worker holds it for a resume if this router goes away
    release_pool: bool = False  # the pool may still hold the request's private tail block
    cache_salt: str = ""  # mixed into its block keys (engine.block_hash.salt_key)
    priority: int = 0  # GenerateRequest.priority: lower first, in each worker's queue
    # the prompt's block keys and the pool's hits on them (looked up at admission, unless colocated)
    prompt_keys: worker_pb2.PromptKeys | None = None
    pooled: list[Location] = field(default_factory=list)
    targets: Targets | None = None  # its SLO targets (router.slo)
    prediction: Prediction | None = None  # its predicted TTFT / TPOT (router.slo)
    # a request of n sequences (router.sequences): what they share, this one's index, the leader's others
    shared: SharedPrefill | None = None
    index: int = 0
    siblings: list[Inflight] = field(default_factory=list)
    owner: str = ""  # who made it (kvferry.auth.owner_of): only they may resume it
    api: str = "grpc"
    # a resumed request (GenerateRequest.resume): the decode worker holding it, its Attach call and the
    # call's first message (the request as first sent and every token so far)
    attached: tuple[Member, grpc.aio.UnaryStreamCall, worker_pb2.DecodeResponse] | None = None

    def remaining(self) -> float:
        """Seconds left until the deadline (for worker calls)."""
        return max(0.0, self.deadline - time.monotonic())

    @property
    def client_id(self) -> str:
        """The id its client knows it by (`request_id` is the cluster's: kvferry.auth.scoped_id)."""
        return unscoped_id(self.owner, self.request_id)


class RequestRejected(Exception):
    """A request the cluster cannot serve (overload, no workers, a worker failed); `code` says which,
    `retry_after_s` when to try again (sent as HTTP Retry-After and a gRPC `retry-after-ms` trailer)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


class WorkerFailed(RequestRejected):
    """A worker call failed; `retry`: another worker of its role may serve it (router.failover)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry: bool):
        super().__init__(code, message)
        self.retry = retry


def error_code(err: Exception) -> grpc.StatusCode:
    """The status code of an error that ends a request (InvalidRequestError: INVALID_ARGUMENT)."""
    return err.code if isinstance(err, RequestRejected) else grpc.StatusCode.INVALID_ARGUMENT
