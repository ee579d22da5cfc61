"""The router's settings: `python -m kvferry.router`'s flags, the cluster file's `router:` section and
`kvferry up`'s router flags are all derived from these fields (`kvferry.flags`). Import-light: the
launchers and the CLI read it without loading gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.flags import LAUNCHER, SECRET, meta
from kvferry.settings import API_KEY_ENV, read_key_file, split_key_spec

EVENT_LOOPS = ("auto", "uvloop", "asyncio")
ROUTING_MODES = ("kv-aware", "least-load")  # router.prefix_routing
ADMISSION_MODES = ("predictive", "cap")  # router.slo
MISS_ACTIONS = ("reject", "deprioritize")
CACHE_SCOPES = ("key", "cluster")  # router.admission.tenant_salt


@dataclass(frozen=True)
class RouterConfig:
    """The router's settings; its command-line flags are derived from these fields (`kvferry.flags`)."""

    # set by the launcher from the cluster's own settings (model, redis_url, namespace, colocated)
    model: str = field(
        default="tiny", metadata=meta("checkpoint directory, or a built-in name", launcher=True)
    )
    host: str = field(
        default="127.0.0.1",
        metadata=meta("the address the router binds, gRPC and HTTP (0.0.0.0 exposes it, and only it)"),
    )
    port: int = field(default=50051, metadata=meta("the router's gRPC port (0: any free)"))
    redis_url: str = field(
        default="redis://127.0.0.1:6379/0", metadata={LAUNCHER: True, SECRET: True, "flag": None}
    )
    namespace: str = field(default="default", metadata=meta("the cluster's Redis key prefix", launcher=True))
    max_inflight: int = field(
        default=256, metadata=meta("requests in flight at most (RESOURCE_EXHAUSTED past it)")
    )
    refresh_s: float = field(default=0.5, metadata=meta("how often the registry of workers is read"))
    colocated: bool = field(
        default=False,
        metadata=meta("no prefill workers: decode workers do both phases (the baseline)", launcher=True),
    )
    http_port: int | None = field(
        default=8000,
        metadata=meta(
            "the OpenAI-compatible API and /metrics (0: any free port)",
            none_flag="no-http",
            none_help="serve gRPC only (no OpenAI API, no /metrics)",
        ),
    )
    served_model_name: tuple[str, ...] = field(
        default=(),
        metadata=meta(
            "the APIs' model name(s): every one is accepted, the first is the one shown (default: the "
            "model's name)",
            metavar="NAME",
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=meta("the chat API's template: a Jinja file, or the template itself (default: the model's)"),
    )
    generation_config: str = field(
        default="auto",
        metadata=meta(
            "sampling defaults for the fields a request leaves unset (temperature, top_p, top_k, min_p, "
            "repetition_penalty, max_new_tokens): auto = the model's generation_config.json, vllm = none, "
            "or a directory holding a generation_config.json"
        ),
    )
    uvicorn_log_level: str = field(
        default="warning",
        metadata=meta(
            "the HTTP server's log level", choices=("critical", "error", "warning", "info", "debug", "trace")
        ),
    )
    api_keys: tuple[str, ...] = field(
        default=(),
        repr=False,
        metadata=meta(
            f"a bearer key clients must send (repeatable; also ${API_KEY_ENV}, comma-separated, which keeps "
            "the keys out of ps; or --api-keys-file); none: the API is open. KEY:option=value:... gives that "
            "key its own min_priority, max_inflight, tokens_per_min and cache_group",
            flag="api-key",
            metavar="KEY",
            secret=True,
        ),
    )
    api_keys_file: str | None = field(
        default=None,
        metadata=meta(
            "a file of API keys, one KEY[:option=value:...] a line (# starts a comment line): many keys, "
            "none of them in ps or the environment; read at start"
        ),
    )
    ssl_certfile: str | None = field(
        default=None, metadata=meta("serve gRPC and HTTP over TLS with this PEM certificate")
    )
    ssl_keyfile: str | None = field(default=None, metadata=meta("the certificate's PEM private key"))
    request_timeout_s: float = field(
        default=600.0, metadata=meta("the deadline of a request whose client sets none")
    )
    max_request_bytes: int = field(
        default=4 * 2**20,
        metadata=meta("the largest request message accepted (far above a valid request)"),
    )
    body_timeout_s: float = field(
        default=30.0,
        metadata=meta("the longest wait for the next part of an HTTP request's body (then 408)"),
    )
    event_loop: str = field(
        default="auto",
        metadata=meta(
            "the asyncio loop: uvloop (fewer CPU cycles per streamed message), asyncio, or auto (uvloop "
            "where it is installed)",
            choices=EVENT_LOOPS,
        ),
    )
    routing: str = field(
        default="kv-aware",
        metadata=meta(
            "prefill worker choice: kv-aware (the one expected to hold most of the prompt's prefix, "
            "weighed against load) or least-load (router.prefix_routing)",
            choices=ROUTING_MODES,
        ),
    )
    slo_ttft_ms: float | None = field(
        default=None,
        metadata=meta("the TTFT target of a request that sets none (GenerateRequest.slo; none: no target)"),
    )
    slo_tpot_ms: float | None = field(
        default=None, metadata=meta("the TPOT target of a request that sets none (none: no target)")
    )
    admission: str = field(
        default="predictive",
        metadata=meta(
            "predictive: a request with an SLO whose predicted TTFT or TPOT misses it is refused at once "
            "(or deprioritized, --on-predicted-miss); cap: --max-inflight alone (router.slo)",
            choices=ADMISSION_MODES,
        ),
    )
    on_predicted_miss: str = field(
        default="reject",
        metadata=meta(
            "what predictive admission does with a request predicted to miss its SLO: reject it "
            "(RESOURCE_EXHAUSTED / 429 with Retry-After) or deprioritize it (queued behind every other)",
            choices=MISS_ACTIONS,
        ),
    )

    max_inflight_per_key: int = field(
        default=0,
        metadata=meta(
            "sequences in flight at most per API key (each of a request's n counts; 0: only "
            "--max-inflight): no key takes every slot"
        ),
    )
    tokens_per_min_per_key: int = field(
        default=0,
        metadata=meta(
            "tokens an API key may ask for a minute, over every router of the cluster (a request's prompt "
            "plus max_tokens for each of its n; counted in Redis; 0: no limit): past it, 429 with "
            "Retry-After until the minute's end"
        ),
    )
    min_priority: int = field(
        default=0,
        metadata=meta(
            "the lowest (most urgent) priority a request with an API key may ask for (lower: 400), so no "
            "key preempts the others unless its own min_priority allows it; requests without a key: any"
        ),
    )
    prefix_cache_scope: str = field(
        default="key",
        metadata=meta(
            "who shares cached prompt prefixes, with API keys: key (each key its own: no key learns from "
            "cached_tokens or TTFT what another sent) or cluster (every key, the most hits)",
            choices=CACHE_SCOPES,
        ),
    )
    detach_grace_s: float = field(
        default=10.0,
        metadata=meta(
            "how long a decode worker holds a stream whose router died (decoding on, its tokens kept) for "
            "the client to resume it through any router (GenerateRequest.resume); 0: abort it at once"
        ),
    )
    drain_s: float = field(
        default=30.0,
        metadata=meta(
            "how long a stopping router (SIGTERM) lets its streams finish; it takes no new connections "
            "meanwhile (the other routers do)"
        ),
    )
    replicas: int = field(
        default=1,
        metadata=meta(
            "router processes (one host: all on the same gRPC and HTTP ports, SO_REUSEPORT; the kernel "
            "spreads connections)",
            cluster=True,
            flag="routers",
        ),
    )

    def key_specs(self) -> tuple[str, ...]:
        """Every API key spec the router takes: --api-key's and the lines of --api-keys-file (read now),
        each checked: ValueError naming the bad one (the one check of them: the router's start and
        `kvferry up`'s, before anything runs)."""
        specs = self.api_keys
        if self.api_keys_file:
            try:
                specs = (*specs, *read_key_file(self.api_keys_file))
            except OSError as err:
                raise ValueError(f"--api-keys-file: {err}") from None
        for spec in self.api_keys:
            try:
                split_key_spec(spec)
            except ValueError as err:
                raise ValueError(f"--api-key: {err}") from None
        return specs

    def __post_init__(self):
        for name in ("served_model_name", "api_keys"):  # a cluster file's one name, or a list of them
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(
                    self, name, () if value is None else (value,) if isinstance(value, str) else tuple(value)
                )
