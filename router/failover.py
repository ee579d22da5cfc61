"""What the router does when a worker fails a call: which failures it retries on another worker, the
status code a client sees when it does not, and the request that resumes a decode elsewhere.

A prefill that fails before its first token (the worker died, or refused: RESOURCE_EXHAUSTED,
UNAVAILABLE) is simply sent again to another prefill worker. A decode stream that breaks mid-way
(the worker died: UNAVAILABLE, a transport-level INTERNAL, CANCELLED by the peer) resumes on another
decode worker: the tokens already streamed become part of its prompt, the last of them its first
token, and the prompt's KV is pulled from the pool as on the first dispatch (the worker recomputes
what the pool does not cover). Greedy output is the same as an uninterrupted run; a seeded sampled
request restarts its generator on the new worker, so it continues differently (still a valid sample).
Never the same worker twice, at most `MAX_RETRIES` times per phase, within the request's deadline.
INVALID_ARGUMENT and DEADLINE_EXCEEDED are never retried: another worker would answer the same.

`Failover` applies these rules for the prefill dispatch and the decode relay alike: the `WorkerFailed`
of a failed call (its worker suspected when its connection broke) and whether to try another worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from kvferry.router.directory import Directory, Member
from kvferry.router.inflight import WorkerFailed
from kvferry.v1 import worker_pb2

if TYPE_CHECKING:
    from kvferry.router.inflight import Inflight
    from kvferry.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

MAX_RETRIES = 2  # per phase: a request is tried on at most 1 + MAX_RETRIES workers of a role
SUSPECT_S = 2.0  # a worker that failed with a connection error gets nothing new for this long

# details of an INTERNAL that grpc itself raises when the connection breaks (the peer died); a worker's
# own INTERNAL (its engine failed) says what failed instead, and is relayed as it is
_TRANSPORT = ("rst_stream", "stream removed", "socket closed", "connection reset", "goaway", "broken pipe")
_RETRY = {
    "prefill": (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED),
    "decode": (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED),
}
_RELAYED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
)


def connection_lost(err: grpc.aio.AioRpcError) -> bool:
    """The call failed because the connection to the worker broke (not because the worker said no)."""
    code = err.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return True
    details = (err.details() or "").lower()
    return code == grpc.StatusCode.INTERNAL and any(hint in details for hint in _TRANSPORT)


def retryable(role: str, err: grpc.aio.AioRpcError) -> bool:
    """Whether another worker of `role` may serve what this failed call asked for."""
    return err.code() in _RETRY[role] or connection_lost(err)


def relay_code(err: grpc.aio.AioRpcError) -> grpc.StatusCode:
    """The status code the client sees for a worker call that failed for good: the worker's own answer
    when it gave one, UNAVAILABLE when the connection broke, INTERNAL for anything else (a cluster
    fault, such as a secret mismatch, that the client cannot fix)."""
    code = err.code()
    if code in _RELAYED:
        return code
    if connection_lost(err):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class Failover:
    """What every worker call shares when it fails: its error (`failed`) and whether another worker of
    its role gets the call (`retry`)."""

    def __init__(self, directory: Directory, metrics: RouterMetrics):
        self.directory = directory
        self.metrics = metrics

    def failed(self, worker: Member, role: str, err: grpc.aio.AioRpcError) -> WorkerFailed:
        """The WorkerFailed of a failed call; a worker whose connection broke gets nothing new for a
        while (SUSPECT_S)."""
        if connection_lost(err):
            self.directory.suspect(worker, SUSPECT_S)
        return WorkerFailed(
            relay_code(err), f"{role} worker {worker.member_id}: {err.details()}", retryable(role, err)
        )

    def retry(self, handle: Inflight, err: WorkerFailed, role: str, tries: int) -> bool:
        """Whether a failed worker call is tried again on another worker of `role` (logged, counted)."""
        if not err.retry or tries > MAX_RETRIES or handle.aborted or handle.remaining() <= 0:
            return False
        log.warning("%s of %s failed, trying another worker: %s", role, handle.request_id, err)
        self.metrics.failover(role, err.code.name)
        return True


def pick_excluding(directory: Directory, role: str, tried: set[str], blocks: int = 0) -> Member | None:
    """`directory.pick`, but never a member (or a member of a group) in `tried`: the least-loaded live
    one of the rest. `blocks` is taken off the chosen member's free count as `pick` does."""
    member = directory.pick(role, blocks)
    if member is None or not _tried(member, tried):
        return member
    member.free_blocks += blocks  # not this one after all
    now = time.monotonic()
    others = [
        m
        for m in directory.members[role].values()
        if not _tried(m, tried) and m.suspect_until <= now and not m.draining
    ]
    if not others:
        return None
    member = min(others, key=lambda m: (m.inflight, -m.free_blocks, m.member_id))
    member.free_blocks -= blocks
    return member


def _tried(member: Member, tried: set[str]) -> bool:
    return member.member_id in tried or (bool(member.group) and member.group in tried)


def resume_request(
    first: worker_pb2.DecodeRequest, prompt: Sequence[int], produced: Sequence[int], max_tokens: int
) -> worker_pb2.DecodeRequest:
    """The DecodeRequest that continues `first` (the request's first dispatch) on another worker after
    `produced` tokens came out of it: `prompt` + `produced` but the last, which becomes the first token
    (disaggregated: the prompt's pool blocks cover what they covered, the rest is recomputed), or the
    whole of it computed there (colocated: prefill_here). The token budget (and min_tokens) shrinks by what
    was made; `output_offset` tells the worker which prompt tokens were outputs."""
    resumed = worker_pb2.DecodeRequest()
    resumed.CopyFrom(first)
    del resumed.prompt_token_ids[:]
    if first.prefill_here or not produced:
        resumed.prompt_token_ids.extend([*prompt, *produced])
        made = len(produced)
    else:
        resumed.prompt_token_ids.extend([*prompt, *produced[:-1]])
        resumed.first_token_id = produced[-1]
        made = len(produced) - 1
    resumed.output_offset = made  # the penalties go on counting them
    resumed.sampling.max_tokens = max_tokens - made
    resumed.sampling.min_tokens = max(0, resumed.sampling.min_tokens - made)
    resumed.sampling.ClearField("prompt_logprobs")  # the client has them already
    return resumed
