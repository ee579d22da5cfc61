"""Cluster configuration: one frozen dataclass per component, loadable from YAML.

```yaml
model: tiny            # checkpoint directory or built-in name
dtype: auto
namespace: default     # Redis key prefix (several clusters can share one Redis)
redis_url: null        # null: `kvferry up` starts its own redis-server (with a random password)
cluster_host: 127.0.0.1  # what workers, pool nodes, redis and the TCPStores bind: never exposed
cluster_secret: null   # the internal plane's secret (null: `kvferry up` generates one; kvferry.auth)
internal_tls: auto     # mutual TLS between the cluster's processes: auto | on | off (internal_tls_on)
router: {host: 127.0.0.1, port: 50051, max_inflight: 256, http_port: 8000, served_model_name: null,
         api_keys: [], ssl_certfile: null, ssl_keyfile: null,   # only the router faces clients
         routing: kv-aware,   # the prefill worker holding the longest prefix, weighed against load
         slo_ttft_ms: null, slo_tpot_ms: null,   # targets of requests that set none (router.slo)
         admission: predictive, on_predicted_miss: reject}   # refuse a request predicted to miss
pool: {nodes: 1, memory_gib: 1.0, per_ray_node: true, private_ttl_s: 20}
prefill: {replicas: 1, tensor_parallel_size: 1, max_num_batched_tokens: 512, kv_cache_memory_gib: 0.5}
decode: {replicas: 1, expert_parallel_size: 1, max_num_seqs: 256, kv_cache_memory_gib: 1.0}
drain_timeout_s: 60    # a stopping worker (scale-down, shutdown) finishes its requests for this long
ray: {address: null, max_restarts: 10, log_dir: null}   # `kvferry up --ray`
restarts: {max: 5, window_s: 600, backoff_s: 1, max_backoff_s: 30}   # `kvferry up`: a dead unit's restarts
autoscale: {enabled: false, prefill: [1, 4], decode: [1, 4], max_groups: null,   # the planner
            interval_s: 2, cooldown_s: 30, ttft_ms: null, tpot_ms: null, utilization: 0.8,
            down_margin: 1.25}   # (deploy.planner; null targets: router.slo_*_ms, else 1000 / 100)
```
A replica of a group is `tensor_parallel_size` (prefill) or `expert_parallel_size` (decode) processes.
`prefill` and `decode` also take a list of such mappings: groups of different degrees side by side.
`prefill` and `decode` take every engine flag of `kvferry generate` (snake_case), plus `resources`:
the Ray bundle of one rank, e.g. `{CPU: 8, GPU: 1}` or a custom resource that pins the group to
certain nodes (default: 1 CPU, and 1 GPU when the Ray cluster has GPUs). On Ray, `pool.per_ray_node`
puts one pool node on every Ray node (else `pool.nodes` of them, spread).
Every worker group must write KV blocks of the pool's one layout (the same block_size and KV dtype):
`cluster_layout` refuses, before anything starts, groups that would not.
`restarts` bound how often `kvferry up` restarts a dead unit (deploy.restarts): at most `max` in
`window_s`, waiting 1 s, 2 s, 4 s ... (at most `max_backoff_s`) before each.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
import yaml

from kvferry.deploy.planner import AutoscaleSettings
from kvferry.engine.engine import EngineConfig
from kvferry.kvpool.dataplane import TRANSFER_TIMEOUT_S
from kvferry.kvpool.transfer import BlockLayout
from kvferry.model.config import ModelConfig, kv_cache_dtype, resolve_dtype


class ClusterConfigError(ValueError):
    """A cluster setting that is missing, unknown or out of range (the message names it)."""


_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)} - {"model", "dtype"}


# A prefill worker runs one prompt's worth of tokens per step (chunking longer ones): on a compute-bound
# device a bigger step only makes every prompt in it wait for the slowest (measured on the 2-core CPU:
# 512 held 100% SLO attainment at 4 req/s, 2048 99% there and 83% at 3 req/s). GPUs set more.
ROLE_ENGINE_DEFAULTS = {"prefill": {"max_num_batched_tokens": 512}, "decode": {}}


@dataclass(frozen=True)
class RouterSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    max_inflight: int = 256
    http_port: int | None = 8000  # OpenAI-compatible API + /metrics; None = off, 0 = any free
    # the APIs' model name(s): one, or a list (every one accepted, the first shown; default: `model`)
    served_model_name: str | list[str] | None = None
    chat_template: str | None = (
        None  # the chat API's template: a Jinja file or the text (default: the model's)
    )
    generation_config: str = (
        "auto"  # sampling defaults: auto (the model's generation_config.json) | vllm | DIR
    )
    uvicorn_log_level: str = "warning"
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # clients send one (Bearer); () = open
    ssl_certfile: str | None = None  # the router serves TLS (gRPC and HTTP) with this cert and key
    ssl_keyfile: str | None = None
    routing: str = "kv-aware"  # the prefill worker choice: kv-aware | least-load (router.prefix_routing)
    slo_ttft_ms: float | None = None  # the latency targets of a request that sets none (None: no target)
    slo_tpot_ms: float | None = None
    admission: str = "predictive"  # predictive (refuse a predicted SLO miss) | cap (router.slo)
    on_predicted_miss: str = "reject"  # reject | deprioritize


@dataclass(frozen=True)
class PoolSettings:
    nodes: int = 1
    memory_gib: float = 1.0
    per_ray_node: bool = True  # on Ray: one pool node on every Ray node (else `nodes`, spread)
    private_ttl_s: float = 20.0  # an unread, unreleased private tail block (its router died) lives this long
    resources: dict = field(default_factory=dict)  # on Ray: what a pool node's actor reserves
    # the disk tier: evicted blocks spill to <disk_dir>/<node id> (None = off), up to disk_max_gib per node
    disk_dir: str | None = None
    disk_max_gib: float = 0.0
    replicas: int = 1  # copies of each block a prefill writes, on distinct nodes (as many as are live)
    # the longest wait on a pool peer within a transfer (a lost host, a partition): past it a get
    # recomputes what did not arrive and a put counts as not stored
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S
    # a prefill puts each layer's finished blocks while the next layers compute: on | off | auto (on when
    # the prefill computes on a GPU: on CPU the transfer takes cores from the compute)
    stream_layers: str = "auto"
    shm: bool = True  # False: workers on a node's host use its pair group too, as remote ones do
    # a block read over the network this many times within hot_window_s is copied to other nodes until
    # it has hot_replicas copies (0 = off)
    hot_reads: int = 8
    hot_window_s: float = 60.0
    hot_replicas: int = 2

    def __post_init__(self):
        if self.stream_layers not in ("on", "off", "auto"):
            raise ClusterConfigError(
                f"pool.stream_layers must be on, off or auto, got {self.stream_layers!r}"
            )
        if self.replicas < 1 or self.hot_replicas < 1 or self.hot_reads < 0 or self.hot_window_s <= 0:
            raise ClusterConfigError(
                "pool.replicas and pool.hot_replicas must be >= 1, pool.hot_reads >= 0 and "
                f"pool.hot_window_s > 0; got {self.replicas}, {self.hot_replicas}, {self.hot_reads}, "
                f"{self.hot_window_s}"
            )
        if self.transfer_timeout_s <= 0:
            raise ClusterConfigError(f"pool.transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if self.disk_dir is not None and self.disk_max_gib <= 0:
            raise ClusterConfigError(
                f"pool.disk_max_gib must be > 0 with pool.disk_dir, got {self.disk_max_gib}"
            )
        if self.disk_dir is None and self.disk_max_gib:
            raise ClusterConfigError("pool.disk_max_gib needs pool.disk_dir")


@dataclass(frozen=True)
class RaySettings:
    address: str | None = None  # None: the cluster RAY_ADDRESS names, or a local one
    max_restarts: int = 10  # per actor, and per component relaunch
    log_dir: str | None = None  # on every node (default: <tmp>/kvferry/<namespace>)


@dataclass(frozen=True)
class RestartSettings:
    """`kvferry up`'s restarts of a dead unit (redis, a pool node, a worker group, the router)."""

    max: int = 5  # restarts of one unit within window_s; one more and it is left down (and reported)
    window_s: float = 600.0
    backoff_s: float = 1.0  # the wait before the first restart; doubled before each next one
    max_backoff_s: float = 30.0


