"""The in-process engine: continuous batching over one model.

How a request moves: `add_request` validates and tokenizes it into the scheduler's waiting queue. Each
`step()` is `schedule() -> run(batch) -> update(batch, output)`: the scheduler picks this step's tokens
(decodes, prefill chunks, newly admitted prompts), the model runner computes them in one ragged forward
pass and samples, and the update appends tokens, applies stop rules and frees finished requests.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvferry.engine.block_hash import model_fingerprint
from kvferry.engine.block_manager import BlockManager
from kvferry.engine.cost_model import StepCostModel, step_pairs
from kvferry.engine.draft_model import DraftModelProposer
from kvferry.engine.kv_handoff import KVHandoff
from kvferry.engine.model_runner import ModelRunner, StepInputs, kv_block_bytes
from kvferry.engine.mtp_proposer import MtpProposer
from kvferry.engine.output import Completion, OutputState, RequestOutput
from kvferry.engine.request import (
    InvalidRequestError,
    Request,
    RequestStatus,
    SamplingParams,
    validate_request,
)
from kvferry.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from kvferry.engine.spec_decode import NgramProposer, SpeculativeConfig, SpeculativeConfigError
from kvferry.engine.structured import Grammars
from kvferry.flags import meta
from kvferry.kernels.select import KERNEL_CHOICES, KernelsUnavailable, choose
from kvferry.model.config import (
    ModelConfig,
    ModelConfigError,
    generation_eos_ids,
    resolve_dtype,
)
from kvferry.model.create import resolve_model
from kvferry.model.loader import checkpoint_digest, load_model
from kvferry.model.parallel import Parallel
from kvferry.model.quant import QUANTIZATION_CHOICES, QuantizationError, act_qmax, check_quantization
from kvferry.model.sampler import Sampled
from kvferry.model.tokenizer import Tokenizer
from kvferry.settings import load_settings

log = logging.getLogger(__name__)


DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings: `kvferry generate`'s and the workers' flags, a cluster file's `prefill:` /
    `decode:` keys and `kvferry up`'s engine flags are derived from these fields (`kvferry.flags`);
    `roles`: the worker roles a setting is for (`kvferry up` applies it to their groups only)."""

    model: str = field(
        default="tiny",
        metadata=meta(
            "checkpoint directory, or a built-in name (tiny, bench, trained, draft)", launcher=True
        ),
    )
    dtype: str = field(
        default="auto", metadata=meta("the weights' and activations' dtype", choices=DTYPES, launcher=True)
    )
    device: str = field(default="auto", metadata=meta("auto, cpu or cuda"))
    block_size: int = field(default=16, metadata=meta("tokens per KV block (the pool's too)"))
    max_num_seqs: int = field(default=256, metadata=meta("requests a worker batches at most"))
    max_num_batched_tokens: int = field(
        default=2048, metadata=meta("tokens one step computes at most (longer prompts are chunked)")
    )
    max_model_len: int | None = field(
        default=None, metadata=meta("prompt + output tokens at most (default: the model's)")
    )
    num_kv_blocks: int | None = field(
        default=None, metadata=meta("KV cache blocks (default: --kv-cache-memory-gib's worth)")
    )
    kv_cache_memory_gib: float = field(default=1.0, metadata=meta("the KV cache's size"))
    enable_prefix_caching: bool = field(default=True, metadata=meta("reuse cached prompt prefixes"))
    seed: int = field(default=0, metadata=meta("seed for requests that give none", flag="engine-seed"))
    tensor_parallel_size: int = field(
        default=1,
        metadata=meta("ranks of a prefill group (tensor parallel; separate processes)", roles=("prefill",)),
    )
    expert_parallel_size: int = field(
        default=1, metadata=meta("ranks of a decode group (expert parallel)", roles=("decode",))
    )
    kernels: str = field(
        default="auto",
        metadata=meta(
            "auto: Triton kernels on CUDA, the C++ CPU kernels for float32 on CPU (built on first use); "
            "torch: plain torch ops; triton: the Triton kernels (on a CPU only under TRITON_INTERPRET=1)",
            choices=KERNEL_CHOICES,
        ),
    )
    # (engine.loop.EngineLoop; None or 0: as fast as it can); `kvferry up` sets it where decode shares cores
    decode_step_interval_ms: float | None = field(
        default=None,
        metadata=meta(
            "decode workers: step at most once per this interval while 4 or more requests run (bigger "
            "decode batches for the same weight reads; the spare time goes to whatever shares the cores)",
            roles=("decode",),
        ),
    )
    # (engine.loop, engine.host_share); `kvferry up` sets it where decode shares cores with prefill
    decode_yield_ms: float | None = field(
        default=None,
        metadata=meta(
            "decode workers sharing a host's cores with prefill workers (a host share directory): while "
            "a prefill there computes, hold the next step back until it is done or this long after the "
            "previous step started (0 or unset: never)",
            roles=("decode",),
        ),
    )
    # vLLM's and SGLang's --stream-interval
    stream_interval: int = field(
        default=1,
        metadata=meta(
            "decode workers: stream a request's tokens this many per message after its first (fewer "
            "messages for the router; the client gets them in bursts)",
            roles=("decode",),
        ),
    )
    # vLLM's --num-scheduler-steps (multi-step scheduling): LLMEngine._burst says when it applies
    num_scheduler_steps: int = field(
        default=1,
        metadata=meta(
            "decode steps per scheduler step while every running request is a plain greedy decode and none "
            "waits (one call of the C++ step for DeepSeek-V3-shaped models on CPU, else a forward pass a "
            "step; not with an MTP layer or across ranks): less Python a token, tokens streamed in bursts",
            roles=("decode",),
        ),
    )
    # a cluster file may give the mapping (engine.spec_decode); tokens are decoded on the decode groups only
    speculative_config: str | dict | None = field(
        default=None,
        metadata=meta(
            'speculative decoding, as vLLM spells it: JSON such as \'{"method": "ngram", '
            '"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (prompt lookup)',
            roles=("decode",),
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=meta(
            "int8: attention and expert weights int8 per output channel, activations int8 per token "
            "(W8A8, dynamic; C++ kernels with AVX512-VNNI or AVX2 on CPU, Triton on CUDA; model/quant.py)",
            choices=QUANTIZATION_CHOICES,
        ),
    )
    # float32 under the CPU kernels; the int8 row's float32 scale is in the row (`kernels.int8`)
    kv_cache_dtype: str = field(
        default="auto",
        metadata=meta(
            "int8: K/V rows int8 with a float32 scale each (a quarter of float32's bytes, in the cache, "
            "the pool and on the wire); auto: the activations' dtype",
            choices=KV_CACHE_DTYPES,
        ),
    )

    def validate(self) -> None:
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
            "expert_parallel_size",
            "stream_interval",
            "num_scheduler_steps",
        ):
            if getattr(self, name) <= 0:
                raise EngineConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise EngineConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kernels not in KERNEL_CHOICES:
            choices = ", ".join(KERNEL_CHOICES)
            raise EngineConfigError(f"kernels must be one of {choices}, got {self.kernels!r}")
        for name in ("decode_step_interval_ms", "decode_yield_ms"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 1000:
                raise EngineConfigError(f"{name} must be in [0, 1000], got {getattr(self, name)}")
        if self.kv_cache_memory_gib <= 0:
            raise EngineConfigError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            fp8 = " (fp8 KV caches are not implemented: use int8)" if "fp8" in self.kv_cache_dtype else ""
            raise EngineConfigError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}{fp8}"
            )
        try:
            check_quantization(self.quantization)
        except QuantizationError as err:
            raise EngineConfigError(str(err)) from None
        try:
            SpeculativeConfig.parse(self.speculative_config)
        except (SpeculativeConfigError, TypeError) as err:
            raise EngineConfigError(str(err)) from None
        if self.tensor_parallel_size > 1 and self.expert_parallel_size > 1:
            raise EngineConfigError(
                "tensor_parallel_size and expert_parallel_size cannot both be > 1 in one group "
                "(prefill groups are tensor-parallel, decode groups expert-parallel)"
            )


