"""Cluster configuration: one frozen dataclass per component, loadable from YAML.

Each component's config dataclass is the one declaration of its settings; the cluster file's sections
take its fields as keys, `kvferry up` takes them as flags (`add_up_args`: `kvferry up --help` lists every
one with its help and default) and the launchers spell them into each process's command line
(`kvferry.flags`):

- top level: `ClusterConfig`'s own fields (model, dtype, namespace, redis_url, cluster_host, ...);
- `router:` `kvferry.router.config.RouterConfig` (`kvferry up --<field>`: vLLM's names);
- `pool:` `kvferry.kvpool.config.PoolConfig` (`--pool-<field>`);
- `prefill:` / `decode:` a group: `replicas`, `resources` (the Ray bundle of one rank, e.g. `{CPU: 8, GPU:
  1}` or a custom resource that pins the group to certain nodes; default: 1 CPU, and 1 GPU when the Ray
  cluster has GPUs) and every `kvferry.engine.engine.EngineConfig` field (`kvferry up --<field>` for
  every group its role takes, `--prefill-<field>` / `--decode-<field>` for one role's); or a list of
  such mappings: groups of different degrees side by side;
- `ray:` `RaySettings`, `restarts:` `RestartSettings` (`--restarts-<field>`), `autoscale:`
  `kvferry.deploy.planner.AutoscaleSettings` (`--autoscale`, `--autoscale-<field>`).

```yaml
model: tiny
router: {port: 50051, routing: kv-aware, slo_ttft_ms: 1000}
pool: {nodes: 2, replicas: 2}
prefill: {replicas: 2, tensor_parallel_size: 1}
decode: [{replicas: 1}, {replicas: 1, expert_parallel_size: 2, resources: {GPU: 1}}]
autoscale: {enabled: true, prefill: [1, 4], decode: [1, 4]}
```
A replica of a group is `tensor_parallel_size` (prefill) or `expert_parallel_size` (decode) processes.
On Ray, `pool.per_ray_node` puts one pool node on every Ray node (else `pool.nodes` of them, spread).
Every worker group must write KV blocks of the pool's one layout (the same block_size and KV dtype):
`cluster_layout` refuses, before anything starts, groups that would not.
`restarts` bound how often `kvferry up` restarts a dead unit (deploy.restarts): at most `max` in
`window_s`, waiting 1 s, 2 s, 4 s ... (at most `max_backoff_s`) before each.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
import yaml

from kvferry.deploy.planner import AutoscaleSettings
from kvferry.engine.engine import EngineConfig
from kvferry.flags import (
    CLUSTER,
    SETTINGS,
    ConfigError,
    add_config_args,
    convert,
    meta,
    parsed_value,
    section,
    section_dict,
    settings_of,
)
from kvferry.kvpool.config import PoolConfig
from kvferry.kvpool.transfer import BlockLayout
from kvferry.model.config import ModelConfig, kv_cache_dtype, resolve_dtype
from kvferry.router.config import RouterConfig

ClusterConfigError = ConfigError  # a cluster setting that is missing, unknown or out of range


# A prefill worker runs one prompt's worth of tokens per step (chunking longer ones): on a compute-bound
# device a bigger step only makes every prompt in it wait for the slowest (measured on the 2-core CPU:
# 512 held 100% SLO attainment at 4 req/s, 2048 99% there and 83% at 3 req/s). GPUs set more.
ROLE_ENGINE_DEFAULTS = {"prefill": {"max_num_batched_tokens": 512}, "decode": {}}
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RaySettings:
    """`kvferry up --ray` (the cluster file's `ray:` section)."""

    address: str | None = field(
        default=None, metadata=meta("the Ray cluster (None: the one RAY_ADDRESS names, or a local one)")
    )
    max_restarts: int = field(default=10, metadata=meta("per actor, and per component relaunch"))
    log_dir: str | None = field(
        default=None, metadata=meta("on every node (default: <tmp>/kvferry/<namespace>)")
    )


@dataclass(frozen=True)
class RestartSettings:
    """`kvferry up`'s restarts of a dead unit (redis, a pool node, a worker group, the router)."""

    max: int = field(
        default=5,
        metadata=meta("restarts of one unit within window_s; one more and it is left down (and reported)"),
    )
    window_s: float = field(default=600.0, metadata=meta("the window restarts are counted in"))
    backoff_s: float = field(
        default=1.0, metadata=meta("the wait before the first restart; doubled before each next one")
    )
    max_backoff_s: float = field(default=30.0, metadata=meta("the longest wait before a restart"))


@dataclass(frozen=True)
class WorkerGroupSettings:
    """One kind of worker group (the cluster file's `prefill:` / `decode:` mapping, or one of a list)."""

    replicas: int = field(default=1, metadata=meta("how many groups of this kind run"))
    engine: dict = field(default_factory=dict, metadata={CLUSTER: True, "flag": None})  # EngineConfig's
    resources: dict = field(
        default_factory=dict, metadata={CLUSTER: True, "flag": None}
    )  # a rank's Ray bundle


PLACEMENTS = ("prefill-first", "even")
INTERNAL_TLS = ("auto", "on", "off")
SHARED_DECODE_STEP_MS = 40.0  # decode_step_interval_ms of decode ranks that share cores with prefill
SHARED_DECODE_YIELD_MS = 50.0  # their decode_yield_ms: a step waits this long at most for a prefill


@dataclass(frozen=True)
class Placement:
    """How one worker process runs on a shared host (ClusterConfig.host_placement)."""

    threads: int
    background: bool = False  # lowest CPU priority: yields the cores to everything else
    passive_wait: bool = False  # OpenMP threads sleep while they wait at a barrier instead of spinning
    # decode ranks: EngineConfig.decode_step_interval_ms unless the cluster file sets one (0: no pacing)
    step_interval_ms: float = 0.0
    # decode ranks: EngineConfig.decode_yield_ms unless the cluster file sets one (0: never yield)
    yield_ms: float = 0.0
    shares: bool = False  # shares its cores with the other kind: joins the host's share directory

    def engine_defaults(self) -> dict[str, float]:
        """The engine settings this placement picks for those the cluster file leaves unset."""
        values = {"decode_step_interval_ms": self.step_interval_ms, "decode_yield_ms": self.yield_ms}
        return {k: v for k, v in values.items() if v}

    def env(self) -> dict[str, str]:
        return {"KVFERRY_NUM_THREADS": str(self.threads)} | (
            {"OMP_WAIT_POLICY": "PASSIVE"} if self.passive_wait else {}
        )

    def command(self, argv: list[str]) -> list[str]:
        return ["nice", "-n", "19", *argv] if self.background else argv


@dataclass(frozen=True)
class ClusterConfig:
    """The whole cluster: its own settings (the cluster file's top level) and each component's section."""

    model: str = field(
        default="tiny", metadata=meta("checkpoint directory, or tiny | bench | trained | draft")
    )
    dtype: str = field(
        default="auto",
        metadata=meta("the workers' dtype", choices=("auto", "float32", "bfloat16", "float16")),
    )
    namespace: str = field(
        default="default", metadata=meta("cluster name (Redis key prefix, Ray controller name)")
    )
    redis_url: str | None = field(
        default=None,
        metadata=meta("use this Redis (default: kvferry up starts a redis-server with a password)"),
    )
    cluster_host: str = field(
        default="127.0.0.1",
        metadata=meta(
            "the address workers, pool nodes, redis and the KV data plane bind (never a wildcard; only "
            "the router binds --host)"
        ),
    )
    # the internal plane's secret (kvferry.auth); `kvferry up --cluster-secret-file` reads it from a file
    cluster_secret: str | None = field(default=None, repr=False, metadata={"flag": None})
    internal_tls: str = field(
        default="auto",
        metadata=meta(
            "mutual TLS between the cluster's processes: auto is on when --cluster-host is not loopback, and "
            "always on Ray; off on a loopback cluster (internal_tls_on)",
            choices=INTERNAL_TLS,
        ),
    )
    router: RouterConfig = field(default_factory=RouterConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    # one group kind per role, or several (a list in YAML): e.g. TP=2 and TP=1 prefill groups side by side
    prefill: WorkerGroupSettings | tuple[WorkerGroupSettings, ...] = WorkerGroupSettings()
    decode: WorkerGroupSettings | tuple[WorkerGroupSettings, ...] = WorkerGroupSettings()
    startup_timeout_s: float = field(
        default=180.0, metadata=meta("kvferry up waits this long for every unit to be ready")
    )
    drain_timeout_s: float = field(
        default=60.0,
        metadata=meta("a stopping worker (scale-down, shutdown) finishes its requests for this long"),
    )
    ray: RaySettings = RaySettings()
    restarts: RestartSettings = RestartSettings()
    colocated: bool = field(
        default=False,
        metadata=meta(
            "the baseline: decode workers run prefill too (no prefill workers, no pool), same router"
        ),
    )
    placement: str = field(
        default="prefill-first",
        metadata=meta("how kvferry up shares one host's cores between worker processes", choices=PLACEMENTS),
    )
    # the planner (deploy.planner): prefill / decode groups set from live load (`kvferry up --autoscale`)
    autoscale: AutoscaleSettings = field(default_factory=AutoscaleSettings)

    def validate(self) -> None:
        for role in ("prefill", "decode"):
            for settings in self.groups(role):
                if settings.replicas < 1:
                    raise ClusterConfigError(f"{role}.replicas must be >= 1, got {settings.replicas}")
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
        try:
            self.router.key_specs()
        except ValueError as err:
            raise ClusterConfigError(f"router: {err}") from None
        for name in ("router", "pool", "restarts", "autoscale", "ray"):
            _check_choices(getattr(self, name), name)
        _check_choices(self, "")
        from kvferry.router.slo import check_default_target

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
                unknown = set(settings.engine) - engine_settings()
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
        time — runs in what prefill leaves. Those decode ranks pace their steps (SHARED_DECODE_STEP_MS,
        the engine loop's pacing): a batch of 4 or more streams steps every 40 ms, 40% of a 100 ms TPOT
        SLO, carrying more tokens per weight read and leaving the cores to prefill in between; and they
        yield to prefill (SHARED_DECODE_YIELD_MS, engine.host_share): while a prefill of the host
        computes, a decode step waits, whatever the batch. Prefill's OpenMP threads sleep at a barrier
        instead of spinning (OMP_WAIT_POLICY=PASSIVE): under load a waiting thread hands its core to
        the rest of the host (decode between prefills, the KV writes, the router, the pool).
        """
        even = max(1, cores // self.processes())
        if self.placement == "even" or self.colocated:
            return {role: Placement(even) for role in self.roles()}
        prefill_ranks = sum(
            s.replicas * self.group_size("prefill", i) for i, s in enumerate(self.groups("prefill"))
        )
        prefill = max(1, cores // prefill_ranks)
        shared = prefill * prefill_ranks + even * (self.processes() - prefill_ranks) > cores
        if not shared:
            return {"prefill": Placement(prefill), "decode": Placement(even)}
        return {
            "prefill": Placement(prefill, passive_wait=True, shares=True),
            "decode": Placement(
                even,
                background=True,
                step_interval_ms=SHARED_DECODE_STEP_MS,
                yield_ms=SHARED_DECODE_YIELD_MS,
                shares=True,
            ),
        }

    def roles(self) -> tuple[str, ...]:
        """The worker roles this cluster runs."""
        return ("decode",) if self.colocated else ("prefill", "decode")

    def with_overrides(self, **values) -> ClusterConfig:
        """Apply `kvferry up`'s setting flags (`add_up_args`; keyword = the flag's dest, None = not given)
        on top of the file's values: each is walked back to its field (a section's, or the engine of
        every group of the roles it is for; a `--prefill-` / `--decode-` one after those)."""
        table = up_settings()
        unknown = set(values) - set(table)
        if unknown:
            raise ClusterConfigError(f"unknown kvferry up setting(s) {sorted(unknown)}")
        top: dict = {}
        sections: dict[str, dict] = {}
        engine: dict[str, dict] = {role: {} for role in ROLES}
        group: dict[str, dict] = {role: {} for role in ROLES}
        for dest in sorted(values, key=lambda d: table[d].role is not None):  # one role's after every role's
            value = values[dest]
            if value is None:
                continue
            where = table[dest]
            f = where.field
            value = convert(f, parsed_value(f, value), "--" + dest.replace("_", "-"))
            if where.section == "":
                top[f.name] = value
            elif where.section == "engine":
                for role in (where.role,) if where.role else f.metadata.get("roles", ROLES):
                    engine[role][f.name] = value
            elif where.section == "group":
                group[where.role][f.name] = value
            else:
                sections.setdefault(where.section, {})[f.name] = value
        cfg = replace(self, **top, **{k: replace(getattr(self, k), **v) for k, v in sections.items()})
        for role in ROLES:
            if engine[role] or group[role]:
                cfg = cfg._each(
                    role, lambda s, e=engine[role], g=group[role]: replace(s, engine={**s.engine, **e}, **g)
                )
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


SECTIONS = ("router", "pool", "ray", "restarts", "autoscale")


def engine_settings() -> set[str]:
    """The keys of a `prefill:` / `decode:` mapping that are its engine's (EngineConfig's settings)."""
    return {f.name for f in settings_of(EngineConfig)}


def cluster_config_from_dict(raw: dict) -> ClusterConfig:
    raw = dict(raw)
    known = {f.name for f in fields(ClusterConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ClusterConfigError(f"unknown cluster setting(s) {sorted(unknown)}; known: {sorted(known)}")
    kwargs = {}
    hints = typing.get_type_hints(ClusterConfig)
    for name in SECTIONS:
        if name in raw:
            kwargs[name] = section(hints[name], raw.pop(name) or {}, name)
    if isinstance(raw.get("internal_tls"), bool):  # YAML 1.1 reads a bare on / off as a boolean
        raw["internal_tls"] = "on" if raw["internal_tls"] else "off"
    for role in ROLES:
        if role in raw:
            value = raw.pop(role) or {}
            if isinstance(value, list):  # several groups of this role, e.g. of different degrees
                kwargs[role] = tuple(_group(item or {}, role) for item in value)
            else:
                kwargs[role] = _group(value, role)
    cfg = ClusterConfig(**raw, **kwargs)
    cfg.validate()
    return cfg


def _group(values: dict, role: str) -> WorkerGroupSettings:
    """A `prefill:` / `decode:` mapping: the group's own settings, the rest its engine's."""
    if not isinstance(values, dict):
        raise ClusterConfigError(f"{role}: expected a mapping (or a list of mappings)")
    own = {f.name for f in fields(WorkerGroupSettings)} - {"engine"}
    group = section(WorkerGroupSettings, {k: v for k, v in values.items() if k in own}, role)
    engine = {k: v for k, v in values.items() if k not in own}
    unknown = set(engine) - engine_settings()
    if unknown:
        raise ClusterConfigError(
            f"{role}: unknown setting(s) {sorted(unknown)}; known: {sorted(own | engine_settings())}"
        )
    return replace(group, engine=engine, resources=group.resources or {})


@dataclass(frozen=True)
class UpSetting:
    """Where a `kvferry up` setting flag goes: a section of ClusterConfig ("" = its own fields), "engine"
    (every group of the roles the field is for, or of `role` only) or "group" (a role's groups)."""

    section: str
    field: object
    role: str | None = None


def add_up_args(p: argparse.ArgumentParser) -> dict[str, UpSetting]:
    """`kvferry up`'s setting flags, derived from the config tree (each defaults to None: the cluster
    file's value, else the field's default, holds); returns {dest: where it goes} (`with_overrides`)."""
    table: dict[str, UpSetting] = {}

    def add(title: str, cls, where: str, prefix: str = "", role: str | None = None, **kw) -> None:
        group = p.add_argument_group(title)
        added = add_config_args(group, cls, prefix=prefix, scope=SETTINGS, unset=True, **kw)
        table.update({dest: UpSetting(where, f, role) for dest, f in added.items()})

    add("cluster (the cluster file's top level)", ClusterConfig, "")
    add("router (the cluster file's router:)", RouterConfig, "router")
    add(
        "engine (the cluster file's prefill: and decode: keys): every group of the roles a setting is for",
        EngineConfig,
        "engine",
    )
    for role in ROLES:
        add(f"{role} groups only (the cluster file's {role}:)", WorkerGroupSettings, "group", role, role)
        add(
            f"... and the engine flags above, for {role} groups only",
            EngineConfig,
            "engine",
            role,
            role,
            roles=role,
            brief=True,
        )
    add("pool (the cluster file's pool:)", PoolConfig, "pool", "pool")
    add("restarts of a dead unit (the cluster file's restarts:)", RestartSettings, "restarts", "restarts")
    add("the planner (the cluster file's autoscale:)", AutoscaleSettings, "autoscale", "autoscale")
    return table


@functools.cache
def up_settings() -> dict[str, UpSetting]:
    return add_up_args(argparse.ArgumentParser(add_help=False))


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
    for name in SECTIONS:
        out[name] = section_dict(out[name])
    for role in ROLES:
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


def _check_choices(config, name: str) -> None:
    """Every field of `config` with `choices` in its metadata holds one of them."""
    for f in fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices is not None and value is not None and value not in choices:
            where = f"{name}.{f.name}" if name else f.name
            raise ClusterConfigError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
