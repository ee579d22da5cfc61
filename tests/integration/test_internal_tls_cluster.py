"""`kvferry up --internal-tls on` on loopback: every internal connection is mutual TLS with leaves of the
launcher's cluster CA. Requests flow router -> prefill -> pool -> decode as on a plaintext cluster, and a
process without a cluster certificate reaches no worker or pool node, even holding the cluster secret;
redis speaks TLS only and asks for its password."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import grpc
import pytest
import redis
from test_up_cli import descendants, up

from kvferry import rpc
from kvferry.auth import CLUSTER_NAME, SECRET_ENV, TLS_CA_ENV, TLS_ENVS, TLS_KEY_ENV
from kvferry.deploy.local import TLS_FILES
from kvferry.deploy.redis_server import TLS_FILES as REDIS_TLS_FILES
from kvferry.kvpool.metadata import MetadataStore, redis_client
from kvferry.router.client import Client, build_request
from kvferry.v1 import pool_pb2, pool_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow

NEW_TOKENS = 12


def environments(root: int) -> dict[str, dict[str, str]]:
    """The environment of each process under `root` by what it runs (kvferry.<module>, or redis)."""
    out = {}
    for pid in descendants(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        role = next((a.decode() for a in argv if a.startswith(b"kvferry.")), None)
        if role is None and b"redis-server" in argv[0]:
            role = "redis"
        if role is not None:
            out[role] = dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)
    return out


def refused(channel: grpc.Channel, call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call(channel)
    return err.value.code()


def decode_stats(channel: grpc.Channel):
    return worker_pb2_grpc.DecodeWorkerStub(channel).GetStats(worker_pb2.WorkerStatsRequest(), timeout=10)


def pool_stats(channel: grpc.Channel):
    return pool_pb2_grpc.KVPoolStub(channel).GetStats(pool_pb2.PoolStatsRequest(), timeout=10)


def test_a_tls_cluster_serves_greedy_requests_and_refuses_callers_without_its_certificate(
    tiny_model_dir, tmp_path, hf_greedy, monkeypatch
):
    logs = tmp_path / "logs"
    flags = ("--model", str(tiny_model_dir), "--dtype", "float32", "--log-dir", str(logs))
    with up(*flags, "--internal-tls", "on") as (proc, addr):
        prompts = [[(11 * i + 5 * j) % 500 + 10 for j in range(n)] for i, n in enumerate((5, 23, 47))]
        with Client(addr) as client:  # the public plane: plaintext, as configured
            requests = [
                build_request(prompt_token_ids=ids, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
                for ids in prompts
            ]
            got = [client.generate(r, 120).token_ids for r in requests]
        assert got == hf_greedy(tiny_model_dir, prompts, NEW_TOKENS)

        # every pool node, worker and router holds the CA and a leaf of its own; redis holds none
        envs = environments(proc.pid)
        members = ["kvferry.kvpool", "kvferry.prefill_worker", "kvferry.decode_worker", "kvferry.router"]
        assert sorted(envs) == sorted([*members, "redis"])
        assert not set(TLS_ENVS) & set(envs["redis"])
        assert len({envs[m][TLS_KEY_ENV] for m in members}) == len(members)
        assert len({envs[m][TLS_CA_ENV] for m in members}) == 1

        # redis speaks TLS only (a leaf of the cluster CA); the password is still the credential
        url = (logs / "redis-url").read_text().strip()
        assert url.startswith("rediss://")
        for name, file in zip(TLS_ENVS, TLS_FILES, strict=True):
            monkeypatch.setenv(name, (logs / file).read_text())
        meta = MetadataStore(url, "default")
        decode = next(iter(meta.members("decode").values()))["addr"]
        pool = next(iter(meta.members("pool").values()))["addr"]
        parsed = urlparse(url)
        with pytest.raises(redis.ConnectionError):  # plaintext, even with the password
            redis.Redis(
                host=parsed.hostname, port=parsed.port, password=parsed.password, socket_timeout=2
            ).ping()
        with pytest.raises(redis.AuthenticationError):  # TLS, no password
            redis_client(url.replace(f":{parsed.password}@", "")).keys("*")

        secret = (logs / "cluster-secret").read_text().strip()
        monkeypatch.setenv(SECRET_ENV, secret)  # a caller with the right secret, but no certificate
        for name in TLS_ENVS:
            monkeypatch.delenv(name, raising=False)
        ca = (logs / TLS_FILES[0]).read_bytes()
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
        override = [("grpc.ssl_target_name_override", CLUSTER_NAME)]
        for target, call in ((decode, decode_stats), (pool, pool_stats)):
            with rpc.channel(target) as plain:  # kvferry's own channel, plaintext: carries the secret
                assert refused(plain, call) == grpc.StatusCode.UNAVAILABLE
            assert not rpc.check_health(target)
            with grpc.secure_channel(target, no_cert, options=override) as tls_only:
                assert refused(tls_only, call) == grpc.StatusCode.UNAVAILABLE

        # the launcher's leaf (the log dir's, owner-only) is a cluster certificate: it gets through
        for name, file in zip(TLS_ENVS, TLS_FILES, strict=True):
            monkeypatch.setenv(name, (logs / file).read_text())
        with rpc.channel(decode) as ch:
            assert decode_stats(ch).blocks_pulled > 0  # the KV came over the pool
        with rpc.channel(pool) as ch:
            assert pool_stats(ch).blocks_in > 0
        assert rpc.check_health(decode) and rpc.check_health(pool)
    assert not [f for f in (*TLS_FILES, *REDIS_TLS_FILES) if (logs / f).exists()]  # removed at stop
