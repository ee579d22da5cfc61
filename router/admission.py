"""Admission: the cheap checks in order of cost (ready, limits, a free --max-inflight slot, a new id),
then tokenizing (off the event loop), validating every field, the prompt's block keys and the pool's
lookup of them, and the SLO check (`router.slo`). `Admission` owns the in-flight table: a request is in
it from its slot's reservation until its release ends (`router.release`), whichever API it came by.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import grpc

from kvferry.auth import owner_of_key, scoped_id
from kvferry.convert import sampling_from_proto
from kvferry.engine.block_hash import block_keys, salt_key
from kvferry.engine.request import InvalidRequestError, SamplingParams, validate_request
from kvferry.engine.structured import CompilerBusy, Grammars, StructuredOutputError, compile_off_loop
from kvferry.router.inflight import Inflight, RequestRejected, error_code
from kvferry.router.limits import check_limits
from kvferry.settings import split_key_spec
from kvferry.v1 import generate_pb2, worker_pb2

# the retry hint of a refusal for a full router (Retry-After / retry-after-ms): a slot frees when any
# of --max-inflight requests ends, and a client that retries at once only meets the same refusal
FULL_RETRY_AFTER_S = 1.0
COMPILE_RETRY_AFTER_S = 1.0  # the same, for a full queue of constraints to compile


@dataclass(frozen=True)
class KeyPolicy:
    """What requests made with one API key may do: ask for a priority no lower than `min_priority` (an
    unset one is raised to it), hold at most `max_inflight` sequences at once (0: no limit but
    --max-inflight), ask for at most `tokens_per_min` tokens a minute (0: no limit), and share cached
    prefixes with the keys of its `cache_group` ("": with none)."""

    min_priority: int = 0
    max_inflight: int = 0
    tokens_per_min: int = 0
    cache_group: str = ""


def key_policies(cfg: RouterConfig) -> dict[str, KeyPolicy]:
    """owner -> the policy of each key given options (`KEY:option=value:...`), the router's defaults
    (--min-priority, --max-inflight-per-key, --tokens-per-min-per-key) for what the key leaves out."""
    out = {}
    defaults = default_policy(cfg)
    for spec in cfg.api_keys:
        key, options = split_key_spec(spec)
        if options:
            out[owner_of_key(key)] = replace(defaults, **options)
    return out


def default_policy(cfg: RouterConfig) -> KeyPolicy:
    return KeyPolicy(cfg.min_priority, cfg.max_inflight_per_key, cfg.tokens_per_min_per_key)


def tenant_salt(cache_salt: str, owner: str, scope: str, group: str = "") -> str:
    """The salt a request's block keys are made with: its own `cache_salt` and, with --prefix-cache-scope
    key, its API key's identity (`owner`: a digest, never the key) or its key's cache group (`group`),
    so that requests of different keys (groups) share no cached block; a request without a key (an open
    cluster) keeps its salt as it is."""
    if scope != "key" or not owner:
        return cache_salt
    who = f"group:{group}" if group else f"owner:{owner}"
    return f"{who}\0{cache_salt}"


if TYPE_CHECKING:
    from kvferry.kvpool.metadata import MetadataStore
    from kvferry.model.tokenizer import Tokenizer
    from kvferry.router.config import RouterConfig
    from kvferry.router.directory import Directory
    from kvferry.router.metrics import RouterMetrics
    from kvferry.router.slo import SloPredictor


class Admission:
    """Admits requests (`admit`, `enter`) and holds them in flight until they are forgotten (`forget`,
    `withdraw`). `slo`: the SLO check a request passes last (None: none, as in unit tests)."""

    def __init__(
        self,
        cfg: RouterConfig,
        directory: Directory,
        metrics: RouterMetrics,
        meta: MetadataStore,
        tokenizer: Tokenizer,
        sampling_defaults: dict,
        slo: SloPredictor | None,
    ):
        self.cfg = cfg
        self.directory = directory
        self.metrics = metrics
        self.meta = meta
        self.tokenizer = tokenizer
        self.sampling_defaults = sampling_defaults
        self.slo = slo
        self.inflight: dict[str, Inflight] = {}
        self._grammars: Grammars | None = None
        self.default_policy = default_policy(cfg)
        self.policies = key_policies(cfg)  # owner -> its key's own policy
        self.per_owner: Counter[str] = Counter()  # sequences in flight per owner (an API key's digest)

    # -- the in-flight table --------------------------------------------------------------------------
    def count(self) -> int:
        return len(self.inflight)

    def policy(self, owner: str) -> KeyPolicy:
        """What the key behind `owner` may do (its own options, else the router's defaults)."""
        return self.policies.get(owner, self.default_policy)

    def get(self, request_id: str) -> Inflight | None:
        return self.inflight.get(request_id)

    def holds(self, request_id: str) -> bool:
        return request_id in self.inflight

    def add(self, handle: Inflight) -> None:
        """Count a handle made elsewhere as in flight (a sibling sequence: router.sequences)."""
        self.inflight[handle.request_id] = handle
        self.per_owner[handle.owner] += 1

    def forget(self, request_id: str) -> None:
        """Free a request's id and slot (once nothing it holds is left to release)."""
        handle = self.inflight.pop(request_id)
        left = self.per_owner[handle.owner] - 1
        if left > 0:
            self.per_owner[handle.owner] = left
        else:
            del self.per_owner[handle.owner]

    def withdraw(self, handle: Inflight) -> None:
        """Forget an admitted request that was never run (nothing was sent to a worker)."""
        handle.track.done(grpc.StatusCode.CANCELLED.name)
        self.forget(handle.request_id)

    # -- admitting ------------------------------------------------------------------------------------
    def reserve(
        self, request: generate_pb2.GenerateRequest, check_prompt: bool = True, owner: str = ""
    ) -> str:
        """The cheap checks, in order of cost: ready, limits (`check_prompt`: not for a resume, whose
        prompt is ignored), the API key's own (`owner`: its priority floor, its share of the slots), a
        free slot, a new id. Nothing is tokenized or copied before they pass."""
        model = self.directory.model
        if model is None or not self.directory.ready:
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE, "no prefill/decode workers are ready yet")
        if check_prompt:
            check_limits(request, model.max_model_len)
        if owner:
            self.check_key(request, owner, check_prompt)
        if len(self.inflight) >= self.cfg.max_inflight:
            raise RequestRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self.inflight)} requests in flight (--max-inflight {self.cfg.max_inflight}); "
                f"retry in {FULL_RETRY_AFTER_S:g} s",
                retry_after_s=FULL_RETRY_AFTER_S,
            )
        # scoped by the client's API key: no key can take an id another uses, or learn that it is in use
        request_id = scoped_id(owner, request.request_id or f"req-{uuid.uuid4().hex}")
        if request_id in self.inflight:
            raise RequestRejected(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.request_id!r} is already in flight"
            )
        return request_id

    def check_key(self, request: generate_pb2.GenerateRequest, owner: str, new: bool) -> None:
        """A keyed request within its key's policy: a priority no lower than its floor (400), and its
        sequences (n) within the key's share of the slots (RESOURCE_EXHAUSTED with a retry hint).
        `new`: not a resume (which asks for no priority and holds one sequence already running)."""
        policy = self.policy(owner)
        if new and request.priority == 0 and policy.min_priority > 0:
            request.priority = policy.min_priority  # unset (proto3's 0): the key's floor
        if new and request.priority < policy.min_priority:
            raise InvalidRequestError(
                f"priority: at least {policy.min_priority} for this API key (lower is more urgent, and "
                f"may preempt others), got {request.priority}"
            )
        if policy.max_inflight <= 0:
            return
        seqs = max(1, request.sampling.n) if new else 1
        held = self.per_owner[owner]
        if held + seqs > policy.max_inflight:
            raise RequestRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this API key has {held} sequences in flight and asks for {seqs} more (at most "
                f"{policy.max_inflight} per key); retry in {FULL_RETRY_AFTER_S:g} s",
                retry_after_s=FULL_RETRY_AFTER_S,
            )

    def enter(
        self,
        request: generate_pb2.GenerateRequest,
        timeout: float | None,
        api: str,
        owner: str = "",
        check_prompt: bool = True,
    ) -> Inflight:
        """`reserve`, then the request's handle in the table (its deadline: `timeout` from now, else
        --request-timeout-s). A refusal is counted in the metrics and raised."""
        t0 = time.perf_counter()
        try:
            request_id = self.reserve(request, check_prompt, owner)
        except (InvalidRequestError, RequestRejected) as err:
            self.metrics.rejected(api, error_code(err).name)
            raise
        timeout = self.cfg.request_timeout_s if timeout is None else timeout
        handle = self.inflight[request_id] = Inflight(
            request_id, time.monotonic() + timeout, t0, owner=owner, api=api
        )
        self.per_owner[owner] += 1
        return handle

    async def admit(
        self,
        request: generate_pb2.GenerateRequest,
        timeout: float | None,
        api: str,
        fill_max_tokens: bool = False,
        owner: str = "",
    ) -> Inflight:
        """Validate and admit a request (it counts as in flight from now on): then run it, or
        `withdraw` it. It takes its --max-inflight slot before it is tokenized, so a flood of huge prompts
        queues no more work than the slots allow. `fill_max_tokens`: an unset max_tokens means as many as
        fit (the chat API's default). Raises InvalidRequestError (bad input) or RequestRejected
        (RESOURCE_EXHAUSTED past --max-inflight or for a predicted SLO miss, ALREADY_EXISTS for an id in
        flight, UNAVAILABLE before the cluster is ready)."""
        handle = self.enter(request, timeout, api, owner)
        try:
            handle.ids, handle.params = await self.prepare(request, fill_max_tokens)
            self.metrics.traffic.arrived(len(handle.ids))  # the planner's demand: refused ones count
            handle.priority = request.priority
            if not self.cfg.colocated:  # (both Redis reads at once: the pool's, the backlogs)
                await asyncio.gather(
                    self.look_up(handle, request.cache_salt), self.directory.fresh_backlogs()
                )
            if self.slo is not None:
                self.slo.admit_by_slo(handle, request.slo)
            if owner:  # last: a request refused before this costs its key nothing
                await self.charge(
                    owner, len(handle.ids) + handle.params.max_tokens * max(1, request.sampling.n)
                )
        except BaseException as err:
            self.forget(handle.request_id)
            if isinstance(err, (InvalidRequestError, RequestRejected)):
                self.metrics.rejected(api, error_code(err).name)
            raise
        handle.cache_salt = request.cache_salt
        handle.track = self.metrics.track(api, handle.t0)
        return handle

    async def charge(self, owner: str, tokens: int) -> None:
        """Count `tokens` against the key's tokens_per_min, over every router (in Redis): past it,
        RESOURCE_EXHAUSTED with the wait until the minute's end."""
        limit = self.policy(owner).tokens_per_min
        if limit <= 0:
            return
        wait_s = await asyncio.to_thread(self.meta.charge_tokens, owner, tokens, limit)
        if wait_s > 0:
            raise RequestRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this API key asked for more than its {limit} tokens a minute (this request: {tokens}); "
                f"retry in {wait_s:.0f} s",
                retry_after_s=wait_s,
            )

    async def prepare(
        self, request: generate_pb2.GenerateRequest, fill_max_tokens: bool
    ) -> tuple[list[int], SamplingParams]:
        """Tokenize (in a thread: a long prompt must not stall every other stream) and validate."""
        model = self.directory.model
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidRequestError("prompt: set either text or token_ids")
        if which == "text":
            if not request.text:
                raise InvalidRequestError("prompt.text must not be empty")
            ids = await asyncio.to_thread(self.tokenizer.encode, request.text)
            if not ids:
                raise InvalidRequestError("prompt.text encodes to no tokens")
        else:
            ids = list(request.token_ids.ids)
        params = sampling_from_proto(request.sampling, self.sampling_defaults)
        if fill_max_tokens and not request.sampling.HasField("max_tokens"):
            room = max(1, model.max_model_len - len(ids))  # as many as fit, or the generation config's
            params = replace(params, max_tokens=min(room, self.sampling_defaults.get("max_tokens", room)))
        ids = validate_request(
            ids,
            params,
            model.vocab_size,
            model.max_model_len,
            prompt_field="prompt.token_ids",
            sampling_field="sampling.",
            max_tokens_fit=True,
        )
        if params.structured is not None:  # compiled here (cached) to refuse a bad one before any work
            kind, value = params.structured
            try:
                await self.compile(kind, value)
            except StructuredOutputError as err:
                raise InvalidRequestError(f"sampling.structured.{kind}: {err}") from None
        return ids, params

    async def compile(self, kind: str, value: str) -> None:
        """Compile a constraint in the bounded compile pool (cached): StructuredOutputError for one the
        library refuses (the caller names its field), RequestRejected (RESOURCE_EXHAUSTED, a retry hint)
        while the pool's queue is full."""
        try:
            await compile_off_loop(self.grammars(), kind, value)
        except CompilerBusy as err:
            raise RequestRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED, str(err), retry_after_s=COMPILE_RETRY_AFTER_S
            ) from None

    def grammars(self) -> Grammars:
        """The structured-output compiler of the served model's tokenizer (made on first use)."""
        model = self.directory.model
        if self._grammars is None or self._grammars.vocab_size != model.vocab_size:
            self._grammars = Grammars(self.tokenizer.to_json(), model.vocab_size, model.eos_token_ids)
        return self._grammars

    async def look_up(self, handle: Inflight, cache_salt: str) -> None:
        """The prompt's block keys (its one hash, sent on to the workers) and how much of them the pool
        holds (its one lookup): what predicting its TTFT and choosing its prefill worker take."""
        model = self.directory.model
        fingerprint = bytes.fromhex(model.fingerprint)
        group = self.policy(handle.owner).cache_group
        salt = salt_key(tenant_salt(cache_salt, handle.owner, self.cfg.prefix_cache_scope, group))
        keys = block_keys(handle.ids, model.block_size, fingerprint, salt)
        handle.prompt_keys = worker_pb2.PromptKeys(
            fingerprint=fingerprint, block_keys=keys, salt_key=salt or b""
        )
        handle.pooled = await asyncio.to_thread(self.meta.lookup_prefix, keys)
        self.metrics.pool_lookup()
