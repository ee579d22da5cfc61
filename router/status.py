"""`GetRequestStatus`: where a request stands, asked of any router of the fleet.

No router keeps a fleet-wide table of requests: the workers are where a request lives. The router asks
every prefill and decode worker of the registry at once (each answers only for the caller's own
requests: kvferry.auth.may_act_for) and reports the furthest stage any of them holds; a request this
router admitted that no worker holds yet is `queued`. An id nobody holds, or another key's, is NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from kvferry.auth import may_act_for
from kvferry.v1 import generate_pb2, worker_pb2

if TYPE_CHECKING:
    from kvferry.router.admission import Admission
    from kvferry.router.directory import Directory, Member

log = logging.getLogger(__name__)

# a request's stages in order: the furthest one a worker reports is where it stands
STAGES = ("queued", "prefilling", "waiting_for_kv", "decoding", "detached", "finished")


class StatusLookup:
    """Answers `GetRequestStatus` from this router's admission table and every worker's answer."""

    def __init__(self, directory: Directory, admission: Admission, timeout_s: float = 5.0):
        self.directory = directory
        self.admission = admission
        self.timeout_s = timeout_s

    async def status(self, request_id: str, owner: str) -> generate_pb2.RequestStatus | None:
        """`owner`'s request `request_id` as the fleet's workers hold it; None when none does (and this
        router did not admit it)."""
        handle = self.admission.get(request_id)
        here = handle is not None and may_act_for(owner, handle.owner)
        ask = worker_pb2.WorkerRequestStatusRequest(request_id=request_id, owner=owner)
        members = [
            m
            for role in ("prefill", "decode")
            for m in self.directory.members[role].values()
            if m.stub is not None
        ]
        answers = await asyncio.gather(*(self._ask(m, ask) for m in members))
        found = [a for a in answers if a is not None]
        if not found and not here:
            return None
        if found:
            status = max(found, key=lambda s: STAGES.index(s.state) if s.state in STAGES else -1)
        else:
            status = generate_pb2.RequestStatus(
                request_id=request_id, state="queued", prompt_tokens=len(handle.ids)
            )
        status.admitted_here = here
        return status

    async def _ask(self, member: Member, ask) -> generate_pb2.RequestStatus | None:
        try:
            reply = await member.stub.GetRequestStatus(ask, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:  # a worker that cannot answer holds nothing we can report
            log.warning("status of %s on %s failed: %s", ask.request_id, member.member_id, err.code().name)
            return None
        return reply.status if reply.found else None
