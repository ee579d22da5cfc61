"""Cluster YAML: defaults, overrides, and refusals that name the setting."""

from __future__ import annotations

import argparse

import pytest

from kvferry.cli import add_engine_args, engine_config_from
from kvferry.decode_worker.engine import EngineConfig
from kvferry.deploy.config import ClusterConfigError, cluster_config_from_dict, load_cluster_config
from kvferry.deploy.local import engine_flags


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
    ],
)
def test_bad_settings_are_named(raw, names):
    with pytest.raises((ClusterConfigError, ValueError), match=names):
        cluster_config_from_dict(raw)


def test_engine_flags_parse_back_to_the_same_config():
    cfg = EngineConfig(model="tiny", dtype="float32", max_model_len=512, enable_prefix_caching=False, seed=3)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from(p.parse_args(engine_flags(cfg))) == cfg
