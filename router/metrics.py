"""Prometheus metrics of the router (`GET /metrics` on the HTTP port), named like vLLM's so its
Grafana dashboards work with the `vllm:` prefix replaced by `kvferry:` (deploy/grafana-dashboard.json).

Per request (both APIs, measured where the router sends each message): TTFT, inter-token latency,
TPOT, end-to-end latency, the per-phase times of the `Finished` message, token counters, prefix-cache
queries and hits (local = a worker's own cache, pool = pulled from the KV pool), finished requests by
reason and every request by final status code. Per cluster, read from the registry heartbeats at
scrape time: requests running/waiting in the workers, KV-cache usage per worker, slab usage per pool
node. Every series carries `model_name`.

Routing (`router.prefix_routing`): each prefill worker choice by what decided it, and per answered
prefill the hit the chosen worker was expected to have next to the one it reported (its local cache,
and the pool beyond that: the `Finished` message's cached_tokens - pool_cached_tokens and
pool_cached_tokens), in tokens, so a dashboard can tell how well the router's records predict.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvferry.router.directory import Directory
from kvferry.router.prefix_routing import REASONS, Choice
from kvferry.router.traffic import TrafficWindow
from kvferry.v1 import generate_pb2

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
HIT_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)  # tokens
# Finished.timings field -> histogram suffix (kvferry:request_<phase>_time_seconds)
PHASES = {
    "queue_ms": "queue",
    "prefill_ms": "prefill",
    "kv_transfer_ms": "kv_transfer",
    "first_decode_ms": "first_decode",
}


class RouterMetrics:
    def __init__(self, model_name: str, directory: Directory):
        disable_created_metrics()  # no *_created series (as vLLM): dashboards never read them
        self.model_name = model_name
        self.traffic = TrafficWindow()  # the last seconds' traffic, for the planner (router.traffic)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(ClusterCollector(model_name, directory))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"kvferry:{name}", doc, labels, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str, extra=()) -> Counter:
            return Counter(f"kvferry:{name}", doc, [*labels, *extra], registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between streamed messages.", TOKEN_BUCKETS)
        # the series observed on every streamed message, looked up once
        self.ttft_series = self.ttft.labels(model_name)
        self.itl_series = self.itl.labels(model_name)
        self.tpot = histogram(
            "time_per_output_token_seconds", "Per request: (E2E - TTFT) / (tokens - 1).", TOKEN_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS)
        self.phases = {
            field: histogram(
                f"request_{phase}_time_seconds",
                f"Time a request spent in its {phase} phase.",
                REQUEST_BUCKETS,
            )
            for field, phase in PHASES.items()
        }
        self.success = counter("request_success_total", "Finished requests by reason.", ["finished_reason"])
        self.requests = counter("requests_total", "Requests by API and final status code.", ["api", "code"])
        self.request_errors = counter(
            "request_errors_total",
            "Error answers by API and code (HTTP status or gRPC code), refused before admission or not.",
            ["api", "code"],
        )
        self.failovers = counter(
            "worker_failovers_total",
            "Worker calls retried on another worker, by role and code.",
            ["role", "code"],
        )
        self.resumes = counter(
            "resumed_requests_total",
            "Streams resumed here after their router went away (GenerateRequest.resume).",
        )
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens_total", "Generated tokens of finished requests.")
        self.cache_queries = counter("prefix_cache_queries_total", "Prompt tokens looked up.")
        self.pool_lookups = counter(
            "pool_lookups_total", "Lookups of block keys in the pool's metadata (one per request)."
        )
        self.cache_hits = counter(
            "prefix_cache_hits_total",
            "Prompt tokens served by a cache.",
            ["source"],
        )

        self.routing_decisions = counter(
            "routing_decisions_total",
            "Prefill workers chosen, by what decided: prefix, pool_locality, load, only_choice.",
            ["reason"],
        )
        for reason in REASONS:
            self.routing_decisions.labels(model_name, reason)
        self.hits_predicted, self.hits_actual = (
            Histogram(
                f"kvferry:routing_{kind}_hit_tokens",
                f"Prompt tokens the chosen prefill worker {doc}, by source (local, pool).",
                [*labels, "source"],
                buckets=HIT_BUCKETS,
                registry=self.registry,
            )
            for kind, doc in (("predicted", "was expected to find cached"), ("actual", "found cached"))
        )

        self.predicted_ttft_hist = histogram(
            "predicted_ttft_seconds",
            "The TTFT admission predicted (router.slo), per request served.",
            TTFT_BUCKETS,
        )
        self.ttft_prediction_ratio = histogram(
            "ttft_prediction_ratio",
            "Actual over predicted TTFT, per request served (1 = exact).",
            (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0),
        )
        self.predicted_misses = counter(
            "admission_predicted_misses_total",
            "Requests predicted to miss their SLO at admission, by the target missed and what was done.",
            ["reason", "action"],
        )

    def predicted_miss(self, reason: str, action: str) -> None:
        self.predicted_misses.labels(self.model_name, reason, action).inc()
        self.traffic.predicted_miss(reason)

    def predicted_ttft(self, predicted_ms: float, actual_ms: float) -> None:
        self.predicted_ttft_hist.labels(self.model_name).observe(predicted_ms / 1e3)
        if predicted_ms > 0:
            self.ttft_prediction_ratio.labels(self.model_name).observe(actual_ms / predicted_ms)

    def request_error(self, api: str, code: str) -> None:
        self.request_errors.labels(self.model_name, api, code).inc()

    def resumed(self) -> None:
        self.resumes.labels(self.model_name).inc()

    def pool_lookup(self) -> None:
        self.pool_lookups.labels(self.model_name).inc()

    def routed(self, choice: Choice) -> None:
        """A prefill worker was chosen (each retry is a choice of its own)."""
        self.routing_decisions.labels(self.model_name, choice.reason).inc()

    def prefilled(self, choice: Choice, cached: tuple[int, int]) -> None:
        """The chosen worker answered with `cached`: (prefix-cache hit tokens, of which from the pool)."""
        name = self.model_name
        self.hits_predicted.labels(name, "local").observe(choice.local_tokens)
        self.hits_predicted.labels(name, "pool").observe(choice.pool_tokens)
        self.hits_actual.labels(name, "local").observe(cached[0] - cached[1])
        self.hits_actual.labels(name, "pool").observe(cached[1])

    def failover(self, role: str, code: str) -> None:
        """A failed worker call was tried again on another worker of `role` (router.failover)."""
        self.failovers.labels(self.model_name, role, code).inc()

    def track(self, api: str, t0: float) -> RequestTrack:
        return RequestTrack(self, api, t0)

    def rejected(self, api: str, code: str) -> None:
        self.requests.labels(self.model_name, api, code).inc()
        if code == "RESOURCE_EXHAUSTED":  # refused for load (the planner sees demand it did not serve)
            self.traffic.rejected()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTrack:
    """One request's timing as the router streams it (`message` per message, then `done` once)."""

    def __init__(self, metrics: RouterMetrics, api: str, t0: float):
        self.m, self.api, self.t0 = metrics, api, t0
        self.first: float | None = None
        self.last: float | None = None
        self.finished: generate_pb2.Finished | None = None

    def message(self, msg: generate_pb2.GenerateResponse) -> None:
        if msg.token_ids:
            now = time.perf_counter()
            if self.first is None:
                self.first = now
                self.m.ttft_series.observe(now - self.t0)
            else:
                self.m.itl_series.observe(now - self.last)
            self.last = now
        if msg.HasField("finished"):
            self.finished = msg.finished

    def done(self, code: str) -> None:
        m, name, f = self.m, self.m.model_name, self.finished
        m.requests.labels(name, self.api, code if f is None else "OK").inc()
        if f is None:
            return
        m.success.labels(name, f.finish_reason).inc()
        m.e2e.labels(name).observe(time.perf_counter() - self.t0)
        tpot = None
        if f.output_tokens > 1 and self.first is not None:
            tpot = (self.last - self.first) / (f.output_tokens - 1)
            m.tpot.labels(name).observe(tpot)
        ttft = None if self.first is None else (self.first - self.t0) * 1e3
        m.traffic.finished(
            f.prompt_tokens, f.cached_tokens, f.output_tokens, ttft, None if tpot is None else tpot * 1e3
        )
        for field, histogram in m.phases.items():
            value = getattr(f.timings, field)
            if value > 0:  # a phase the request went through (colocated requests have no hand-off)
                histogram.labels(name).observe(value / 1e3)
        m.prompt_tokens.labels(name).inc(f.prompt_tokens)
        m.generation_tokens.labels(name).inc(f.output_tokens)
        m.cache_queries.labels(name).inc(f.prompt_tokens)
        m.cache_hits.labels(name, "local").inc(f.cached_tokens - f.pool_cached_tokens)
        m.cache_hits.labels(name, "pool").inc(f.pool_cached_tokens)


