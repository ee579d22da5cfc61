"""`kvferry up`'s launcher without a cluster: what each child's command and environment carry (hosts,
secrets, router flags), the restart budget, and the watcher's decisions on real short-lived processes."""

from __future__ import annotations

import ast
import stat
import sys
from pathlib import Path

import pytest

from kvferry.auth import SECRET_ENV
from kvferry.deploy.cluster_ca import ClusterCA
from kvferry.deploy.config import (
    ClusterConfig,
    ClusterConfigError,
    RestartSettings,
    cluster_config_from_dict,
    cluster_config_to_dict,
)
from kvferry.deploy.local import LocalCluster, pool_argv, router_argv, worker_argv
from kvferry.deploy.redis_server import TLS_FILES as REDIS_TLS_FILES
from kvferry.deploy.redis_server import redis_server_argv, write_private, write_redis_config
from kvferry.deploy.restarts import RestartBudget
from kvferry.kvpool.metadata import REDIS_URL_ENV, add_redis_url_arg, mask_url
from kvferry.router.config import RouterConfig
from kvferry.settings import API_KEY_ENV


def test_only_the_router_takes_the_public_host():
    cfg = ClusterConfig().with_overrides(host="0.0.0.0")
    assert (cfg.router.host, cfg.cluster_host) == ("0.0.0.0", "127.0.0.1")
    worker = worker_argv(cfg, "decode", 0, "decode-0", "tiny", cfg.cluster_host)
    assert worker[worker.index("--host") + 1] == "127.0.0.1"
    router = router_argv(cfg, "tiny", cfg.router.host, 5, 6)
    assert router[router.index("--host") + 1] == "0.0.0.0"
    with pytest.raises(ClusterConfigError, match="cluster_host"):
        ClusterConfig().with_overrides(cluster_host="0.0.0.0").validate()


def test_router_security_settings_reach_its_command_but_keys_stay_out_of_it():
    cfg = ClusterConfig().with_overrides(api_key=("k1", "k2"), ssl_certfile="c.pem", ssl_keyfile="k.pem")
    assert cfg.router.api_keys == ("k1", "k2")
    argv = router_argv(cfg, "tiny", "127.0.0.1", 5, None)
    assert argv[argv.index("--ssl-certfile") + 1] == "c.pem"
    assert argv[argv.index("--ssl-keyfile") + 1] == "k.pem"
    assert "k1" not in " ".join(argv) and "--api-key" not in argv
    assert "k1" not in repr(cfg)  # keys and the secret never land in a log line that prints the config
    assert "s3cret" not in repr(ClusterConfig(cluster_secret="s3cret"))
    with pytest.raises(ClusterConfigError, match="ssl_keyfile go together"):
        ClusterConfig(router=RouterConfig(ssl_certfile="c.pem")).validate()


def test_security_and_restart_settings_survive_the_yaml_round_trip():
    raw = {
        "cluster_secret": "abc",
        "cluster_host": "127.0.0.2",
        "router": {"api_keys": ["k"], "host": "0.0.0.0"},
        "restarts": {"max": 2, "window_s": 60},
    }
    cfg = cluster_config_from_dict(raw)
    assert (cfg.cluster_secret, cfg.router.api_keys, cfg.restarts.max) == ("abc", ("k",), 2)
    assert cluster_config_from_dict(cluster_config_to_dict(cfg)) == cfg
    with pytest.raises(ClusterConfigError, match="restarts"):
        cluster_config_from_dict({"restarts": {"backoff_s": 10, "max_backoff_s": 1}})