@dataclass(frozen=True)
class WorkerGroupSettings:
    replicas: int = 1
    engine: dict = field(default_factory=dict)  # EngineConfig overrides
    resources: dict = field(default_factory=dict)  # on Ray: one rank's bundle ({} = the default)


PLACEMENTS = ("prefill-first", "even")
_TOP_OVERRIDES = {
    "model",
    "dtype",
    "redis_url",
    "colocated",
    "namespace",
    "cluster_host",
    "cluster_secret",
    "internal_tls",
}
INTERNAL_TLS = ("auto", "on", "off")
# `kvferry up` flags
ENGINE_OVERRIDES = (
    "max_num_seqs",
    "max_model_len",
    "enable_prefix_caching",
    "quantization",
    "kv_cache_dtype",
)
SHARED_DECODE_STEP_MS = 40.0  # decode_step_interval_ms of decode ranks that share cores with prefill


@dataclass(frozen=True)
class Placement:
    """How one worker process runs on a shared host (ClusterConfig.host_placement)."""

    threads: int
    background: bool = False  # lowest CPU priority: yields the cores to everything else
    passive_wait: bool = False  # OpenMP threads sleep while they wait at a barrier instead of spinning
    # decode ranks: EngineConfig.decode_step_interval_ms unless the cluster file sets one (0: no pacing)
    step_interval_ms: float = 0.0

    def env(self) -> dict[str, str]:
        return {"KVFERRY_NUM_THREADS": str(self.threads)} | (
            {"OMP_WAIT_POLICY": "PASSIVE"} if self.passive_wait else {}
        )

    def command(self, argv: list[str]) -> list[str]:
        return ["nice", "-n", "19", *argv] if self.background else argv


