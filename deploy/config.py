"""Cluster configuration: one frozen dataclass per component, loadable from YAML.

```yaml
model: tiny            # checkpoint directory or built-in name
dtype: auto
namespace: default     # Redis key prefix (several clusters can share one Redis)
redis_url: null        # null: `kvferry up` starts its own redis-server
router: {host: 127.0.0.1, port: 50051, max_inflight: 256}
pool: {nodes: 1, memory_gib: 1.0}
prefill: {replicas: 1, max_num_batched_tokens: 2048, kv_cache_memory_gib: 0.5}
decode: {replicas: 1, max_num_seqs: 256, kv_cache_memory_gib: 1.0}
```
`prefill` and `decode` take every engine flag of `kvferry generate` (snake_case).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from kvferry.decode_worker.engine import EngineConfig


class ClusterConfigError(ValueError):
    """A cluster setting that is missing, unknown or out of range (the message names it)."""


_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)} - {"model", "dtype"}


@dataclass(frozen=True)
class RouterSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    max_inflight: int = 256


@dataclass(frozen=True)
class PoolSettings:
    nodes: int = 1
    memory_gib: float = 1.0


@dataclass(frozen=True)
class WorkerGroupSettings:
    replicas: int = 1
    engine: dict = field(default_factory=dict)  # EngineConfig overrides


@dataclass(frozen=True)
class ClusterConfig:
    model: str = "tiny"
    dtype: str = "auto"
    namespace: str = "default"
    redis_url: str | None = None
    router: RouterSettings = RouterSettings()
    pool: PoolSettings = PoolSettings()
    prefill: WorkerGroupSettings = WorkerGroupSettings()
    decode: WorkerGroupSettings = WorkerGroupSettings()
    startup_timeout_s: float = 180.0

    def validate(self) -> None:
        for name, value in (
            ("prefill.replicas", self.prefill.replicas),
            ("decode.replicas", self.decode.replicas),
            ("pool.nodes", self.pool.nodes),
        ):
            if value < 1:
                raise ClusterConfigError(f"{name} must be >= 1, got {value}")
        if self.pool.memory_gib <= 0:
            raise ClusterConfigError(f"pool.memory_gib must be > 0, got {self.pool.memory_gib}")
        if not 0 <= self.router.port < 65536:
            raise ClusterConfigError(f"router.port must be in [0, 65535], got {self.router.port}")
        for group in ("prefill", "decode"):
            settings: WorkerGroupSettings = getattr(self, group)
            unknown = set(settings.engine) - _ENGINE_FIELDS
            if unknown:
                raise ClusterConfigError(f"{group}: unknown engine setting(s) {sorted(unknown)}")
            EngineConfig(**settings.engine).validate()

    def engine_config(self, group: str) -> EngineConfig:
        settings: WorkerGroupSettings = getattr(self, group)
        return EngineConfig(model=self.model, dtype=self.dtype, **settings.engine)

    def with_overrides(self, **values) -> ClusterConfig:
        """Apply CLI flags (None = not given) on top of the file's values."""
        top = {k: v for k, v in values.items() if v is not None and k in {"model", "dtype", "redis_url"}}
        cfg = replace(self, **top)
        if values.get("port") is not None:
            cfg = replace(cfg, router=replace(cfg.router, port=values["port"]))
        if values.get("host") is not None:
            cfg = replace(cfg, router=replace(cfg.router, host=values["host"]))
        for group in ("prefill", "decode"):
            if values.get(f"{group}_replicas") is not None:
                cfg = replace(
                    cfg, **{group: replace(getattr(cfg, group), replicas=values[f"{group}_replicas"])}
                )
        return cfg


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
    for name, cls in (("router", RouterSettings), ("pool", PoolSettings)):
        if name in raw:
            kwargs[name] = _section(cls, raw.pop(name) or {}, name)
    for group in ("prefill", "decode"):
        if group in raw:
            section = dict(raw.pop(group) or {})
            replicas = section.pop("replicas", 1)
            kwargs[group] = WorkerGroupSettings(replicas=replicas, engine=section)
    cfg = ClusterConfig(**raw, **kwargs)
    cfg.validate()
    return cfg


def _section(cls, values: dict, name: str):
    known = {f.name for f in fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ClusterConfigError(f"{name}: unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
    return cls(**values)
