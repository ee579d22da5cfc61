"""`kvferry up --ray` on a three-node Ray cluster simulated on this machine (ray.cluster_utils).

The head node runs the controller, the router and redis-server; one node offers a `prefill_node`
resource and one a `decode_node` resource, which the groups' bundles ask for, so the placement is
known. Everything is real: Ray actors supervising the component processes, gloo groups, Redis, gRPC.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import ray
from cluster_helpers import ENGINE, greedy, metric, random_prompt, wait_for
from ray.cluster_utils import Cluster

from kvferry.deploy import ray_launch
from kvferry.deploy.config import (
    ClusterConfig,
    PoolConfig,
    RaySettings,
    RouterConfig,
    WorkerGroupSettings,
)
from kvferry.deploy.planner import AutoscaleSettings
from kvferry.kvpool.metadata import MetadataStore
from kvferry.router.client import Client

pytestmark = pytest.mark.slow

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def ray_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=4, resources={"prefill_node": 4})
    cluster.add_node(num_cpus=4, resources={"decode_node": 4})
    ray.init(address=cluster.address, namespace=ray_launch.RAY_NAMESPACE, log_to_driver=False)
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    yield {
        "head": next(k for k, r in nodes.items() if "node:__internal_head__" in r),
        "prefill": next(k for k, r in nodes.items() if "prefill_node" in r),
        "decode": next(k for k, r in nodes.items() if "decode_node" in r),
        "all": set(nodes),
    }
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def kv(ray_nodes, tiny_model_dir, tmp_path_factory):
    """Prefill: one TP=2 group on the prefill node; decode: one group on the decode node."""
    cfg = ClusterConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        namespace="test-ray",
        router=RouterConfig(port=0, http_port=0),
        pool=PoolConfig(memory_gib=0.1),
        prefill=WorkerGroupSettings(
            engine={**ENGINE, "tensor_parallel_size": 2}, resources={"CPU": 1, "prefill_node": 1}
        ),
        # torch ops for decode: these tests time requests against actor kills, scaling and heartbeats,
        # and under the C++ kernels the tiny model decodes 400 tokens in ~0.2 s, less than a heartbeat
        decode=WorkerGroupSettings(
            engine={**ENGINE, "kernels": "torch"}, resources={"CPU": 1, "decode_node": 1}
        ),
        drain_timeout_s=60,
        ray=RaySettings(max_restarts=3, log_dir=str(tmp_path_factory.mktemp("ray-logs"))),
    )
    ctrl, status = ray_launch.up(cfg, say=lambda line: None)
    yield ctrl, status
    ray_launch.down(ctrl)


@pytest.fixture(scope="module")
def client(kv):
    with Client(kv[1]["router"]) as c:
        yield c


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(300 + i, n) for i, n in enumerate((40, 17, 64, 5))]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts, hf_greedy):
    return hf_greedy(tiny_model_dir, prompts, NEW_TOKENS)


def units(ctrl) -> dict:
    return {u["name"]: u for u in ray.get(ctrl.status.remote())["units"]}


def long_request(seed: int, max_tokens: int = 120):
    return greedy(random_prompt(seed, 24), max_tokens)


def test_groups_are_placed_across_nodes(kv, ray_nodes):
    ctrl, _ = kv
    got = units(ctrl)
    prefill = got["prefill-0"]["ranks"]
    assert len(prefill) == 2 and {r["node_id"] for r in prefill} == {ray_nodes["prefill"]}
    assert [r["node_id"] for r in got["decode-0"]["ranks"]] == [ray_nodes["decode"]]
    assert got["router"]["ranks"][0]["node_id"] == ray_nodes["head"]
    assert got["redis"]["ranks"][0]["node_id"] == ray_nodes["head"]
    pools = [u for u in got.values() if u["role"] == "pool"]
    assert {u["ranks"][0]["node_id"] for u in pools} == ray_nodes["all"]  # one per Ray node
    assert all(u["state"] == "running" and u["restarts"] == 0 for u in got.values())
    again = ClusterConfig(namespace="test-ray")
    with pytest.raises(ray_launch.LaunchError, match="already runs"):  # one cluster per namespace
        ray_launch.up(again, say=lambda line: None)


def test_greedy_tokens_equal_the_reference(client, prompts, reference):
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda ids: client.generate(greedy(ids), timeout=120).token_ids, prompts))
    assert got == reference


@pytest.mark.timeout(600)  # each scale may take up to 300 s
def test_scaling_decode_up_and_down_mid_run_loses_nothing(kv, client, tmp_path_factory, monkeypatch):
    ctrl, status = kv
    results: dict[int, object] = {}

    def one(seed: int, max_tokens: int) -> None:
        try:
            out = client.generate(long_request(seed, max_tokens), timeout=300)
            results[seed] = len(out.token_ids) if out.finished.finish_reason == "length" else out.finished
        except grpc.RpcError as err:
            results[seed] = err

    def wave(seeds, max_tokens: int) -> list[threading.Thread]:
        threads = [threading.Thread(target=one, args=(seed, max_tokens)) for seed in seeds]
        for t in threads:
            t.start()
        return threads

    first = wave(range(6), 60)
    status = ray.get(ctrl.scale.remote(decode=2), timeout=300)  # while the first wave decodes
    assert [u["name"] for u in status["units"] if u["role"] == "decode"] == ["decode-0", "decode-1"]
    assert client.model_info().num_decode_workers == 2
    # most go to the new, empty group; long enough to be seen in flight by a heartbeat (1 s)
    second = wave(range(100, 106), 600)
    assert ":***@" in status["redis_url"]  # the launched redis asks for a password, never shown
    for name, pem in ray.get(ctrl.operator_tls.remote()).items():  # redis speaks TLS under Ray
        monkeypatch.setenv(name, pem)
    meta = MetadataStore(ray.get(ctrl.full_redis_url.remote()), "test-ray")
    wait_for(
        lambda: meta.members("decode").get("decode-1", {}).get("inflight", 0) > 0,
        60,
        "the new decode group to hold requests",
    )
    status = ray.get(ctrl.scale.remote(decode=1), timeout=300)  # decode-1 drains what it holds
    assert [u["name"] for u in status["units"] if u["role"] == "decode"] == ["decode-0"]
    for t in first + second:
        t.join(300)
    assert [results[s] for s in range(6)] == [60] * 6
    assert [results[s] for s in range(100, 106)] == [600] * 6
    assert client.model_info().num_decode_workers == 1
    log = (Path(status["log_dir"]) / "decode-1.log").read_text()
    held = [
        int(line.split("waiting for ")[1].split()[0]) for line in log.splitlines() if "waiting for" in line
    ]
    assert held and held[0] > 0, "decode-1 held no request when it began to drain"
    assert "drained" in log


def test_killing_a_decode_actor_fails_its_requests_cleanly_then_it_serves_again(
    kv, client, prompts, reference
):
    ctrl, _ = kv
    outcomes: list = []
    streaming = [threading.Event() for _ in range(3)]

    def one(i: int) -> None:
        try:
            # 900 tokens: every request still decodes when the kill lands, however fast the steps
            for msg in client.stream(long_request(500 + i, 900), timeout=120):
                if msg.token_ids:
                    streaming[i].set()
            outcomes.append("finished")
        except grpc.RpcError as err:
            outcomes.append(err.code())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert all(event.wait(120) for event in streaming)  # all three are on the decode worker
    [actor] = ray.get(ctrl.actors.remote("decode-0"))
    killed = time.monotonic()
    ray.kill(actor, no_restart=False)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request hung after its decode worker died"
    assert time.monotonic() - killed < 60
    assert outcomes and all(o == grpc.StatusCode.UNAVAILABLE for o in outcomes), outcomes

    def serves() -> list[int] | None:
        try:
            return client.generate(greedy(prompts[0]), timeout=30).token_ids
        except grpc.RpcError:
            return None  # still relaunching

    assert wait_for(serves, 120, "the relaunched decode worker to serve") == reference[0]
    assert units(ctrl)["decode-0"]["restarts"] == 1


@pytest.mark.timeout(600)  # `kvferry up --ray` has 300 s
def test_cli_up_ray_answers_a_prompt_and_takes_everything_down(ray_nodes, tiny_model_dir, tmp_path):
    """`kvferry up --ray --address ... --prompt`: the operator's command, end to end."""
    config = tmp_path / "cluster.yaml"
    config.write_text(
        f"model: {tiny_model_dir}\ndtype: float32\nnamespace: test-ray-cli\n"
        "router: {port: 0, http_port: 0}\npool: {memory_gib: 0.1, per_ray_node: false, nodes: 1}\n"
        "prefill: {max_model_len: 1024, num_kv_blocks: 256, resources: {CPU: 1, prefill_node: 1}}\n"
        "decode: {max_model_len: 1024, num_kv_blocks: 256, resources: {CPU: 1, decode_node: 1}}\n"
    )
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "kvferry.cli", "up", "--ray", "--address", address),
            *("--config", str(config), "--log-dir", str(tmp_path / "logs")),
            *("--prompt", "def fibonacci(n):", "--max-tokens", "8", "--temperature", "0", "--ignore-eos"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvferry cluster ready: router at" in proc.stdout and "OpenAI API at http://" in proc.stdout
    assert "finish_reason=length" in proc.stderr and "output=8 " in proc.stderr
    with pytest.raises(ray_launch.LaunchError):
        ray_launch.get_controller("test-ray-cli")  # `up` took its cluster down on the way out


def test_cli_scale_without_counts_reports_the_running_cluster(kv):
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run(
        [
            *(sys.executable, "-m", "kvferry.cli", "scale", "--ray"),
            "--address",
            address,
            "--namespace",
            "test-ray",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    status = json.loads(done.stdout)
    assert status["phase"] == "ready" and status["router"] == kv[1]["router"]
    assert {u["role"] for u in status["units"]} == {"redis", "router", "pool", "prefill", "decode"}
    missing = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", "down", "--ray", "--address", address, "--namespace", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "no kvferry cluster with namespace 'nope'" in missing.stderr


@pytest.mark.timeout(600)  # 180 s for the planner's scale-up, 120 s more for /metrics to count it
def test_the_planner_scales_a_ray_cluster_through_the_controller(ray_nodes, tiny_model_dir, tmp_path):
    """`kvferry up --ray --autoscale`: the controller runs the planner; under load it adds a prefill group
    (a decision in the controller's events and the router's /metrics), and the cluster serves on."""
    cfg = ClusterConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        namespace="test-ray-plan",
        router=RouterConfig(port=0, http_port=0),
        pool=PoolConfig(memory_gib=0.1, per_ray_node=False, nodes=1),
        prefill=WorkerGroupSettings(engine=ENGINE, resources={"CPU": 1, "prefill_node": 1}),
        decode=WorkerGroupSettings(engine=ENGINE, resources={"CPU": 1, "decode_node": 1}),
        # utilization 0.001: any load needs a second prefill group
        autoscale=AutoscaleSettings(
            enabled=True, prefill=(1, 2), decode=(1, 1), interval_s=0.5, cooldown_s=1.0, utilization=0.001
        ),
        ray=RaySettings(max_restarts=1, log_dir=str(tmp_path / "logs")),
    )
    ctrl, status = ray_launch.up(cfg, say=lambda line: None)
    try:
        ids = random_prompt(77, 100)
        with Client(status["router"]) as client:
            want = list(client.generate(greedy(ids), timeout=60).token_ids)

            def prefill_groups() -> int:
                for _ in range(3):
                    assert list(client.generate(greedy(ids), timeout=60).token_ids) == want
                return sum(u["role"] == "prefill" for u in ray.get(ctrl.status.remote())["units"])

            wait_for(lambda: prefill_groups() == 2, 180, "the planner to add a prefill group on Ray")
            events = "\n".join(ray.get(ctrl.status.remote())["events"])
            assert "planner: on" in events and "planner: prefill 1 -> 2" in events

            def decisions_up() -> float:  # counted once the scale is done and the router read it
                return metric(
                    status["http"], "kvferry:planner_decisions_total", role="prefill", direction="up"
                )

            wait_for(lambda: decisions_up() >= 1, 120, "/metrics to count the planner's scale-up")
            assert list(client.generate(greedy(ids), timeout=60).token_ids) == want
    finally:
        ray_launch.down(ctrl)
