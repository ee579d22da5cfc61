"""Ending a request early and releasing what it leaves behind.

Whatever ends a request before its decode worker finished it (client cancel, deadline, Abort, a stop
string found here, a failure) ends in `Releases.end(handle, everything=True)`: the in-flight worker call
is cancelled, its decode worker is told to abort, and every pool node the router knows from the
registry drops the request's private blocks (`KVPool.Release`). A request that finished but may leave
its private tail block in the pool (`Inflight.release_pool`) gets the pool's release alone. The release
is a task of its own that the request's stream awaits shielded, so a client gone meanwhile cannot cut
it short; only then is the request's id freed (`Admission.forget`), so a release never hits a
successor with the same id. `abort` and `abort_elsewhere` serve the `Abort` RPC.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from kvferry.rpc import aio_channel
from kvferry.v1 import pool_pb2, pool_pb2_grpc, worker_pb2

if TYPE_CHECKING:
    from kvferry.router.admission import Admission
    from kvferry.router.directory import Directory, Member
    from kvferry.router.inflight import Inflight

log = logging.getLogger(__name__)


class Releases:
    """Releases what requests hold in the workers and the pool (`end`), and aborts requests (`abort`,
    `abort_elsewhere`). `ending`: the releases still running."""

    def __init__(self, directory: Directory, admission: Admission):
        self.directory = directory
        self.admission = admission
        self.pool_channels: dict[str, grpc.aio.Channel] = {}
        self.ending: set[asyncio.Future] = set()
        self.stopping = False  # the router's drain is over: what is cut now is left for a resume

    async def end(self, handle: Inflight, everything: bool) -> None:
        """Release what a request leaves behind (`everything`: in the workers and the pool; else the
        pool's private tail), then free its id. Its own task, so a cancel of the request's stream (the
        client went away just as its last message went out) cannot cut the release short and leave the
        tail to the pool's TTL: a cancel ends this wait, not the release."""
        ending = asyncio.ensure_future(self._end(handle, everything))
        self.ending.add(ending)
        ending.add_done_callback(self.ending.discard)
        await asyncio.shield(ending)

    async def _end(self, handle: Inflight, everything: bool) -> None:
        try:
            if everything:
                await self.cleanup(handle)
            else:
                await self.release_pool(handle.request_id)
        finally:
            self.admission.forget(handle.request_id)

    async def cleanup(self, handle: Inflight) -> None:
        """Release everything a request that ended early holds in the workers and the pool. While the
        router stops (`stopping`: its drain is over), a detachable stream is left to its decode worker,
        which holds it for a resume through another router once this one's links close."""
        if self.stopping and handle.linked and handle.detachable:
            return
        for call in list(handle.calls):
            call.cancel()
        rid = handle.request_id
        # a stream on a relay link was aborted by its cancel, there alone: an Abort call by id could end
        # the same request resumed meanwhile through another router
        if handle.decode is not None and not handle.linked:
            try:
                await handle.decode.stub.Abort(worker_pb2.WorkerAbortRequest(request_id=rid), timeout=5)
            except grpc.aio.AioRpcError as err:
                log.warning("abort of %s on %s failed: %s", rid, handle.decode.member_id, err)
        await self.release_pool(rid)

    async def release_pool(self, request_id: str) -> None:
        """Every pool node of the registry (as last read) drops the request's private blocks."""
        for node_id, node in list(self.directory.pool_nodes.items()):
            addr = node.addr
            channel = self.pool_channels.get(addr)
            if channel is None:
                channel = self.pool_channels[addr] = aio_channel(addr)
            try:
                await pool_pb2_grpc.KVPoolStub(channel).Release(
                    pool_pb2.ReleaseRequest(request_id=request_id), timeout=5
                )
            except grpc.aio.AioRpcError as err:
                log.warning("release of %s on pool node %s failed: %s", request_id, node_id, err)

    async def abort(self, handle: Inflight) -> None:
        """Abort a request in flight here: its decode worker stops it (its stream ends with "abort"),
        or, before its decode, its worker call is cancelled."""
        handle.aborted = True
        if handle.decode is not None:
            try:
                await handle.decode.stub.Abort(
                    worker_pb2.WorkerAbortRequest(request_id=handle.request_id), timeout=5
                )
            except grpc.aio.AioRpcError as err:
                log.warning("abort of %s failed: %s", handle.request_id, err)
        else:
            for call in list(handle.calls):
                call.cancel()

    async def abort_elsewhere(self, request_id: str, owner: str) -> bool:
        """Abort a request this router does not hold (another router of the fleet admitted it, or one
        that died left it detached): every decode worker is told, for this owner's stream only. True
        when one held it. One still in its prefill is not held yet: each worker remembers the abort a
        while, and ends the request with "abort" when its decode arrives."""
        ask = worker_pb2.WorkerAbortRequest(request_id=request_id, check_owner=True, owner=owner)

        async def tell(member: Member) -> bool:
            try:
                return (await member.stub.Abort(ask, timeout=5)).found
            except grpc.aio.AioRpcError as err:
                log.warning("abort of %s on %s failed: %s", request_id, member.member_id, err.code().name)
                return False

        members = [m for m in self.directory.members["decode"].values() if m.stub is not None]
        return any(await asyncio.gather(*(tell(m) for m in members)))