def test_redis_password_is_in_an_owner_only_file_not_the_command(tmp_path):
    conf, tls = write_redis_config(tmp_path / "redis.conf", "pw123")
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600 and tls is None
    assert conf.read_text() == "requirepass pw123\n"
    argv = redis_server_argv("127.0.0.1", 7000, config=conf)
    assert argv[1] == str(conf) and "pw123" not in " ".join(argv)
    assert argv[argv.index("--protected-mode") + 1] == "yes"
    assert argv[argv.index("--bind") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "7000" and "--tls-port" not in argv
    assert redis_server_argv("127.0.0.1", 7000)[1] == "--port"  # without a config file
    # with internal TLS: the leaf's files beside the config, owner-only; TLS only on the port
    leaf = ClusterCA.create().issue("127.0.0.1")
    (tmp_path / "tls").mkdir()
    conf, tls = write_redis_config(tmp_path / "tls" / "redis.conf", "pw123", leaf)
    assert [Path(p).name for p in tls] == list(REDIS_TLS_FILES)
    assert all(stat.S_IMODE(Path(p).stat().st_mode) == 0o600 for p in tls)
    assert Path(tls[1]).read_bytes() == leaf.key and "BEGIN" not in " ".join(
        redis_server_argv("h", 1, tls=tls)
    )
    argv = redis_server_argv("127.0.0.1", 7000, config=conf, tls=tls)
    assert argv[argv.index("--port") + 1] == "0" and argv[argv.index("--tls-port") + 1] == "7000"
    assert argv[argv.index("--tls-key-file") + 1] == tls[1]
    (tmp_path / "wide").write_text("old")
    (tmp_path / "wide").chmod(0o644)
    assert stat.S_IMODE(write_private(tmp_path / "wide", "new").stat().st_mode) == 0o600


def test_mask_url_hides_the_password_only():
    assert mask_url("redis://:pw@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert mask_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_restart_budget_backs_off_exponentially_and_gives_up_within_the_window():
    budget = RestartBudget(RestartSettings(max=5, window_s=600, backoff_s=1, max_backoff_s=30))
    delays = []
    for t in range(5):
        delays.append(budget.delay(t * 10.0))
        budget.record(t * 10.0)
    assert delays == [1, 2, 4, 8, 16]
    assert budget.delay(50.0) is None  # a sixth death within 10 minutes: left down
    assert budget.delay(601.0) == 16  # the first restart left the window
    capped = RestartBudget(RestartSettings(max=10, backoff_s=1, max_backoff_s=30), history=[0.0] * 6)
    assert capped.delay(1.0) == 30


def _cluster(tmp_path: Path, **restarts) -> LocalCluster:
    cfg = ClusterConfig(restarts=RestartSettings(**restarts))
    cluster = LocalCluster(cfg, log_dir=tmp_path, quiet=True)
    cluster.secret = "the-secret"
    return cluster


def _wait_exit(child) -> None:
    child.proc.wait(10)


def test_watcher_restarts_a_dead_unit_with_its_command_and_env_then_leaves_it_down(tmp_path):
    cluster = _cluster(tmp_path, max=2, window_s=600, backoff_s=1, max_backoff_s=30)
    script = "import os, sys; print(os.environ['KVFERRY_CLUSTER_SECRET']); sys.exit(3)"
    child = cluster._spawn("decode-0", [sys.executable, "-c", script], {"X": "1"})
    child.supervised = True
    _wait_exit(child)
    cluster.tend(100.0)
    assert child.state == "waiting" and child.restart_at == 101.0
    cluster.tend(100.5)  # still backing off
    assert child.state == "waiting"
    first = child.proc.pid
    cluster.tend(101.0)
    assert child.state == "running" and child.proc.pid != first
    _wait_exit(child)
    cluster.tend(102.0)
    assert child.restart_at == 104.0  # doubled
    cluster.tend(104.0)
    _wait_exit(child)
    cluster.tend(105.0)  # a third death within the window, past max=2
    assert child.state == "failed"
    assert "left down" in cluster.events[-1] and "decode-0" in cluster.events[-1]
    assert cluster.want()[1] == 0  # no longer waited for
    assert child.log.read_text().count("the-secret") == 3  # every run got the secret in its env


def test_a_unit_that_exits_0_is_left_down_not_restarted(tmp_path):
    """A worker exits 0 only after the drain a SIGTERM sent to it asked for: the watcher leaves it down
    (restarting it would undo what the operator asked), and the cluster no longer waits for it."""
    cluster = _cluster(tmp_path, max=2, window_s=600, backoff_s=1, max_backoff_s=30)
    child = cluster._spawn("decode-0", [sys.executable, "-c", "pass"])
    child.supervised = True
    cluster.groups["decode"].append(child)
    _wait_exit(child)
    first = child.proc.pid
    cluster.tend(100.0)
    cluster.tend(200.0)
    assert child.state == "exited" and child.proc.pid == first
    assert "left down" in cluster.events[-1] and "code 0" in cluster.events[-1]
    assert cluster.want()[1] == 0 and cluster.counts() == (0, 0)


def test_retired_units_and_a_stopping_cluster_restart_nothing(tmp_path):
    cluster = _cluster(tmp_path)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    retired = cluster._spawn("decode-0", sleeper)
    retired.supervised = True
    cluster.groups["decode"].append(retired)
    cluster.retire([retired])
    cluster.tend(0.0)
    assert retired not in cluster.children and retired.state == "retiring"
    dead = cluster._spawn("pool-0", [sys.executable, "-c", "pass"])
    dead.supervised = True
    _wait_exit(dead)
    cluster._stopping.set()
    cluster.tend(100.0)
    assert dead.state == "running" and not cluster.events  # seen as dead by nobody: stopping


def test_children_get_the_secret_router_keys_and_redis_url_in_env_only(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-the-user")  # the launcher's own: not handed to workers
    cluster = _cluster(tmp_path)
    cluster.redis_url = "redis://:pw123@127.0.0.1:7000/0"
    dump = [sys.executable, "-c", "import os; print(sorted(k for k in os.environ if k.startswith('KVF')))"]
    child = cluster._spawn("decode-0", dump)
    _wait_exit(child)
    seen = child.log.read_text()
    assert SECRET_ENV in seen and REDIS_URL_ENV in seen and API_KEY_ENV not in seen
    assert child.env[SECRET_ENV] == "the-secret" and child.env[REDIS_URL_ENV] == cluster.redis_url
    assert "the-secret" not in child.argv


def test_no_member_command_carries_the_redis_url(tiny_model_dir):
    """What `ps` shows every user of the host: no --redis-url (whose password would be in it)."""
    from kvferry.deploy.config import cluster_layout
    from kvferry.model.config import ModelConfig

    cfg = ClusterConfig()
    layout = cluster_layout(cfg, ModelConfig.from_dir(tiny_model_dir))
    commands = [
        pool_argv(cfg, layout, "pool-0", "127.0.0.1"),
        worker_argv(cfg, "prefill", 0, "prefill-0", "tiny", "127.0.0.1"),
        worker_argv(cfg, "decode", 0, "decode-0", "tiny", "127.0.0.1"),
        router_argv(cfg, "tiny", "127.0.0.1", 5, 6),
    ]
    for argv in commands:
        assert "--redis-url" not in argv and not any("redis://" in a for a in argv), argv


def test_members_read_the_redis_url_from_env_when_no_flag_gives_it(monkeypatch):
    import argparse

    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    bare = argparse.ArgumentParser()
    add_redis_url_arg(bare)
    with pytest.raises(SystemExit):  # neither the flag nor the environment: refused
        bare.parse_args([])
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:pw@h:1/0")
    p = argparse.ArgumentParser()
    add_redis_url_arg(p)
    assert p.parse_args([]).redis_url == "redis://:pw@h:1/0"
    assert p.parse_args(["--redis-url", "redis://h:2/0"]).redis_url == "redis://h:2/0"  # the flag wins


def test_up_refuses_an_empty_or_missing_cluster_secret_file_before_starting_anything(tmp_path, capsys):
    from kvferry.cli import main

    (tmp_path / "empty").write_text("\n")
    assert main(["up", "--cluster-secret-file", str(tmp_path / "empty")]) == 2
    assert "is empty" in capsys.readouterr().err
    assert main(["up", "--cluster-secret-file", str(tmp_path / "missing")]) == 2
    assert "--cluster-secret-file" in capsys.readouterr().err


def test_internal_tls_is_on_where_a_process_binds_beyond_loopback():
    import yaml

    assert not ClusterConfig().internal_tls_on()  # a loopback cluster: TLS would protect nothing
    assert not ClusterConfig(cluster_host="localhost").internal_tls_on()
    assert not ClusterConfig(cluster_host="::1").internal_tls_on()
    assert ClusterConfig(cluster_host="10.0.0.5").internal_tls_on()
    assert ClusterConfig(cluster_host="node-3").internal_tls_on()  # a name may resolve off this host
    assert ClusterConfig().internal_tls_on(ray=True)  # Ray nodes may be other hosts
    assert ClusterConfig(internal_tls="on").internal_tls_on()
    assert not ClusterConfig(cluster_host="10.0.0.5", internal_tls="off").internal_tls_on(ray=True)
    with pytest.raises(ClusterConfigError, match="internal_tls"):
        ClusterConfig(internal_tls="yes").validate()
    assert ClusterConfig().with_overrides(internal_tls="on").internal_tls == "on"  # --internal-tls
    assert ClusterConfig().with_overrides(internal_tls=None).internal_tls == "auto"
    for text, value in (("on", "on"), ("off", "off"), ("'on'", "on"), ("auto", "auto")):
        cfg = cluster_config_from_dict(yaml.safe_load(f"internal_tls: {text}"))  # a bare on is a YAML bool
        assert cfg.internal_tls == value
        assert cluster_config_from_dict(cluster_config_to_dict(cfg)) == cfg


@pytest.fixture
def launcher_env(monkeypatch):
    """The secret and TLS variables a launcher sets in its own environment are undone after the test."""
    from kvferry.auth import TLS_ENVS

    for name in (SECRET_ENV, *TLS_ENVS):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_with_internal_tls_each_child_gets_the_ca_and_a_new_leaf_and_redis_none(tmp_path, launcher_env):
    from cryptography import x509

    from kvferry.auth import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, tls_material
    from kvferry.deploy.local import TLS_FILES

    cluster = LocalCluster(ClusterConfig(internal_tls="on"), log_dir=tmp_path, quiet=True)
    cluster.secret = "the-secret"
    cluster._set_tls()
    mine = tls_material()  # the launcher's own leaf: its clients and tools reach internal ports
    assert mine is not None and mine.ca == cluster.ca.cert_pem
    files = [tmp_path / name for name in TLS_FILES]
    assert [f.read_bytes() for f in files] == [mine.ca, mine.cert, mine.key]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    show = "import os; print(repr([os.environ.get(k) for k in ('%s', '%s', '%s')]))"
    dump = [sys.executable, "-c", show % (TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV)]
    seen = {}
    for name in ("pool-0", "decode-0", "redis"):
        child = cluster._spawn(name, dump)
        _wait_exit(child)
        seen[name] = ast.literal_eval(child.log.read_text())
        assert TLS_KEY_ENV not in child.env  # not kept: a restart gets a new leaf
    assert seen["redis"] == [None, None, None]  # no gRPC: no key
    ca = x509.load_pem_x509_certificate(mine.ca)
    leaves = {}
    for name in ("pool-0", "decode-0"):
        ca_pem, cert_pem, key_pem = seen[name]
        assert ca_pem.encode() == mine.ca and "PRIVATE KEY" in key_pem
        leaves[name] = x509.load_pem_x509_certificate(cert_pem.encode())
        leaves[name].verify_directly_issued_by(ca)
    serials = {x509.load_pem_x509_certificate(mine.cert).serial_number}
    serials |= {leaf.serial_number for leaf in leaves.values()}
    assert len(serials) == 3  # a leaf of its own for each
    restarted = cluster.children[0]
    cluster._restart(restarted, 0.0)
    _wait_exit(restarted)
    assert restarted.log.read_text().count("BEGIN CERTIFICATE") == 4  # (CA + leaf) twice
    lines = restarted.log.read_text().splitlines()
    first, again = (ast.literal_eval(line) for line in lines if line.startswith("["))
    assert first[1] != again[1]


def test_without_internal_tls_the_launcher_drops_any_tls_material(tmp_path, launcher_env, monkeypatch):
    from kvferry.auth import TLS_ENVS, tls_material

    for name in TLS_ENVS:
        monkeypatch.setenv(name, "left by another cluster")
    cluster = LocalCluster(ClusterConfig(), log_dir=tmp_path, quiet=True)
    cluster._set_tls()
    assert cluster.ca is None and tls_material() is None
    assert not list(tmp_path.glob("tls-*"))