class EngineConfigError(ValueError):
    """An engine setting that cannot work (the message names the flag)."""


class LLMEngine:
    def __init__(self, cfg: EngineConfig, parallel: Parallel | None = None, detokenize: bool = True):
        """`parallel`: this rank's TP/EP groups, whose sizes must match the config's degrees.
        `detokenize`: make the outputs' text (a worker sends token ids only: the router detokenizes)."""
        cfg.validate()
        parallel = parallel or Parallel.single()
        if (parallel.tp_size, parallel.ep_size) != (cfg.tensor_parallel_size, cfg.expert_parallel_size):
            raise EngineConfigError(
                f"tensor_parallel_size={cfg.tensor_parallel_size}, expert_parallel_size="
                f"{cfg.expert_parallel_size} need a group of that many worker processes: serve them with "
                "`kvferry up` or the worker command (the offline engine runs one process)"
            )
        self.parallel = parallel
        settings = load_settings()
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        )
        self.model_dir = resolve_model(cfg.model, settings.models_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        model_cfg = ModelConfig.from_dir(self.model_dir)
        self.dtype = resolve_dtype(cfg.dtype, model_cfg, self.device)
        self.max_model_len = cfg.max_model_len or model_cfg.max_position_embeddings
        self.model = load_model(
            self.model_dir, self.dtype, self.device, max_positions=self.max_model_len, parallel=parallel
        )
        try:  # the one place the kernels are chosen (kernels.select); workers report it in WorkerInfo
            self.kernel_backend = choose(self.device, self.dtype, cfg.kernels)
        except KernelsUnavailable as err:
            raise EngineConfigError(str(err)) from err
        self.quantization = check_quantization(cfg.quantization)
        if self.kernel_backend == "cpu" and not self.model.pack_weights(self.quantization):
            self.kernel_backend = "torch"  # the C++ kernels did not build here
        elif self.kernel_backend == "triton":
            self.model.use_triton()
        if self.quantization and self.kernel_backend != "cpu":
            self.model.quantize_weights()  # int8 for linear()'s Triton / torch W8A8
        log.info(
            "kernels: %s (%s, %s%s)",
            self.kernel_backend,
            self.device,
            self.dtype,
            f", {self.quantization} weights" if self.quantization else "",
        )
        if cfg.kv_cache_dtype == "int8" and self.kernel_backend == "triton":
            raise EngineConfigError("--kv-cache-dtype int8 runs on the CPU kernels or torch ops, not Triton")
        # == model.config.kv_cache_dtype(...): float32 under the kernels, or int8
        self.kv_dtype = torch.int8 if cfg.kv_cache_dtype == "int8" else self.model.embed.dtype
        tokenizer_eos = () if self.tokenizer.eos_token_id is None else (self.tokenizer.eos_token_id,)
        self.eos_ids = tuple(
            dict.fromkeys(model_cfg.eos_token_ids + generation_eos_ids(self.model_dir) + tokenizer_eos)
        )
        num_blocks = cfg.num_kv_blocks or int(
            cfg.kv_cache_memory_gib * 2**30 // kv_block_bytes(self.model, cfg.block_size, self.kv_dtype)
        )
        if num_blocks * cfg.block_size < self.max_model_len:
            raise ModelConfigError(
                f"the KV cache holds {num_blocks * cfg.block_size} tokens, fewer than max_model_len "
                f"{self.max_model_len}: raise --kv-cache-memory-gib or --num-kv-blocks, "
                "or lower --max-model-len"
            )
        self.checkpoint_id = checkpoint_digest(self.model_dir)
        # the KV's numerics: the model's dtype, and the cache's where it differs (bf16 matmuls, float32 KV)
        numerics = str(self.dtype) if self.kv_dtype == self.dtype else f"{self.dtype}/kv-{self.kv_dtype}"
        if self.quantization:  # int8 weights make other KV: their blocks never mix with the dtype's
            numerics += f"/w-{self.quantization}"
            qmax = act_qmax(self.device)
            if qmax != 127:  # an AVX2-only CPU's 7-bit activations: other KV again
                numerics += f"/a{qmax}"
        fingerprint = model_fingerprint(self.checkpoint_id, numerics)
        self.fingerprint = fingerprint
        self.block_manager = BlockManager(num_blocks, cfg.block_size, fingerprint, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens), self.block_manager
        )
        self.runner = ModelRunner(self.model, num_blocks, cfg.block_size, self.device, self.kv_dtype)
        self.runner.eos_ids = self.eos_ids
        self._grammars: Grammars | None = None
        self.detokenize = detokenize
        self.states: dict[str, OutputState] = {}
        self._ids = itertools.count()
        self._ended: list[OutputState] = []  # finished outside a step (aborted, done on arrival)
        self.num_steps = 0
        self.step_costs = StepCostModel()  # step time against batch size: SLO-aware admission's cost model
        speculative = SpeculativeConfig.parse(cfg.speculative_config)
        self.proposer: NgramProposer | DraftModelProposer | MtpProposer | None = None
        if speculative is not None and speculative.method == "draft_model":
            try:
                self.proposer = DraftModelProposer(
                    speculative,
                    self.model.cfg,
                    self.device,
                    cfg.dtype,
                    cfg.kernels,
                    self.max_model_len,
                    cfg.block_size,
                    num_blocks,
                    int(cfg.kv_cache_memory_gib * 2**30) // 4,  # the draft's cache: a quarter of the budget
                )
            except SpeculativeConfigError as err:
                raise EngineConfigError(str(err)) from None
        elif speculative is not None and speculative.method == "mtp":
            if self.model.mtp is None:
                raise EngineConfigError(
                    "speculative_config.method mtp: this checkpoint has no MTP layer "
                    "(num_nextn_predict_layers with its weights, as DeepSeek-V3's)"
                )
            self.proposer = MtpProposer(speculative, self.runner, self.block_manager)
        elif speculative is not None:
            self.proposer = NgramProposer(speculative)
        self.spec_proposed = 0  # draft tokens verified, and those the target accepted
        self.spec_accepted = 0
        self.kv = KVHandoff(self)  # what the workers do with KV computed or used elsewhere

    @property
    def grammars(self) -> Grammars:
        """The structured-output compiler of this engine's tokenizer (made on first use; thread-safe)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer.to_json(), self.model.cfg.vocab_size, self.eos_ids)
        return self._grammars

    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; returns its id. `priority`: lower values are scheduled first, and a running
        request of a lower priority may be preempted for it (engine.scheduler)."""
        req = self.make_request(prompt, params, prompt_token_ids, request_id, priority=priority)
        self.submit(req)
        return req.request_id

    def submit(self, req: Request) -> None:
        """Queue a request made by `make_request`."""
        self.track(req)
        self.scheduler.add(req)

    def track(self, req: Request) -> OutputState:
        """The output state of a request the engine takes on (`submit`, `kv.await_kv`)."""
        tokenizer = self.tokenizer if self.detokenize else None
        state = self.states[req.request_id] = OutputState(req, tokenizer, self.eos_ids, self.max_model_len)
        return state

    def has_request(self, request_id: str) -> bool:
        """Whether the engine holds this request (queued, running, or waiting for its remote KV)."""
        return request_id in self.states

    def make_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        matcher=None,
        priority: int = 0,
    ) -> Request:
        """Validate and tokenize a request without scheduling it (raises InvalidRequestError).
        `matcher`: its structured output's matcher, compiled by the caller (`grammars`)."""
        params = params or SamplingParams()
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        if prompt_token_ids is None:
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = validate_request(prompt_token_ids, params, self.model.cfg.vocab_size, self.max_model_len)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.states:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        req = Request(request_id, ids, params, priority=priority)
        if params.structured is not None:  # (a worker passes one it compiled off the engine thread)
            req.matcher = matcher if matcher is not None else self.grammars.matcher(*params.structured)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its stream ends with finish_reason 'abort'. False if it is unknown."""
        state = self.states.get(request_id)
        if state is None or state.req.is_finished:
            return False
        self.scheduler.finish(state.req, RequestStatus.FINISHED_ABORTED)
        self._ended.append(state)
        return True

    def finished_elsewhere(self, state: OutputState) -> None:
        """A request that finished outside a step: its last output goes out with the next step's."""
        self._ended.append(state)

    def mirror_steps(self, send: Callable[[StepInputs], None] | None) -> None:
        """Call send(inputs) with every step's forward inputs before computing them (a tensor-parallel
        leader sends them to its followers, which `execute` them)."""
        self.runner.broadcast_step = send

    def execute(self, inputs: StepInputs) -> None:
        """Compute one forward pass another rank scheduled (a tensor-parallel follower)."""
        self.runner.execute(inputs)

    @property
    def cpu_kernels(self) -> bool:
        """Whether the C++ CPU kernels serve this engine (`kernel_backend == "cpu"`)."""
        return self.kernel_backend == "cpu"

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._ended)

    def step(self, join: bool = False) -> list[RequestOutput]:
        """One scheduler step. `join`: run the forward pass even with nothing scheduled (an
        expert-parallel rank stepping in lock-step with busier ranks)."""
        outputs = [self._finish_output(s) for s in self._ended]
        self._ended = []
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if batch.work:
            model = self.runner.model
            layers = self.kv.layers_hook
            model.after_layer = None if layers is None else layers(batch)
            tokens, pairs, t0 = batch.num_tokens, step_pairs(batch.work), time.perf_counter()
            burst = self._burst(batch) if model.after_layer is None else None
            if burst is not None:
                outputs += self._update_burst(batch, burst)
                steps = len(burst)
            else:
                try:
                    sampled = self.runner.run(batch)
                finally:
                    model.after_layer = None
                outputs += self._update(batch, sampled)
                steps = 1
            self.step_costs.observe(tokens, pairs, (time.perf_counter() - t0) * 1e3 / steps)
            self.num_steps += steps
        elif join:
            self.runner.execute(StepInputs())
            self.num_steps += 1
        return outputs

    def _propose(self) -> None:
        """Draft tokens for every running request in steady decode (speculative decoding); a request with
        a structured output or prompt logprobs decodes one token per step."""
        eligible = []
        for req in self.scheduler.running:
            req.spec_tokens = []
            if (
                req.num_computed_tokens != req.num_tokens - 1
                or not req.output_token_ids
                or req.matcher is not None
                or req.params.prompt_logprobs is not None
            ):
                continue
            room = min(req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens)
            eligible.append((req, room - 1))
        if isinstance(self.proposer, MtpProposer):
            proposals = self.proposer.propose(eligible)
        else:
            items = [(req.request_id, req.all_token_ids, limit) for req, limit in eligible]
            running = {req.request_id for req in self.scheduler.running}
            proposals = self.proposer.propose_batch(items, running)
        for (req, _), drafts in zip(eligible, proposals, strict=True):
            req.spec_tokens = drafts

    def _update(
        self, batch: ScheduledBatch, sampled: dict[Request, Sampled | list[Sampled]]
    ) -> list[RequestOutput]:
        outputs = []
        for req in self.scheduler.update(batch):
            state = self.states[req.request_id]
            out = sampled[req]
            if isinstance(out, list):
                finished = self._add_verified(req, state, out)
            else:
                finished = state.add_token(out.token, out.logprob)
            outputs.append(self._output(req, state, finished))
        return outputs

    def _output(self, req: Request, state: OutputState, finished: RequestStatus | None) -> RequestOutput:
        """The step's output of `req`, finishing it where `finished` says (its blocks freed)."""
        if finished is None:
            return state.emit()
        if self.kv.finished_hook is not None:
            self.kv.finished_hook(req)
        self.scheduler.finish(req, finished)
        return self._finish_output(state)

    def _burst(self, batch: ScheduledBatch) -> list[list[int]] | None:
        """Multi-step decode (`num_scheduler_steps`): where every running request is in `batch` as a plain
        greedy decode (no drafts, logprobs, grammar or tokens banned, not a full prefix hit's recomputed
        token), none waits to be admitted and the free blocks hold them all, up to that many decode steps
        without the scheduler or the sampler between them (as many as every request's `max_tokens` and
        the model length leave room for). Each step's tokens; None: step once."""
        steps = self.cfg.num_scheduler_steps
        if steps <= 1 or not self.runner.bursts or self.proposer is not None:
            return None
        if self.scheduler.waiting or batch.preempted:
            return None
        if len(batch.work) != len(self.scheduler.running):
            return None
        blocks, reqs = self.block_manager, [req for req, _ in batch.work]
        for req, n in batch.work:
            if n != 1 or req.spec_tokens or req.num_computed_tokens != req.num_tokens - 1:
                return None
            # a full prefix hit recomputes its last token into the sink, never into the shared block
            if req.num_computed_tokens < req.num_committed_blocks * blocks.block_size:
                return None
            params = req.params
            if params.logprobs is not None or params.prompt_logprobs is not None or not req.output_token_ids:
                return None
            if not self.runner.argmax_only(req):  # (past min_tokens from here on, if it is now)
                return None
            # the tokens it may still get: max_tokens and the model length bound the burst
            room = min(params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens)
            steps = min(steps, room)
        if steps <= 1:
            return None
        # counted first, so that no request takes blocks for a burst that does not run
        need = [blocks.blocks_needed(r.num_computed_tokens + steps) - len(r.block_ids) for r in reqs]
        if sum(max(0, n) for n in need) > blocks.num_free_blocks:
            return None
        if not all(blocks.allocate(r, steps) for r in reqs):  # (cannot fail after the count)
            return None
        return self.runner.run_burst(reqs, steps)

    def _update_burst(self, batch: ScheduledBatch, burst: list[list[int]]) -> list[RequestOutput]:
        """`_update` for a burst's steps: each request takes its tokens in order up to the first that
        finishes it (the K/V of the steps after that one was computed into its own blocks, which it frees)."""
        outputs = []
        for i, (req, _) in enumerate(batch.work):
            state = self.states[req.request_id]
            finished = None
            for tokens in burst:
                req.num_computed_tokens += 1
                finished = state.add_token(tokens[i])
                if finished is not None:
                    break
            self.block_manager.commit(req)
            outputs.append(self._output(req, state, finished))
        return outputs

    def _add_verified(self, req: Request, state: OutputState, tokens: list[Sampled]) -> RequestStatus | None:
        """A decode with drafts: the accepted drafts (their KV was computed in this step) and the
        target's own token, up to the first that finishes the request."""
        self.spec_proposed += len(req.spec_tokens)
        self.spec_accepted += len(tokens) - 1
        req.spec_tokens = []
        finished = None
        for j, out in enumerate(tokens):
            finished = state.add_token(out.token, out.logprob)
            if finished is not None:
                break
            if j < len(tokens) - 1:  # an accepted draft: computed this step
                req.num_computed_tokens += 1
        if finished is None:
            self.block_manager.commit(req)
        return finished

    def _finish_output(self, state: OutputState) -> RequestOutput:
        del self.states[state.req.request_id]
        return state.emit()

    def stream(
        self, prompt: str | None = None, params: SamplingParams | None = None, **kwargs
    ) -> Iterator[RequestOutput]:
        """Add one request and yield its increments (other requests in the engine advance too)."""
        return self.outputs_of(self.add_request(prompt, params, **kwargs))

    def outputs_of(self, request_id: str) -> Iterator[RequestOutput]:
        """Step the engine until `request_id` finishes, yielding its increments."""
        if request_id not in self.states:
            raise InvalidRequestError(f"no unfinished request {request_id!r}")
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return

    def generate(
        self, requests: Sequence[dict], params: SamplingParams | None = None, use_tqdm: bool = False
    ) -> list[Completion]:
        """Run many requests at once; each dict holds `prompt` or `prompt_token_ids` (+ optional `params`)."""
        states = []
        for item in requests:
            rid = self.add_request(
                item.get("prompt"), item.get("params", params), prompt_token_ids=item.get("prompt_token_ids")
            )
            states.append(self.states[rid])
        bar = tqdm(total=len(states), desc="requests", unit="req", disable=not use_tqdm)
        start, generated = time.perf_counter(), 0
        while self.has_unfinished():
            for out in self.step():
                generated += len(out.new_token_ids)
                if out.finished:
                    bar.update(1)
            bar.set_postfix(out_tok_s=f"{generated / (time.perf_counter() - start):.0f}", refresh=False)
        bar.close()
        return [s.completion() for s in states]
