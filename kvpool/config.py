"""The KV pool's settings, one declaration each: a pool node's flags (`python -m kvferry.kvpool`), the
cluster file's `pool:` section, `kvferry up --pool-*` and the workers' `--pool-*` flags (the settings
marked `worker`: how they write to the pool) are all derived from these fields (`kvferry.flags`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from kvferry.flags import CLUSTER, LAUNCHER, SECRET, ConfigError, meta
from kvferry.kvpool.dataplane import TRANSFER_TIMEOUT_S

STREAM_LAYERS = ("on", "off", "auto")
MIN_SLOTS = 16


@dataclass(frozen=True)
class PoolConfig:
    """The pool's settings. LAUNCHER fields are one node's (its id, address, slab size); CLUSTER ones
    are the launcher's and the workers' (how many nodes, where, how many copies of a block)."""

    # the launcher's, per node
    node_id: str = field(default="", metadata=meta("the node's id in the registry", launcher=True))
    host: str = field(default="127.0.0.1", metadata=meta("the address the node binds", launcher=True))
    port: int = field(default=0, metadata=meta("the node's gRPC port (0: any free)", launcher=True))
    num_slots: int | None = field(
        default=None, metadata=meta("block slots in the slab (default: --memory-gib's worth)", launcher=True)
    )
    redis_url: str = field(
        default="redis://127.0.0.1:6379/0", metadata={LAUNCHER: True, SECRET: True, "flag": None}
    )
    namespace: str = field(default="default", metadata=meta("the cluster's Redis key prefix", launcher=True))
    # the cluster's: how many nodes run, where, and how workers use them
    nodes: int = field(
        default=1, metadata=meta("pool nodes (kvferry up; on Ray with per_ray_node off)", cluster=True)
    )
    per_ray_node: bool = field(
        default=True,
        metadata=meta("on Ray: one pool node on every Ray node (else `nodes`, spread)", cluster=True),
    )
    resources: dict = field(
        default_factory=dict, metadata={CLUSTER: True, "help": "on Ray: what a pool node's actor reserves"}
    )
    replicas: int = field(
        default=1,
        metadata=meta(
            "copies of each KV block a worker writes, on distinct nodes (as many as are live): a block "
            "survives the death of all but one of them",
            cluster=True,
            worker=True,
        ),
    )
    stream_layers: str = field(
        default="auto",
        metadata=meta(
            "a prefill puts each layer's finished blocks while the next layers compute (on), after the "
            "prefill (off), or on when it computes on a GPU (auto; on CPU the transfer takes cores from the "
            "compute and costs more than it saves)",
            choices=STREAM_LAYERS,
            cluster=True,
            worker=True,
        ),
    )
    data_interface: str = field(
        default="",
        metadata=meta(
            "the network interface the KV data plane uses on every host (e.g. a private NIC or VLAN): the "
            "pair groups' gloo connections listen and connect there only. The data plane is not "
            "encrypted (bench/kv_encryption.py measures what TLS would cost); empty: the address each "
            "process binds (cluster_host)",
            cluster=True,
            worker=True,
        ),
    )
    # a node's
    memory_gib: float = field(default=1.0, metadata=meta("the slab's size (GiB of blocks in memory)"))
    device: str = field(default="cpu", metadata=meta("where the slab lives"))
    heartbeat_s: float = field(default=1.0, metadata=meta("how often the node renews its registry record"))
    ttl_s: float = field(default=5.0, metadata=meta("its registry record's lifetime"))
    private_ttl_s: float = field(
        default=20.0,
        metadata=meta(
            "free a request's private tail block this long after it was written if nobody read or "
            "released it (its router died before the decode started)"
        ),
    )
    assemble_timeout_s: float = field(
        default=30.0, metadata=meta("how long a block waits for the other ranks' KV-head slices")
    )
    transfer_timeout_s: float = field(
        default=TRANSFER_TIMEOUT_S,
        metadata=meta(
            "the longest wait on a peer within a transfer (a lost host, a partition, a client that hangs): "
            "past it a worker's pull recomputes what did not arrive and a put counts as not stored",
            worker=True,
        ),
    )
    reserve_ttl_s: float | None = field(
        default=None,
        metadata=meta(
            "slots a client reserved go back to the pool this long after its last reserve or put (default: "
            "max(30, 3 x transfer_timeout_s); a client writes into a reservation only in its first half)"
        ),
    )
    max_reserve: int = field(default=1024, metadata=meta("slots one Reserve hands out at most"))
    shm: bool = field(
        default=True,
        metadata=meta(
            "keep the slab in /dev/shm for clients on this host (off: private memory, and those clients "
            "use the pair group too)"
        ),
    )
    disk_dir: str | None = field(
        default=None,
        metadata=meta(
            "spill evicted blocks to files here (kvferry up: a directory per node below it; kept across "
            "restarts)"
        ),
    )
    disk_max_gib: float = field(default=0.0, metadata=meta("the disk tier's size per node (with disk_dir)"))
    # hot blocks (`hot.py`): read over the network hot_reads times within hot_window_s, a block is copied
    # to other nodes until it has hot_replicas copies (hot_reads 0: off)
    hot_reads: int = field(
        default=8,
        metadata=meta(
            "a block read over the network this many times within hot_window_s is copied to other nodes "
            "(0: never)"
        ),
    )
    hot_window_s: float = field(default=60.0, metadata=meta("the window hot_reads counts in"))
    hot_replicas: int = field(default=2, metadata=meta("copies a hot block gets"))

    def __post_init__(self):
        if self.stream_layers not in STREAM_LAYERS:
            raise ConfigError(f"pool.stream_layers must be on, off or auto, got {self.stream_layers!r}")
        if self.replicas < 1 or self.hot_replicas < 1 or self.hot_reads < 0 or self.hot_window_s <= 0:
            raise ConfigError(
                "pool.replicas and pool.hot_replicas must be >= 1, pool.hot_reads >= 0 and "
                f"pool.hot_window_s > 0; got {self.replicas}, {self.hot_replicas}, {self.hot_reads}, "
                f"{self.hot_window_s}"
            )
        for name in ("memory_gib", "private_ttl_s", "transfer_timeout_s", "heartbeat_s", "ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"pool.{name} must be > 0, got {getattr(self, name)}")
        if self.nodes < 1:
            raise ConfigError(f"pool.nodes must be >= 1, got {self.nodes}")
        if self.disk_dir and self.disk_max_gib <= 0:
            raise ConfigError(f"pool.disk_max_gib must be > 0 with pool.disk_dir, got {self.disk_max_gib}")
        if not self.disk_dir and self.disk_max_gib:
            raise ConfigError("pool.disk_max_gib needs pool.disk_dir")
        if self.reserve_ttl_s is not None and self.reserve_ttl_s <= 2 * self.transfer_timeout_s:
            raise ConfigError(
                "pool.reserve_ttl_s must exceed twice pool.transfer_timeout_s (a client writes only in its "
                "first half)"
            )

    def for_layout(self, block_bytes: int) -> PoolConfig:
        """One node's settings with what it derives filled in: its slots (memory_gib's worth of blocks of
        `block_bytes`, unless num_slots gives them) and its reservations' lifetime."""
        slots = self.num_slots or max(MIN_SLOTS, int(self.memory_gib * 2**30 // block_bytes))
        ttl = self.reserve_ttl_s or max(30.0, 3 * self.transfer_timeout_s)
        return replace(self, num_slots=slots, reserve_ttl_s=ttl)


WORKER_SETTINGS = tuple(f.name for f in fields(PoolConfig) if f.metadata.get("worker"))
