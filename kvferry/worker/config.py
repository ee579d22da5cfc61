"""A worker process's own settings (`python -m kvferry.prefill_worker` / `decode_worker`): its flags are
derived from these fields (`kvferry.flags`). Import-light: a launcher may read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.flags import LAUNCHER, SECRET, meta


@dataclass(frozen=True)
class WorkerConfig:
    """A worker process's own settings (the engine's are EngineConfig's, its pool client's the `worker`
    ones of PoolConfig, flagged `--pool-*`); its flags are derived from these fields (`kvferry.flags`)."""

    worker_id: str = field(
        default="", metadata=meta("the group's id (its ranks register as <id>.r<rank>)", launcher=True)
    )
    host: str = field(default="127.0.0.1", metadata=meta("the address the worker binds", launcher=True))
    port: int = field(default=0, metadata=meta("its gRPC port (0: any free)", launcher=True))
    redis_url: str = field(
        default="redis://127.0.0.1:6379/0", metadata={LAUNCHER: True, SECRET: True, "flag": None}
    )
    namespace: str = field(default="default", metadata=meta("the cluster's Redis key prefix", launcher=True))
    heartbeat_s: float = field(default=1.0, metadata=meta("how often the worker renews its registry record"))
    stall_timeout_s: float = field(
        default=30.0,
        metadata=meta(
            "an engine loop inside one iteration (a step, a collective) longer than this counts as hung: "
            "the worker stops re-registering, so the router drops it, until the loop moves again"
        ),
    )
    max_concurrent_streams: int | None = field(
        default=None,
        metadata=meta(
            "Decode/Prefill calls held open at most (beyond: RESOURCE_EXHAUSTED); default "
            "max(1024, 4 * --max-num-seqs)"
        ),
    )
    group_timeout_s: float = field(
        default=60.0,
        metadata=meta(
            "a collective of a multi-rank group that waits longer than this fails (the group exits); "
            "joining the group and loading the weights get kvferry.model.parallel.SETUP_TIMEOUT_S"
        ),
    )
    drain_timeout_s: float = field(
        default=60.0,
        metadata=meta(
            "on SIGTERM: stop taking requests and wait up to this long for the ones in flight (kvferry up: "
            "the cluster's drain_timeout_s)",
            launcher=True,
        ),
    )
    rank: int | None = field(
        default=None,
        metadata=meta(
            "this process's rank in its group (given by an external launcher such as Ray; without it, "
            "rank 0 starts the other ranks itself)",
            launcher=True,
        ),
    )
    dist_init: str | None = field(
        default=None,
        metadata=meta(
            "the group's rendezvous name in the cluster's Redis (given by rank 0 or the launcher)",
            launcher=True,
        ),
    )
    host_share_dir: str = field(
        default="",
        metadata=meta(
            "a directory on this host's tmpfs that the prefill and decode workers sharing its cores have "
            "in common: prefill marks there when it computes, decode yields to it (engine.host_share; "
            "kvferry up sets it where the placement shares cores; empty: off)",
            launcher=True,
        ),
    )
