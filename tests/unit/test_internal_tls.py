"""Mutual TLS on the internal plane: the cluster CA and its leaves (deploy.cluster_ca), and real gRPC
servers and channels of kvferry.rpc that serve only clients holding a leaf of the cluster's CA."""

from __future__ import annotations

import asyncio
import datetime

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvferry import auth, rpc
from kvferry.deploy.cluster_ca import VALIDITY, ClusterCA

NAMES = ["test.Svc"]


@pytest.fixture(scope="module")
def ca() -> ClusterCA:
    return ClusterCA.create()


@pytest.fixture
def secret(monkeypatch) -> str:
    value = auth.new_secret()
    monkeypatch.setenv(auth.SECRET_ENV, value)
    return value


def use(monkeypatch, material: auth.TlsMaterial | None) -> None:
    """Make `material` this process's TLS material (None: plaintext), as a launcher's child has it."""
    for name in auth.TLS_ENVS:
        monkeypatch.delenv(name, raising=False)
    for name, value in (material.env() if material else {}).items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def server(ca, secret, monkeypatch):
    """A threaded kvferry server (health + reflection) on mutual TLS with a leaf of `ca`; its target."""
    use(monkeypatch, ca.issue("127.0.0.1"))
    srv, port, health = rpc.start_server(lambda s: None, NAMES, "127.0.0.1", 0, 4)
    rpc.set_serving(health, NAMES)
    yield f"127.0.0.1:{port}"
    srv.stop(0)


def health_check(channel: grpc.Channel) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


def list_services(channel: grpc.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    return [s.name for r in replies for s in r.list_services_response.service]


def refused(channel: grpc.Channel) -> grpc.StatusCode:
    """The code of a health check on `channel`, which must fail (health is open to every client that
    gets through the transport: a refusal here is the transport's)."""
    with pytest.raises(grpc.RpcError) as err:
        health_check(channel)
    return err.value.code()


def tls_channel(target: str, root: bytes, leaf: auth.TlsMaterial | None = None) -> grpc.Channel:
    """A TLS channel trusting `root`, showing `leaf`'s certificate (None: no certificate at all)."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=root,
        private_key=leaf.key if leaf else None,
        certificate_chain=leaf.cert if leaf else None,
    )
    return grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", auth.CLUSTER_NAME)])


def test_the_ca_signs_leaves_for_both_ends_naming_the_cluster(ca):
    assert ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert isinstance(ca.cert.public_key(), ec.EllipticCurvePublicKey)
    assert ca.cert.public_key().curve.name == "secp256r1"
    leaf = ca.issue("10.1.2.3")
    cert = x509.load_pem_x509_certificate(leaf.cert)
    cert.verify_directly_issued_by(ca.cert)
    assert cert.public_key().curve.name == "secp256r1"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [auth.CLUSTER_NAME]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.1.2.3"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH}
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    lifetime = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert VALIDITY - datetime.timedelta(minutes=1) < lifetime <= VALIDITY
    assert leaf.ca == ca.cert_pem and b"PRIVATE KEY" in leaf.key
    assert "PRIVATE" not in repr(leaf)  # the key never lands in a log line
    named = x509.load_pem_x509_certificate(ca.issue("node-7.example").cert)
    named_san = named.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert named_san.get_values_for_type(x509.IPAddress) == []  # a host name: the cluster name only


def test_a_leaf_never_outlives_its_ca():
    short = ClusterCA.create(validity=datetime.timedelta(days=1))
    leaf = x509.load_pem_x509_certificate(short.issue().cert)
    assert leaf.not_valid_after_utc == short.cert.not_valid_after_utc


def test_part_of_the_material_is_an_error_not_plaintext(monkeypatch, ca):
    use(monkeypatch, None)
    assert auth.tls_material() is None
    use(monkeypatch, ca.issue())
    assert auth.tls_material() is not None
    monkeypatch.delenv(auth.TLS_KEY_ENV)
    with pytest.raises(auth.TlsSettingsError, match=auth.TLS_KEY_ENV):
        auth.tls_material()
    with pytest.raises(auth.TlsSettingsError):
        rpc.channel("127.0.0.1:1")


def test_a_client_with_a_leaf_of_the_same_ca_is_served(server, ca, monkeypatch):
    use(monkeypatch, ca.issue())  # another process of the cluster: its own leaf
    with rpc.channel(server) as ch:
        assert health_check(ch) == health_pb2.HealthCheckResponse.SERVING
        assert "test.Svc" in list_services(ch)  # past the secret's gate too
    assert rpc.check_health(server)


def test_inside_tls_the_cluster_secret_is_still_required(server, ca, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV)
    use(monkeypatch, ca.issue())
    with rpc.channel(server) as ch, pytest.raises(grpc.RpcError) as err:
        list_services(ch)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_client_without_a_certificate_is_refused(server, ca):
    with tls_channel(server, ca.cert_pem) as ch:
        assert refused(ch) == grpc.StatusCode.UNAVAILABLE


def test_a_client_with_a_certificate_of_another_ca_is_refused(server, ca):
    other = ClusterCA.create().issue("127.0.0.1")
    with tls_channel(server, ca.cert_pem, other) as ch:  # trusts the server; the server does not trust it
        assert refused(ch) == grpc.StatusCode.UNAVAILABLE


def test_a_plaintext_client_is_refused(server, monkeypatch):
    with grpc.insecure_channel(server) as bare:
        assert refused(bare) == grpc.StatusCode.UNAVAILABLE
    use(monkeypatch, None)  # a kvferry process without TLS material: the secret alone gets nowhere
    assert not rpc.check_health(server)


def test_a_cluster_client_refuses_a_server_of_another_ca(ca, secret, monkeypatch):
    use(monkeypatch, ClusterCA.create().issue("127.0.0.1"))  # an impostor with a certificate of its own
    srv, port, health = rpc.start_server(lambda s: None, NAMES, "127.0.0.1", 0, 4)
    rpc.set_serving(health, NAMES)
    try:
        use(monkeypatch, ca.issue())
        with rpc.channel(f"127.0.0.1:{port}") as ch:
            assert refused(ch) == grpc.StatusCode.UNAVAILABLE  # the secret is never sent to it
    finally:
        srv.stop(0)


def test_the_asyncio_server_and_channel_speak_mutual_tls(ca, secret, monkeypatch):
    use(monkeypatch, ca.issue("127.0.0.1"))
    server = rpc.AioServer(lambda s: None, NAMES, "127.0.0.1", 0)
    target = f"127.0.0.1:{server.port}"
    try:
        server.set_serving()
        use(monkeypatch, ca.issue())

        async def check() -> int:
            async with rpc.aio_channel(target) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status

        assert asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(target) as bare:
            assert refused(bare) == grpc.StatusCode.UNAVAILABLE
        with tls_channel(target, ca.cert_pem) as no_cert:
            assert refused(no_cert) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)
