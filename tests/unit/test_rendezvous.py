"""Groups rendezvous in the cluster's Redis (kvpool.rendezvous): a gloo group forms over it, the store
keeps torch's semantics, and a process without the cluster's credential reads nothing."""

from __future__ import annotations

import subprocess
import threading
import time
from datetime import timedelta

import pytest
import redis
import torch

from kvferry.deploy.cluster_ca import ClusterCA
from kvferry.deploy.redis_server import redis_server_argv, wait_for_redis, write_redis_config
from kvferry.kvpool.metadata import MetadataStore, redis_client
from kvferry.kvpool.rendezvous import TTL_S, fresh_name, group_store
from kvferry.kvpool.transfer import check_interface, make_pair_group
from kvferry.proc import free_port


@pytest.mark.parametrize("interface", ["", "lo"])  # the host's address, or pool.data_interface's
def test_a_gloo_pair_forms_over_the_store_and_moves_a_tensor(redis_url, interface):
    meta = MetadataStore(redis_url, "rdv-test")
    name = fresh_name("peer")
    groups = {}

    def join(rank: int) -> None:
        store = meta.rendezvous(name, 20)
        groups[rank] = make_pair_group(store, name, rank, "gloo", "127.0.0.1", 20, interface)

    other = threading.Thread(target=join, args=(1,))
    other.start()
    join(0)
    other.join(20)
    sent, got = torch.arange(6, dtype=torch.float32), torch.zeros(6)
    work = groups[1].recv([got], 0, 7)
    groups[0].send([sent], 1, 7).wait()
    work.wait()
    assert torch.equal(sent, got)
    keys = meta.client.keys(f"kvf:rdv-test:rdv:{name}/*")
    assert keys, "the rendezvous wrote nothing under its name"
    assert all(0 < meta.client.ttl(k) <= TTL_S for k in keys)  # every key expires


def test_the_store_keeps_torchs_semantics(redis_url):
    store = group_store(redis_client(redis_url), "rdv-test", fresh_name("sem"), timeout_s=0.3)
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", b"", b"x") == b"x"  # missing + expected empty: set
    assert store.compare_set("c", b"y", b"z") == b"x"  # holds another value: unchanged
    assert store.compare_set("c", b"x", b"z") == b"z"
    assert store.compare_set("missing", b"y", b"z") == b"y"  # missing, expected given: not set
    assert store.check(["a", "n"]) and not store.check(["a", "nope"])
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="nope"):
        store.get("nope")
    assert time.monotonic() - started < 2.0  # the store's timeout, not a hang
    with pytest.raises(TimeoutError):
        store.wait(["nope"], timedelta(seconds=0.1))
    assert store.delete_key("a") and not store.check(["a"])
    assert store.num_keys() == 2  # n, c


def test_fresh_names_never_repeat():
    assert len({fresh_name("g") for _ in range(1000)}) == 1000


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A redis-server as `kvferry up` starts one with internal TLS: a password and TLS only."""
    where = tmp_path_factory.mktemp("redis-tls")
    ca = ClusterCA.create()
    port, password = free_port(), "pw-" + "x" * 20
    config, tls = write_redis_config(where / "redis.conf", password, ca.issue("127.0.0.1"))
    proc = subprocess.Popen(
        redis_server_argv("127.0.0.1", port, where, config=config, tls=tls),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client_leaf = ca.issue()
    try:
        yield port, password, client_leaf
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_process_without_the_credential_reads_no_rendezvous(tls_redis, monkeypatch):
    port, password, leaf = tls_redis
    for name, value in leaf.env().items():  # this process holds a leaf of the cluster CA
        monkeypatch.setenv(name, value)
    url = wait_for_redis("127.0.0.1", port, time.monotonic() + 20, password=password, tls=True)
    assert url.startswith("rediss://")
    store = group_store(redis_client(url), "rdv-test", "g/1", timeout_s=1)
    store.set("rank0", b"10.0.0.1:5555")
    assert store.get("rank0") == b"10.0.0.1:5555"
    # plaintext (what a TCPStore client or a redis-cli would speak): the TLS port drops it
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=2).get("x")
    # TLS without the password: refused, nothing read
    with pytest.raises(redis.AuthenticationError):
        redis_client(f"rediss://127.0.0.1:{port}/0").keys("*")
    with pytest.raises(redis.AuthenticationError):
        redis_client(f"rediss://:wrong@127.0.0.1:{port}/0").get("kvf:rdv-test:rdv:g/1/rank0")
    # TLS with the password, but a server certificate checked against other roots: refused
    for name in leaf.env():
        monkeypatch.delenv(name)
    with pytest.raises(redis.ConnectionError, match=r"(?i)certificate"):
        redis_client(url).ping()


def test_a_data_interface_the_host_lacks_is_refused_at_start():
    check_interface("")
    check_interface("lo")
    with pytest.raises(ValueError, match="data_interface 'no-such0': no such network interface here"):
        check_interface("no-such0")