@dataclass(frozen=True)
class ClusterConfig:
    model: str = "tiny"
    dtype: str = "auto"
    namespace: str = "default"
    redis_url: str | None = None
    # workers, pool nodes, redis and the groups' TCPStores bind this; only the router binds router.host
    cluster_host: str = "127.0.0.1"
    cluster_secret: str | None = field(default=None, repr=False)  # None: `kvferry up` makes one
    internal_tls: str = "auto"  # auto | on | off: mutual TLS between its processes (internal_tls_on)
    router: RouterSettings = RouterSettings()
    pool: PoolSettings = PoolSettings()
    # one group kind per role, or several (a list in YAML): e.g. TP=2 and TP=1 prefill groups side by side
    prefill: WorkerGroupSettings | tuple[WorkerGroupSettings, ...] = WorkerGroupSettings()
    decode: WorkerGroupSettings | tuple[WorkerGroupSettings, ...] = WorkerGroupSettings()
    startup_timeout_s: float = 180.0
    drain_timeout_s: float = 60.0
    ray: RaySettings = RaySettings()
    restarts: RestartSettings = RestartSettings()
    # the baseline: decode groups run both phases behind the same router; no prefill workers, no pool
    colocated: bool = False
    # how `kvferry up` shares one host's cores between worker processes (see host_placement)
    placement: str = "prefill-first"
    # the planner (deploy.planner): prefill / decode groups set from live load (`kvferry up --autoscale`)
    autoscale: AutoscaleSettings = field(default_factory=AutoscaleSettings)

    def validate(self) -> None:
        for role in ("prefill", "decode"):
            for settings in self.groups(role):
                if settings.replicas < 1:
                    raise ClusterConfigError(f"{role}.replicas must be >= 1, got {settings.replicas}")
        if self.pool.nodes < 1:
            raise ClusterConfigError(f"pool.nodes must be >= 1, got {self.pool.nodes}")
        if self.pool.memory_gib <= 0:
            raise ClusterConfigError(f"pool.memory_gib must be > 0, got {self.pool.memory_gib}")
        if self.pool.private_ttl_s <= 0:
            raise ClusterConfigError(f"pool.private_ttl_s must be > 0, got {self.pool.private_ttl_s}")
        if self.drain_timeout_s < 0:
            raise ClusterConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.ray.max_restarts < 0:
            raise ClusterConfigError(f"ray.max_restarts must be >= 0, got {self.ray.max_restarts}")
        r = self.restarts
        if r.max < 0 or r.window_s <= 0 or r.backoff_s < 0 or r.max_backoff_s < r.backoff_s:
            raise ClusterConfigError(
                "restarts: need max >= 0, window_s > 0 and 0 <= backoff_s <= max_backoff_s, "
                f"got {r.max}, {r.window_s}, {r.backoff_s}, {r.max_backoff_s}"
            )
        if bool(self.router.ssl_certfile) != bool(self.router.ssl_keyfile):
            raise ClusterConfigError("router.ssl_certfile and router.ssl_keyfile go together")
        from kvferry.router.prefix_routing import ROUTING_MODES

        if self.router.routing not in ROUTING_MODES:
            raise ClusterConfigError(
                f"router.routing must be one of {', '.join(ROUTING_MODES)}, got {self.router.routing!r}"
            )
        from kvferry.router.slo import ADMISSION_MODES, MISS_ACTIONS, check_default_target

        if self.router.admission not in ADMISSION_MODES:
            raise ClusterConfigError(f"router.admission must be one of {', '.join(ADMISSION_MODES)}")
        if self.router.on_predicted_miss not in MISS_ACTIONS:
            raise ClusterConfigError(f"router.on_predicted_miss must be one of {', '.join(MISS_ACTIONS)}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            try:
                check_default_target(f"router.{name}", getattr(self.router, name))
            except ValueError as err:
                raise ClusterConfigError(str(err)) from None
        gen = self.router.generation_config
        if gen not in ("auto", "vllm") and not (Path(gen).expanduser() / "generation_config.json").is_file():
            raise ClusterConfigError(
                f"router.generation_config (--generation-config) must be auto, vllm or a directory holding "
                f"a generation_config.json, got {gen!r}"
            )
        template = self.router.chat_template
        if template and "{" not in template and not Path(template).expanduser().is_file():
            raise ClusterConfigError(f"router.chat_template (--chat-template): no such file {template!r}")
        if self.cluster_host in ("0.0.0.0", "::", ""):
            raise ClusterConfigError(
                f"cluster_host {self.cluster_host!r} would expose workers, pool nodes and redis; "
                "only the router faces clients (router.host / --host)"
            )
        if self.internal_tls not in INTERNAL_TLS:
            raise ClusterConfigError(
                f"internal_tls must be one of {', '.join(INTERNAL_TLS)}, got {self.internal_tls!r}"
            )
        if self.placement not in PLACEMENTS:
            raise ClusterConfigError(
                f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        try:
            self.autoscale.validate()
        except ValueError as err:
            raise ClusterConfigError(str(err)) from None
        if self.autoscale.enabled and self.colocated:
            raise ClusterConfigError("autoscale: a colocated cluster has no prefill groups to plan")
        _check_resources("pool.resources", self.pool.resources)
        for role in ("prefill", "decode"):
            for settings in self.groups(role):
                _check_resources(f"{role}.resources", settings.resources)
        if not 0 <= self.router.port < 65536:
            raise ClusterConfigError(f"router.port must be in [0, 65535], got {self.router.port}")
        http = self.router.http_port
        if http is not None and (not isinstance(http, int) or not 0 <= http < 65536):
            raise ClusterConfigError(f"router.http_port must be in [0, 65535] or null (off), got {http!r}")
        for group in ("prefill", "decode"):
            for settings in self.groups(group):
                unknown = set(settings.engine) - _ENGINE_FIELDS
                if unknown:
                    raise ClusterConfigError(f"{group}: unknown engine setting(s) {sorted(unknown)}")
                EngineConfig(**settings.engine).validate()
                if group == "prefill" and settings.engine.get("expert_parallel_size", 1) != 1:
                    raise ClusterConfigError(
                        "prefill.expert_parallel_size: prefill groups are tensor-parallel "
                        "(tensor_parallel_size); experts are split along their intermediate dimension there"
                    )
                if group == "decode" and settings.engine.get("tensor_parallel_size", 1) != 1:
                    raise ClusterConfigError(
                        "decode.tensor_parallel_size: decode groups are data-parallel attention + "
                        "expert-parallel MoE (expert_parallel_size)"
                    )

    def internal_tls_on(self, ray: bool = False) -> bool:
        """Whether the cluster's processes talk mutual TLS: `on` / `off` as set; `auto`: on when one of
        them binds an address other hosts may reach (`cluster_host` not loopback, and always on Ray,
        whose nodes may be other hosts), off on a loopback cluster (TLS costs CPU on every streamed
        token there and protects nothing)."""
        if self.internal_tls != "auto":
            return self.internal_tls == "on"
        return ray or not is_loopback(self.cluster_host)

    def groups(self, role: str) -> tuple[WorkerGroupSettings, ...]:
        value = getattr(self, role)
        return value if isinstance(value, tuple) else (value,)

    def engine_config(self, role: str, index: int = 0) -> EngineConfig:
        settings = self.groups(role)[index]
        return EngineConfig(
            model=self.model, dtype=self.dtype, **(ROLE_ENGINE_DEFAULTS[role] | settings.engine)
        )

    def group_size(self, role: str, index: int = 0) -> int:
        """Processes in one replica of a group (its TP or EP degree)."""
        engine = self.engine_config(role, index)
        return engine.tensor_parallel_size * engine.expert_parallel_size

    def bundle(self, role: str, index: int, ray_gpus: bool) -> dict:
        """One rank's Ray bundle: the group's `resources`, else 1 CPU, plus 1 GPU when the Ray cluster
        has GPUs (`ray_gpus`) and the group's engine is not set to the CPU."""
        settings = self.groups(role)[index]
        if settings.resources:
            return dict(settings.resources)
        gpu = ray_gpus and self.engine_config(role, index).device != "cpu"
        return {"CPU": 1.0, **({"GPU": 1.0} if gpu else {})}

    def group_device(self, role: str, index: int = 0, ray_gpus: bool | None = None) -> str:
        """The device a group's engine runs on: its `device` setting unless that is `auto`; then, on Ray
        (`ray_gpus`: whether the Ray cluster has GPUs), cuda when its bundle holds a GPU, and under
        `kvferry up` (`ray_gpus` None: the processes run here) cuda when this host has one."""
        device = self.engine_config(role, index).device
        if device != "auto":
            return device
        if ray_gpus is None:
            return "cuda" if torch.cuda.is_available() else "cpu"
        return "cuda" if self.bundle(role, index, ray_gpus).get("GPU", 0) > 0 else "cpu"

    def members(self, role: str) -> int:
        """Registry entries the role will have: one per prefill group, one per decode rank."""
        if role == "prefill" and self.colocated:
            return 0
        return sum(
            s.replicas * (self.group_size(role, i) if role == "decode" else 1)
            for i, s in enumerate(self.groups(role))
        )

    def processes(self) -> int:
        return sum(
            s.replicas * self.group_size(role, i)
            for role in self.roles()
            for i, s in enumerate(self.groups(role))
        )

    def host_placement(self, cores: int) -> dict[str, Placement]:
        """Threads and CPU priority of each role's worker processes when they share one host's `cores`.

        `even`: every worker process gets `cores // processes` threads. `prefill-first` (the default;
        the same as `even` when colocated): the compute-bound prefill ranks share all the cores, and
        the decode ranks keep their even share at the lowest CPU priority (nice 19) wherever the two
        overlap, so TTFT gets the cores and decode — memory-bound, its TPOT SLO far above its step
        time — runs in what prefill leaves; prefill's OpenMP threads then sleep at a barrier instead
        of spinning (OMP_WAIT_POLICY=PASSIVE), so a waiting thread hands its core to decode. Those
        decode ranks also pace their steps (SHARED_DECODE_STEP_MS, the engine loop's pacing): a batch
        of 4 or more streams steps every 40 ms, 40% of a 100 ms TPOT SLO, carrying more tokens per
        weight read and leaving the cores to prefill in between.
        """
        even = max(1, cores // self.processes())
        if self.placement == "even" or self.colocated:
            return {role: Placement(even) for role in self.roles()}
        prefill_ranks = sum(
            s.replicas * self.group_size("prefill", i) for i, s in enumerate(self.groups("prefill"))
        )
        prefill = max(1, cores // prefill_ranks)
        shared = prefill * prefill_ranks + even * (self.processes() - prefill_ranks) > cores
        return {
            "prefill": Placement(prefill, passive_wait=shared),
            "decode": Placement(
                even, background=shared, step_interval_ms=SHARED_DECODE_STEP_MS if shared else 0.0
            ),
        }

    def roles(self) -> tuple[str, ...]:
        """The worker roles this cluster runs."""
        return ("decode",) if self.colocated else ("prefill", "decode")

    def with_overrides(self, **values) -> ClusterConfig:
        """Apply CLI flags (None = not given) on top of the file's values."""
        top = {k: v for k, v in values.items() if v is not None and k in _TOP_OVERRIDES}
        cfg = replace(self, **top)
        if values.get("port") is not None:
            cfg = replace(cfg, router=replace(cfg.router, port=values["port"]))
        if values.get("host") is not None:
            cfg = replace(cfg, router=replace(cfg.router, host=values["host"]))
        if values.get("no_http"):
            cfg = replace(cfg, router=replace(cfg.router, http_port=None))
        elif values.get("http_port") is not None:
            cfg = replace(cfg, router=replace(cfg.router, http_port=values["http_port"]))
        for key in (
            "served_model_name",
            "chat_template",
            "generation_config",
            "uvicorn_log_level",
            "slo_ttft_ms",
            "slo_tpot_ms",
            "admission",
            "on_predicted_miss",
        ):
            if values.get(key) is not None:
                cfg = replace(cfg, router=replace(cfg.router, **{key: values[key]}))
        engine = {k: values[k] for k in ENGINE_OVERRIDES if values.get(k) is not None}
        if engine:  # vLLM's engine flags: every group's engine
            for group in ("prefill", "decode"):
                cfg = cfg._each(group, lambda s, e=engine: replace(s, engine={**s.engine, **e}))
        if values.get("speculative_config") is not None:  # tokens are decoded on the decode groups only
            spec = {"speculative_config": values["speculative_config"]}
            cfg = cfg._each("decode", lambda s, e=spec: replace(s, engine={**s.engine, **e}))
        if values.get("api_keys"):
            cfg = replace(cfg, router=replace(cfg.router, api_keys=tuple(values["api_keys"])))
        for key in ("ssl_certfile", "ssl_keyfile"):
            if values.get(key) is not None:
                cfg = replace(cfg, router=replace(cfg.router, **{key: str(values[key])}))
        for group, key in (
            ("prefill", "prefill_tensor_parallel_size"),
            ("decode", "decode_expert_parallel_size"),
        ):
            if values.get(key) is not None:
                degree = {key.split("_", 1)[1]: values[key]}
                cfg = cfg._each(group, lambda s, d=degree: replace(s, engine={**s.engine, **d}))
        for group in ("prefill", "decode"):
            if values.get(f"{group}_replicas") is not None:
                count = values[f"{group}_replicas"]
                cfg = cfg._each(group, lambda s, n=count: replace(s, replicas=n))
        auto = {}
        if values.get("autoscale"):
            auto["enabled"] = True
        for key in ("prefill", "decode"):
            if values.get(f"autoscale_{key}") is not None:
                try:
                    auto[key] = _bounds(values[f"autoscale_{key}"], key)
                except (TypeError, ValueError) as err:
                    raise ClusterConfigError(f"--autoscale-{key} must be MIN:MAX ({err})") from None
        for key in ("max_groups", "cooldown_s"):
            if values.get(f"autoscale_{key}") is not None:
                auto[key] = values[f"autoscale_{key}"]
        if auto:
            cfg = replace(cfg, autoscale=replace(cfg.autoscale, **auto))
            cfg.validate()
        return cfg

    def _each(self, role: str, fn) -> ClusterConfig:
        changed = tuple(fn(s) for s in self.groups(role))
        return replace(self, **{role: changed if isinstance(getattr(self, role), tuple) else changed[0]})


def load_cluster_config(path: Path | None) -> ClusterConfig:
    if path is None:
        return ClusterConfig()
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ClusterConfigError(f"cannot read {path}: {err}") from None
    if not isinstance(raw, dict):
        raise ClusterConfigError(f"{path}: expected a mapping at the top level")
    return cluster_config_from_dict(raw)


def cluster_config_from_dict(raw: dict) -> ClusterConfig:
    raw = dict(raw)
    known = {f.name for f in fields(ClusterConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ClusterConfigError(f"unknown cluster setting(s) {sorted(unknown)}; known: {sorted(known)}")
    kwargs = {}
    sections = (
        ("router", RouterSettings),
        ("pool", PoolSettings),
        ("ray", RaySettings),
        ("restarts", RestartSettings),
        ("autoscale", AutoscaleSettings),
    )
    for name, cls in sections:
        if name in raw:
            kwargs[name] = _section(cls, raw.pop(name) or {}, name)
    if isinstance(raw.get("internal_tls"), bool):  # YAML 1.1 reads a bare on / off as a boolean
        raw["internal_tls"] = "on" if raw["internal_tls"] else "off"
    if "autoscale" in kwargs:  # YAML gives [min, max] lists
        auto = kwargs["autoscale"]
        try:
            kwargs["autoscale"] = replace(
                auto, prefill=_bounds(auto.prefill, "prefill"), decode=_bounds(auto.decode, "decode")
            )
        except (TypeError, ValueError) as err:
            raise ClusterConfigError(f"autoscale: {err}") from None
    if "router" in kwargs:  # YAML gives a list (or null)
        kwargs["router"] = replace(kwargs["router"], api_keys=tuple(kwargs["router"].api_keys or ()))
    for group in ("prefill", "decode"):
        if group in raw:
            section = raw.pop(group) or {}
            if isinstance(section, list):  # several groups of this role, e.g. of different degrees
                kwargs[group] = tuple(_group(item or {}, group) for item in section)
            else:
                kwargs[group] = _group(section, group)
    cfg = ClusterConfig(**raw, **kwargs)
    cfg.validate()
    return cfg


def _bounds(value, role: str) -> tuple[int, int]:
    """A role's autoscale bounds: [min, max] (a list or "min:max")."""
    if isinstance(value, str):
        value = value.split(":")
    lo, hi = value
    if isinstance(lo, bool) or isinstance(hi, bool):
        raise ValueError(f"{role} bounds must be two integers, got {value!r}")
    return int(lo), int(hi)


def _group(section: dict, role: str) -> WorkerGroupSettings:
    if not isinstance(section, dict):
        raise ClusterConfigError(f"{role}: expected a mapping (or a list of mappings)")
    section = dict(section)
    replicas = section.pop("replicas", 1)
    resources = section.pop("resources", None) or {}
    return WorkerGroupSettings(replicas=replicas, engine=section, resources=resources)


def is_loopback(host: str) -> bool:
    """`host` is a loopback address (or localhost); a host name may resolve to one other hosts reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to an address other hosts reach
        return False


def _check_resources(name: str, resources) -> None:
    if not isinstance(resources, dict):
        raise ClusterConfigError(f"{name}: expected a mapping of resource name to amount, e.g. {{GPU: 1}}")
    for key, amount in resources.items():
        if not isinstance(amount, int | float) or isinstance(amount, bool) or amount < 0:
            raise ClusterConfigError(f"{name}.{key} must be a number >= 0, got {amount!r}")


def cluster_config_to_dict(cfg: ClusterConfig) -> dict:
    """The YAML shape of a config (cluster_config_from_dict(cluster_config_to_dict(c)) == c)."""

    def group(s: WorkerGroupSettings) -> dict:
        return {"replicas": s.replicas, **s.engine, **({"resources": s.resources} if s.resources else {})}

    out = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    for name in ("router", "pool", "ray", "restarts", "autoscale"):
        out[name] = {f.name: getattr(out[name], f.name) for f in fields(out[name])}
    for role in ("prefill", "decode"):
        out["autoscale"][role] = list(getattr(cfg.autoscale, role))
    out["router"]["api_keys"] = list(cfg.router.api_keys)
    for role in ("prefill", "decode"):
        value = getattr(cfg, role)
        out[role] = [group(s) for s in value] if isinstance(value, tuple) else group(value)
    return out


def cluster_layout(
    cfg: ClusterConfig, model: ModelConfig | Path | str, ray_gpus: bool | None = None
) -> BlockLayout:
    """The pool's block layout: the one every worker group computes (`BlockLayout.for_model` with its
    engine's block_size and KV dtype on the device it runs on, see `ClusterConfig.group_device`).
    Refuses a cluster whose groups would compute different ones: the pool holds blocks of one layout.
    `model`: the ModelConfig or checkpoint directory. On CPU this loads the kernels (which the KV dtype
    depends on), building them on a machine's first start."""
    model_cfg = model if isinstance(model, ModelConfig) else ModelConfig.from_dir(Path(model))
    first: tuple[str, BlockLayout] | None = None
    for role in cfg.roles():
        for index in range(len(cfg.groups(role))):
            engine = cfg.engine_config(role, index)
            device = torch.device(cfg.group_device(role, index, ray_gpus))
            dtype = resolve_dtype(engine.dtype, model_cfg, device)
            layout = BlockLayout.for_model(
                model_cfg,
                engine.block_size,
                kv_cache_dtype(dtype, device, engine.kernels, engine.kv_cache_dtype),
            )
            name = f"{role} group {index} (device {device})"
            if first is None:
                first = (name, layout)
            elif layout != first[1]:
                raise ClusterConfigError(
                    f"{first[0]} and {name} would write different KV block layouts: {first[1]} vs "
                    f"{layout}; the pool holds one (give every group the same block_size, and a device "
                    "and kernels that keep the same KV dtype)"
                )
    return first[1]


def _section(cls, values: dict, name: str):
    known = {f.name for f in fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ClusterConfigError(f"{name}: unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
    return cls(**values)