class ClusterCollector:
    """Gauges read from the registry heartbeats the router's directory already holds, at scrape time."""

    def __init__(self, model_name: str, directory: Directory):
        self.model_name = model_name
        self.directory = directory

    def describe(self):
        return []  # gauges are made per scrape (their label sets follow the cluster's members)

    def collect(self):
        name, d = self.model_name, self.directory
        running = GaugeMetricFamily(
            "kvferry:num_requests_running", "Requests in the workers' running batches.", labels=["model_name"]
        )
        waiting = GaugeMetricFamily(
            "kvferry:num_requests_waiting",
            "Requests queued in the workers (waiting for compute or for KV).",
            labels=["model_name"],
        )
        usage = GaugeMetricFamily(
            "kvferry:kv_cache_usage_perc",
            "Fraction of a worker's KV-cache blocks in use (1 = full).",
            labels=["model_name", "role", "worker"],
        )
        slab = GaugeMetricFamily(
            "kvferry:pool_slab_usage_perc",
            "Fraction of a pool node's slots held (leased or private; evictable ones count as free).",
            labels=["model_name", "node"],
        )
        drafts = CounterMetricFamily(
            "kvferry:spec_decode_num_draft_tokens",
            "Draft tokens the decode workers verified (speculative decoding), since each worker started.",
            labels=["model_name"],
        )
        accepted = CounterMetricFamily(
            "kvferry:spec_decode_num_accepted_tokens",
            "Draft tokens the target model accepted; over the draft tokens: the acceptance rate.",
            labels=["model_name"],
        )
        preemptions = CounterMetricFamily(
            "kvferry:num_preemptions",
            "Running requests the workers preempted (to be recomputed), since each worker started: for KV "
            "blocks (`kv_cache`) or for a higher-priority request (`priority`).",
            labels=["model_name", "reason"],
        )
        totals = {"running": 0, "waiting": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        totals |= {"preemptions": 0, "priority_preemptions": 0}
        for role, members in d.members.items():
            for member_id, member in list(members.items()):
                beat = member.beat
                for key in totals:  # a TP prefill group registers once (rank 0); an EP rank per rank
                    totals[key] += int(beat.get(key, 0))
                total = int(beat.get("total_blocks", 0))
                if total:
                    used = 1.0 - int(beat.get("free_blocks", 0)) / total
                    usage.add_metric([name, role, member_id], used)
        running.add_metric([name], totals["running"])
        waiting.add_metric([name], totals["waiting"])
        drafts.add_metric([name], totals["spec_draft_tokens"])
        accepted.add_metric([name], totals["spec_accepted_tokens"])
        preemptions.add_metric([name, "priority"], totals["priority_preemptions"])
        preemptions.add_metric([name, "kv_cache"], totals["preemptions"] - totals["priority_preemptions"])
        for node_id, node in list(d.pool_nodes.items()):
            slots = int(node.beat.get("num_slots", 0))
            if slots:
                slab.add_metric([name, node_id], 1.0 - int(node.beat.get("free_slots", 0)) / slots)
        return [running, waiting, usage, slab, drafts, accepted, preemptions, *self._planner()]

    def _planner(self) -> list:
        """The planner's decisions (`kvferry up --autoscale`, deploy.planner), from its registry record."""
        name = self.model_name
        decisions = CounterMetricFamily(
            "kvferry:planner_decisions",
            "Groups the planner (kvferry up --autoscale) added (`up`) or drained (`down`), per role.",
            labels=["model_name", "role", "direction"],
        )
        failures = CounterMetricFamily(
            "kvferry:planner_scale_failures",
            "Scales the planner asked for that failed.",
            labels=["model_name"],
        )
        groups = GaugeMetricFamily(
            "kvferry:planner_groups", "Groups the planner runs now, per role.", labels=["model_name", "role"]
        )
        need = GaugeMetricFamily(
            "kvferry:planner_need_groups",
            "Groups each role needs by the planner's last reading (fractional).",
            labels=["model_name", "role"],
        )
        counts: dict[tuple[str, str], int] = {}
        failed = 0
        for record in list(self.directory.planners.values()):
            totals = record.get("decisions")
            for key, value in totals.items() if isinstance(totals, dict) else ():
                role, _, direction = str(key).partition(":")
                if isinstance(value, int):
                    counts[(role, direction)] = counts.get((role, direction), 0) + value
            failed += int(record.get("failures") or 0)
            have, wanted = record.get("groups"), record.get("need")
            for i, role in enumerate(("prefill", "decode")):
                if isinstance(have, list) and len(have) == 2:
                    groups.add_metric([name, role], have[i])
                if isinstance(wanted, dict) and isinstance(wanted.get(role), int | float):
                    need.add_metric([name, role], wanted[role])
        for role in ("prefill", "decode"):
            for direction in ("up", "down"):
                decisions.add_metric([name, role, direction], counts.get((role, direction), 0))
        failures.add_metric([name], failed)
        return [decisions, failures, groups, need]
