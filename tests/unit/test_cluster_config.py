"""Cluster YAML: defaults, overrides, and refusals that name the setting."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch

from kvferry.deploy.config import (
    ClusterConfig,
    ClusterConfigError,
    cluster_config_from_dict,
    cluster_config_to_dict,
    load_cluster_config,
)
from kvferry.deploy.local import worker_argv
from kvferry.engine.engine import EngineConfig
from kvferry.flags import add_config_args, config_flags, config_from


def test_yaml_file_round_trip(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "model: bench\nrouter: {port: 6000, max_inflight: 8}\npool: {nodes: 2, memory_gib: 0.5}\n"
        "prefill: {replicas: 3, max_num_batched_tokens: 1024}\ndecode: {max_num_seqs: 64}\n"
    )
    cfg = load_cluster_config(path)
    assert (cfg.model, cfg.router.port, cfg.router.max_inflight) == ("bench", 6000, 8)
    assert (cfg.pool.nodes, cfg.prefill.replicas, cfg.decode.replicas) == (2, 3, 1)
    assert cfg.engine_config("prefill").max_num_batched_tokens == 1024
    assert cfg.engine_config("decode").max_num_seqs == 64
    over = cfg.with_overrides(port=7000, decode_replicas=2, model=None)
    assert (over.router.port, over.decode.replicas, over.model) == (7000, 2, "bench")


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ({"modle": "tiny"}, "modle"),
        ({"router": {"prot": 1}}, "prot"),
        ({"prefill": {"max_num_seq": 3}}, "max_num_seq"),
        ({"decode": {"replicas": 0}}, "decode.replicas"),
        ({"pool": {"memory_gib": 0}}, "pool.memory_gib"),
        ({"prefill": {"block_size": 0}}, "block_size"),
        ({"prefill": {"expert_parallel_size": 2}}, "prefill.expert_parallel_size"),
        ({"decode": [{"tensor_parallel_size": 2}]}, "decode.tensor_parallel_size"),
        ({"decode": [{"expert_parallel_size": 0}]}, "expert_parallel_size"),
        ({"prefill": [{"replicas": 0}]}, "prefill.replicas"),
        ({"decode": [3]}, "decode: expected a mapping"),
        ({"decode": {"resources": {"GPU": -1}}}, "decode.resources.GPU"),
        ({"prefill": {"resources": [1]}}, "prefill.resources: expected a mapping"),
        ({"pool": {"resources": {"CPU": "two"}}}, "pool.resources.CPU"),
        ({"ray": {"max_restart": 1}}, "max_restart"),
        ({"ray": {"max_restarts": -1}}, "ray.max_restarts"),
        ({"drain_timeout_s": -1}, "drain_timeout_s"),
    ],
)
def test_bad_settings_are_named(raw, names):
    with pytest.raises((ClusterConfigError, ValueError), match=names):
        cluster_config_from_dict(raw)


def test_engine_flags_parse_back_to_the_same_config():
    cfg = EngineConfig(model="tiny", dtype="float32", max_model_len=512, enable_prefix_caching=False, seed=3)
    p = argparse.ArgumentParser()
    add_config_args(p, EngineConfig)
    assert config_from(p.parse_args(config_flags(cfg)), EngineConfig) == cfg


def test_groups_of_different_degrees_and_the_degree_flags():
    cfg = cluster_config_from_dict(
        {
            "prefill": [{"tensor_parallel_size": 2}, {"replicas": 2}],
            "decode": {"replicas": 2, "expert_parallel_size": 2, "enable_prefix_caching": False},
        }
    )
    assert [g.replicas for g in cfg.groups("prefill")] == [1, 2]
    assert (cfg.group_size("prefill", 0), cfg.group_size("prefill", 1), cfg.group_size("decode")) == (2, 1, 2)
    # a prefill group registers once (rank 0 serves it), an EP decode group once per rank
    assert (cfg.members("prefill"), cfg.members("decode"), cfg.processes()) == (3, 4, 8)
    assert cfg.engine_config("decode").enable_prefix_caching is False
    over = cfg.with_overrides(
        prefill_tensor_parallel_size=4, decode_expert_parallel_size=1, decode_replicas=3
    )
    assert [over.group_size("prefill", i) for i in range(2)] == [4, 4]
    assert (over.group_size("decode"), over.decode.replicas) == (1, 3)
    assert isinstance(over.prefill, tuple) and not isinstance(over.decode, tuple)


def test_degree_the_model_cannot_split_by_is_refused_before_launch(tiny_model_dir):
    from kvferry.deploy.local import LaunchError, LocalCluster

    cfg = cluster_config_from_dict({"model": str(tiny_model_dir), "prefill": {"tensor_parallel_size": 3}})
    with pytest.raises(LaunchError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LocalCluster(cfg, quiet=True).start()
    # expert parallelism of any degree up to the expert count (3 on 4 experts: 2 | 1 | 1); beyond it, refused
    cfg = cluster_config_from_dict({"model": str(tiny_model_dir), "decode": {"expert_parallel_size": 5}})
    with pytest.raises(LaunchError, match="expert_parallel_size=5 exceeds num_experts=4"):
        LocalCluster(cfg, quiet=True).start()


def test_vllm_spelling_of_the_decode_group_degree():
    from kvferry.decode_worker.worker import ROLE
    from kvferry.worker.runtime import worker_parser

    flags = ["--redis-url", "redis://x", "--data-parallel-size", "2", "--enable-expert-parallel"]
    args = worker_parser(ROLE).parse_args(flags)
    assert (args.data_parallel_size, args.enable_expert_parallel, args.rank) == (2, True, None)
    assert ROLE.engine_config(args, config_from(args, EngineConfig)).expert_parallel_size == 2
    with pytest.raises(SystemExit, match="needs --enable-expert-parallel"):
        ROLE.engine_config(worker_parser(ROLE).parse_args(flags[:-1]), config_from(args, EngineConfig))


def test_ray_settings_and_resources_survive_the_round_trip_the_ray_controller_takes():
    cfg = cluster_config_from_dict(
        {
            "prefill": [{"tensor_parallel_size": 2, "resources": {"CPU": 4, "GPU": 1}}, {"replicas": 2}],
            "decode": {"expert_parallel_size": 2, "resources": {"decode_node": 1}},
            "pool": {"per_ray_node": False, "nodes": 2, "resources": {"CPU": 1}},
            "ray": {"max_restarts": 3, "address": "auto"},
            "drain_timeout_s": 5,
        }
    )
    assert cfg.groups("prefill")[0].resources == {"CPU": 4, "GPU": 1}
    assert "resources" not in cfg.groups("prefill")[0].engine  # not an engine flag
    assert cfg.groups("prefill")[1].resources == {}
    assert (cfg.ray.max_restarts, cfg.ray.address, cfg.drain_timeout_s) == (3, "auto", 5)
    assert cluster_config_from_dict(cluster_config_to_dict(cfg)) == cfg


def test_host_placement():
    """prefill-first: prefill ranks share every core, decode keeps its even share in the background
    wherever they overlap (paced, yielding to prefill, both joining the host's share directory); even:
    cores // processes for all; colocated: the even share."""
    from kvferry.deploy.config import Placement

    def shared_decode(threads: int) -> Placement:
        return Placement(threads, background=True, step_interval_ms=40.0, yield_ms=50.0, shares=True)

    cfg = ClusterConfig()
    assert cfg.host_placement(2) == {
        "prefill": Placement(2, passive_wait=True, shares=True),
        "decode": shared_decode(1),
    }
    assert cfg.host_placement(2)["decode"].command(["python"]) == ["nice", "-n", "19", "python"]
    assert cfg.host_placement(2)["decode"].engine_defaults() == {
        "decode_step_interval_ms": 40.0,
        "decode_yield_ms": 50.0,
    }
    assert cfg.host_placement(2)["prefill"].env() == {
        "KVFERRY_NUM_THREADS": "2",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    assert replace(cfg, placement="even").host_placement(2) == {
        "prefill": Placement(1),
        "decode": Placement(1),
    }
    assert replace(cfg, colocated=True).host_placement(2) == {"decode": Placement(2)}
    tp2 = cluster_config_from_dict({"prefill": {"tensor_parallel_size": 2}, "decode": {"replicas": 2}})
    assert tp2.host_placement(16) == {
        "prefill": Placement(8, passive_wait=True, shares=True),
        "decode": shared_decode(4),
    }
    assert tp2.host_placement(1)["decode"] == shared_decode(1)
    with pytest.raises(ClusterConfigError, match="placement must be one of"):
        cluster_config_from_dict({"placement": "random"})


def test_launcher_defaults_fill_only_the_engine_settings_the_file_leaves_unset():
    """The placement's pacing reaches a decode worker's flags unless the cluster file sets its own."""

    def interval(cfg: ClusterConfig) -> str | None:
        argv = worker_argv(
            cfg, "decode", 0, "decode-0", "tiny", "127.0.0.1", {"decode_step_interval_ms": 40.0}
        )
        flag = "--decode-step-interval-ms"
        return argv[argv.index(flag) + 1] if flag in argv else None

    assert interval(ClusterConfig()) == "40.0"
    assert interval(cluster_config_from_dict({"decode": {"decode_step_interval_ms": 0}})) == "0"
    assert "--decode-step-interval-ms" not in worker_argv(ClusterConfig(), "decode", 0, "d", "tiny", "h")
    # the shared placement: the yield bound and the host's share directory reach the worker's flags
    placement = ClusterConfig().host_placement(2)["decode"]
    argv = worker_argv(
        ClusterConfig(),
        "decode",
        0,
        "d",
        "tiny",
        "h",
        placement.engine_defaults(),
        host_share_dir="/dev/shm/x",
    )
    assert argv[argv.index("--decode-yield-ms") + 1] == "50.0"
    assert argv[argv.index("--host-share-dir") + 1] == "/dev/shm/x"
    alone = worker_argv(ClusterConfig(), "decode", 0, "d", "tiny", "h")
    assert alone[alone.index("--host-share-dir") + 1] == ""  # off


def test_every_group_writes_the_pools_layout(tiny_model_dir):
    from kvferry.deploy.config import cluster_layout
    from kvferry.kvpool.transfer import BlockLayout
    from kvferry.model.config import ModelConfig

    model_cfg = ModelConfig.from_dir(tiny_model_dir)
    cfg = ClusterConfig(model=str(tiny_model_dir), dtype="float32")
    layout = cluster_layout(cfg, model_cfg)
    assert layout == BlockLayout.for_model(model_cfg, 16, torch.float32)
    assert cluster_layout(cfg, tiny_model_dir) == layout  # a checkpoint directory will do too
    two_kinds = cluster_config_from_dict(
        {"model": str(tiny_model_dir), "dtype": "float32", "prefill": [{"tensor_parallel_size": 2}, {}]}
    )
    assert cluster_layout(two_kinds, model_cfg) == layout


def test_groups_of_different_block_sizes_are_refused(tiny_model_dir):
    from kvferry.deploy.config import cluster_layout

    cfg = cluster_config_from_dict({"model": str(tiny_model_dir), "prefill": {"block_size": 32}})
    with pytest.raises(ClusterConfigError, match=r"prefill group 0 .* and decode group 0 .*block_size=32"):
        cluster_layout(cfg, tiny_model_dir)
    assert cluster_layout(replace(cfg, colocated=True), tiny_model_dir).block_size == 16  # no prefill groups
    cfg = cluster_config_from_dict({"model": str(tiny_model_dir), "decode": [{}, {"block_size": 32}]})
    with pytest.raises(ClusterConfigError, match=r"decode group 1 .*block_size=16.* vs .*block_size=32"):
        cluster_layout(cfg, tiny_model_dir)


def test_groups_of_different_kv_dtypes_are_refused_before_launch(tiny_model_dir, monkeypatch, tmp_path):
    """A bf16 checkpoint runs in float32 on a CPU without native bf16, in bf16 on a GPU: a CPU prefill
    group and a GPU decode group would write blocks the pool (one layout) cannot hold together."""
    from kvferry.deploy.config import cluster_layout
    from kvferry.deploy.local import LocalCluster
    from kvferry.model import config as model_config

    monkeypatch.setattr(model_config, "cpu_has_native_bf16", lambda: False)
    cfg = cluster_config_from_dict(
        {"model": str(tiny_model_dir), "prefill": {"device": "cpu"}, "decode": {"device": "cuda"}}
    )
    with pytest.raises(ClusterConfigError, match=r"prefill group 0 .*float32.* vs .*bfloat16"):
        cluster_layout(cfg, tiny_model_dir)
    with pytest.raises(ClusterConfigError, match="different KV block layouts"):
        LocalCluster(cfg, log_dir=tmp_path, quiet=True).start()  # before anything starts
    # on Ray a group's device follows its bundle: with GPUs in the Ray cluster, the default bundle
    # holds one, a CPU-only `resources` does not, and an explicit `device` wins over both
    ray_cfg = cluster_config_from_dict({"model": str(tiny_model_dir), "prefill": {"resources": {"CPU": 4}}})
    assert [ray_cfg.group_device(r, 0, ray_gpus=True) for r in ("prefill", "decode")] == ["cpu", "cuda"]
    with pytest.raises(
        ClusterConfigError, match=r"prefill group 0 .*device cpu.* decode group 0 .*device cuda"
    ):
        cluster_layout(ray_cfg, tiny_model_dir, ray_gpus=True)
    # the pool follows the workers' device, not the launcher's (a CPU-only Ray head with GPU workers)
    gpus = cluster_config_from_dict({"model": str(tiny_model_dir), "prefill": {"resources": {"GPU": 1}}})
    assert cluster_layout(gpus, tiny_model_dir, ray_gpus=True).dtype == "bfloat16"
    assert gpus.bundle("decode", 0, ray_gpus=True) == {"CPU": 1.0, "GPU": 1.0}
    cpu = cluster_config_from_dict({"model": str(tiny_model_dir), "decode": {"device": "cpu"}})
    assert cpu.bundle("decode", 0, ray_gpus=True) == {"CPU": 1.0}
    assert cluster_layout(cpu, tiny_model_dir, ray_gpus=False).dtype == "float32"


def test_router_routing_mode_reaches_its_command_and_is_checked():
    from kvferry.deploy.local import router_argv

    cfg = cluster_config_from_dict({"router": {"routing": "least-load"}})
    argv = router_argv(cfg, "tiny", "127.0.0.1", 5, None)
    assert argv[argv.index("--routing") + 1] == "least-load"
    assert "kv-aware" in router_argv(ClusterConfig(), "tiny", "127.0.0.1", 5, None)
    with pytest.raises(ClusterConfigError, match=r"router\.routing"):
        cluster_config_from_dict({"router": {"routing": "random"}}).validate()


def test_the_pool_disk_tier_settings_are_checked_and_reach_each_nodes_command(tiny_model_dir):
    from kvferry.deploy.config import cluster_layout
    from kvferry.deploy.local import pool_argv
    from kvferry.kvpool.config import PoolConfig
    from kvferry.model.config import ModelConfig

    for bad in ({"disk_dir": "/x"}, {"disk_max_gib": 1.0}, {"disk_dir": "/x", "disk_max_gib": -1}):
        with pytest.raises(ClusterConfigError):
            PoolConfig(**bad)
    cfg = cluster_config_from_dict({"pool": {"disk_dir": "/d", "disk_max_gib": 2}})
    layout = cluster_layout(cfg, ModelConfig.from_dir(tiny_model_dir))
    argv = pool_argv(cfg, layout, "pool-0", "127.0.0.1")
    assert argv[argv.index("--disk-dir") + 1] == "/d/pool-0"
    assert float(argv[argv.index("--disk-max-gib") + 1]) == 2
    assert "--disk-dir" not in pool_argv(ClusterConfig(), layout, "pool-0", "127.0.0.1")
    off = cluster_config_from_dict({"pool": {"disk_dir": ""}})  # an empty directory: no disk tier
    assert "--disk-dir" not in pool_argv(off, layout, "pool-0", "127.0.0.1")


def test_a_null_autoscale_bound_in_the_cluster_file_keeps_the_default():
    cfg = cluster_config_from_dict({"autoscale": {"decode": None, "prefill": [2, 3]}})
    assert cfg.autoscale.decode == ClusterConfig().autoscale.decode and tuple(cfg.autoscale.prefill) == (2, 3)


def test_vllm_spellings_of_up_flags_map_onto_the_groups_and_the_router(tmp_path):
    from kvferry.deploy.local import router_argv

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3}')
    cfg = ClusterConfig().with_overrides(
        served_model_name=["first", "second"],
        chat_template="{{ messages[0]['content'] }}",
        generation_config=str(tmp_path),
        uvicorn_log_level="info",
        max_num_seqs=7,
        max_model_len=512,
        enable_prefix_caching=False,
        quantization="int8",
    )
    cfg.validate()
    for role in ("prefill", "decode"):
        engine = cfg.engine_config(role, 0)
        assert (engine.max_num_seqs, engine.max_model_len, engine.enable_prefix_caching) == (7, 512, False)
        assert engine.quantization == "int8"  # prefill and decode alike: their KV must be the same numerics
        assert config_flags(engine)[config_flags(engine).index("--quantization") + 1] == "int8"
    argv = router_argv(cfg, "tiny", "127.0.0.1", 1, 2)
    assert argv[argv.index("--served-model-name") + 1] == "first" and argv.count("--served-model-name") == 2
    assert argv[argv.index("--generation-config") + 1] == str(tmp_path)
    assert argv[argv.index("--uvicorn-log-level") + 1] == "info"
    assert argv[argv.index("--chat-template") + 1] == "{{ messages[0]['content'] }}"
    with pytest.raises(ClusterConfigError, match="generation_config"):
        ClusterConfig().with_overrides(generation_config=str(tmp_path / "none")).validate()


def test_generation_config_defaults_fill_only_unset_fields(tmp_path):
    from kvferry.convert import sampling_from_proto
    from kvferry.model.config import generation_defaults
    from kvferry.v1 import generate_pb2

    config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 30, "eos_token_id": 2}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 30}
    assert generation_defaults(tmp_path, "vllm") == {}
    filled = sampling_from_proto(generate_pb2.SamplingParams(), defaults)
    assert (filled.temperature, filled.top_p, filled.top_k, filled.max_tokens) == (0.6, 0.95, 20, 30)
    given = sampling_from_proto(generate_pb2.SamplingParams(temperature=0.0, top_k=5, max_tokens=3), defaults)
    assert (given.temperature, given.top_k, given.max_tokens) == (0.0, 5, 3)


def test_user_environment_wins_over_the_placement():
    from kvferry.deploy.config import Placement
    from kvferry.deploy.local import placement_env

    shared = Placement(2, passive_wait=True)
    assert placement_env(shared, {}) == {"KVFERRY_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    assert placement_env(shared, {"OMP_WAIT_POLICY": "ACTIVE"}) == {"KVFERRY_NUM_THREADS": "2"}
    assert placement_env(shared, {"KVFERRY_NUM_THREADS": "1"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
