"""The router's public face in a real cluster: API keys (gRPC metadata and HTTP header), TLS on both
ports with a certificate made here, the default deadline of a request whose client sets none, and a
model name that shows no filesystem path. The routers under test are extra router processes started
here against the registry of conftest's shared `cluster` (the launcher's own router stays plain)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import random
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from cluster_helpers import ExtraRouter, greedy, wait_for

from kvferry.router.client import Client, build_request

pytestmark = [pytest.mark.slow, pytest.mark.shared_cluster()]

KEY, ENV_KEY = "key-from-flag", "key-from-env"


def self_signed(directory) -> tuple[str, str]:
    """(cert.pem, key.pem) for 127.0.0.1 and localhost, made with `cryptography`, else `openssl`."""
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor openssl is installed: no certificate to test")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key_path), "-out", str(cert_path), "-days", "1", "-subj", "/CN=localhost",
             "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True, capture_output=True,
        )  # fmt: skip
        return str(cert_path), str(key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def secured(cluster, tls, tmp_path_factory):
    """A router with two API keys (one by flag, one by environment) serving TLS on both ports."""
    cert, key = tls
    logs = tmp_path_factory.mktemp("secured-router")
    router = ExtraRouter(
        cluster,
        logs / "router.log",
        *("--api-key", KEY, "--ssl-certfile", cert, "--ssl-keyfile", key),
        env={"KVFERRY_API_KEY": ENV_KEY},
    )
    root = Path(cert).read_bytes()

    def ready() -> bool:
        assert router.proc.poll() is None, router.log.read_text()[-3000:]
        try:
            with Client(router.addr, api_key=KEY, root_certificates=root) as c:
                return c.model_info(timeout=2).num_decode_workers == 1
        except grpc.RpcError:
            return False

    wait_for(ready, 90, "the secured router")
    yield router, root
    router.stop()


def short(**kw):
    return greedy([5, 6, 7, 8], 3, **kw)


@pytest.mark.parametrize("api_key", [None, "wrong-key"])
def test_grpc_without_a_valid_key_is_unauthenticated(secured, api_key):
    router, root = secured
    with Client(router.addr, api_key=api_key, root_certificates=root) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate(short(), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            c.model_info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("api_key", [KEY, ENV_KEY])
def test_grpc_with_a_key_over_tls_is_served(secured, api_key, tiny_model_dir):
    router, root = secured
    with Client(router.addr, api_key=api_key, root_certificates=root) as c:
        got = c.generate(short(), timeout=60)
        assert got.finished.output_tokens == 3
        info = c.model_info()
    assert info.model == tiny_model_dir.name  # the served name, not the checkpoint's path
    assert str(tiny_model_dir) not in str(info)


def test_grpc_without_tls_is_refused(secured):
    router, _ = secured
    with Client(router.addr, api_key=KEY) as c, pytest.raises(grpc.RpcError) as err:
        c.generate(short(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # a plaintext client cannot even connect


def https(router, root, path, body=None, key=None) -> tuple[int, dict | str]:
    context = ssl.create_default_context(cadata=root.decode())
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    url = f"https://127.0.0.1:{router.http_port}{path}"
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, data, headers), timeout=60, context=context
        ) as reply:
            text = reply.read().decode()
            status = reply.status
    except urllib.error.HTTPError as err:
        text, status = err.read().decode(), err.code
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def test_http_api_keys_over_https(secured, tiny_model_dir):
    router, root = secured
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    for key in (None, "wrong-key"):
        status, reply = https(router, root, "/v1/completions", body, key)
        assert status == 401, reply
        assert reply["error"]["code"] == 401 and "API key" in reply["error"]["message"]
        assert https(router, root, "/v1/models", key=key)[0] == 401
    status, reply = https(router, root, "/v1/completions", body, KEY)
    assert status == 200 and reply["usage"]["completion_tokens"] == 2
    status, models = https(router, root, "/v1/models", key=ENV_KEY)
    assert status == 200 and str(tiny_model_dir) not in json.dumps(models)
    assert https(router, root, "/health")[0] == 200  # probes and scrapers need no key
    status, text = https(router, root, "/metrics")
    assert status == 200 and "kvferry:requests_total" in text


def test_default_deadline_applies_when_the_client_sets_none(cluster, tmp_path):
    router = ExtraRouter(cluster, tmp_path / "router.log", "--request-timeout-s", "0.2", "--no-http")
    try:
        with Client(router.addr) as c:

            def ready() -> bool:
                assert router.proc.poll() is None, router.log.read_text()[-3000:]
                try:
                    return c.model_info(timeout=2).num_decode_workers == 1
                except grpc.RpcError:
                    return False

            wait_for(ready, 90, "the router with a short default deadline")
            long = build_request(prompt_token_ids=[5] * 20, max_tokens=1000, temperature=0.0, ignore_eos=True)
            with pytest.raises(grpc.RpcError) as err:
                c.generate(long)  # no client deadline: the router's own ends it
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        router.stop()


def test_loadtest_sweep_carries_the_key_and_a_refusal_stops_it_at_once(cluster, tmp_path, monkeypatch):
    """`kvferry loadtest sweep` against a keyed router: without the key it stops at its first step with
    the server's own message (it used to sweep ~335 s of refused requests in silence); with `--api-key`,
    or the key in $KVFERRY_API_KEY, every request is served, over HTTP and gRPC."""
    from kvferry.cli import main
    from kvferry.loadtest.metrics import read_records

    router = ExtraRouter(cluster, tmp_path / "router.log", "--api-key", KEY)
    http = f"http://127.0.0.1:{router.http_port}"
    try:

        def ready() -> bool:
            assert router.proc.poll() is None, router.log.read_text()[-3000:]
            try:
                with Client(router.addr, api_key=KEY) as c:
                    return c.model_info(timeout=2).num_decode_workers == 1
            except grpc.RpcError:
                return False

        wait_for(ready, 90, "the keyed router")
        out = tmp_path / "sweep"
        argv = ["loadtest", "sweep", "--target", http, "--compare", router.addr, "--labels", "http,grpc"]
        argv += ["--rates", "2", "--duration", "2", "--input-len", "20", "--output-len", "4"]
        argv += ["--slo-ttft", "2", "--slo-tpot", "0.5", "--out", str(out)]
        monkeypatch.delenv("KVFERRY_API_KEY", raising=False)
        for key, want in ((None, "missing or invalid API key"), ("wrong", "missing or invalid API key")):
            t0 = time.monotonic()
            with pytest.raises(SystemExit) as err:
                main(argv + (["--api-key", key] if key else []))
            assert "refused the load test (HTTP 401)" in str(err.value) and want in str(err.value)
            assert time.monotonic() - t0 < 30 and not out.exists()  # at once: no rate was run
        with pytest.raises(SystemExit) as err:  # a gRPC target alone: the same, with gRPC's status
            main(["loadtest", "sweep", "--target", router.addr, *argv[4:]])
        assert "refused the load test (UNAUTHENTICATED)" in str(err.value)
        # the first key of the environment's (its options, the router's business, are not sent)
        monkeypatch.setenv("KVFERRY_API_KEY", f"{KEY}:max_inflight=64,another")
        assert main(argv) == 0
        for label in ("http", "grpc"):
            records = read_records(out / label / "rate-2.jsonl")
            assert records and all(r.ok and r.output_tokens == 4 for r in records), label
    finally:
        router.stop()


def cached_tokens(router: ExtraRouter, key: str, prompt: list[int]) -> int:
    """What one greedy request of `prompt` with `key` found cached (-1: the router does not serve yet)."""
    assert router.proc.poll() is None, router.log.read_text()[-3000:]
    request = build_request(prompt_token_ids=prompt, max_tokens=1, temperature=0.0)
    try:
        with Client(router.addr, api_key=key) as c:
            return c.generate(request, timeout=60).finished.cached_tokens
    except grpc.RpcError:
        return -1


def test_prefix_cache_scope_cluster_shares_cached_prompts_among_keys(cluster, tmp_path):
    """--prefix-cache-scope cluster: every key finds what any key sent (the most hits; the default, key,
    is in test_hostile_clients)."""
    flags = ("--api-key", KEY, "--api-key", "second-key", "--prefix-cache-scope", "cluster")
    router = ExtraRouter(cluster, tmp_path / "router.log", *flags)
    rng = random.Random(7)
    prompt = [rng.randrange(100, 8000) for _ in range(96)]  # six blocks, sent nowhere before
    try:
        # the first key's requests until one finds its own prefix cached (the cache is warm)
        wait_for(lambda: cached_tokens(router, KEY, prompt) >= 16, 90, "a cached prompt")
        assert cached_tokens(router, "second-key", prompt) >= 16  # the other key's first request of it
    finally:
        router.stop()
