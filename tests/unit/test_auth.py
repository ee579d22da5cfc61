"""The cluster secret and API keys gate real gRPC servers (threaded and asyncio); health stays open."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvferry import auth, rpc, settings


def _list_services(channel, metadata=()) -> list[str]:
    """A streaming call (server reflection): the gate must handle every RPC kind."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=5
    )
    return [s.name for r in replies for s in r.list_services_response.service]


def _status(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


@pytest.fixture
def secret(monkeypatch) -> str:
    value = auth.new_secret()
    monkeypatch.setenv(auth.SECRET_ENV, value)
    return value


def test_a_threaded_server_wants_the_cluster_secret(secret):
    server, port, health = rpc.start_server(lambda s: None, ["test.Svc"], "127.0.0.1", 0, 4)
    target = f"127.0.0.1:{port}"
    try:
        rpc.set_serving(health, ["test.Svc"])
        with grpc.insecure_channel(target) as bare:
            code = _status(lambda: _list_services(bare))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            wrong = ((auth.SECRET_HEADER, secret + "x"),)
            assert _status(lambda: _list_services(bare, wrong)) == grpc.StatusCode.UNAUTHENTICATED
            # health is open to probes, and says nothing more than SERVING
            reply = health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with rpc.channel(target) as ch:  # kvferry's own channels carry the secret
            assert "test.Svc" in _list_services(ch)
        assert rpc.check_health(target)
    finally:
        server.stop(0)


def test_without_a_secret_the_cluster_is_open(monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    server, port, _ = rpc.start_server(lambda s: None, ["test.Svc"], "127.0.0.1", 0, 4)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as bare:
            assert "test.Svc" in _list_services(bare)
    finally:
        server.stop(0)


def test_an_asyncio_server_takes_an_api_key_or_the_secret(secret):
    from grpc_reflection.v1alpha import reflection

    async def main() -> None:
        creds = auth.Credentials(secret=secret, api_keys=["key-1", "key-2"])
        server = grpc.aio.server(interceptors=auth.server_interceptors(creds, aio=True))
        reflection.enable_server_reflection(("test.Svc", reflection.SERVICE_NAME), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        target = f"127.0.0.1:{port}"

        async def names(channel, metadata=()) -> list[str]:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(metadata=metadata, timeout=5)
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            await call.done_writing()
            return [s.name async for r in call for s in r.list_services_response.service]

        async def refusal(channel, metadata=()) -> tuple[grpc.StatusCode, str]:
            # No write: the interceptor answers on the metadata alone, and a write racing that answer
            # fails in grpc's aio client as INTERNAL ("Failed execute_batch") instead of the status.
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(metadata=metadata, timeout=5)
            return await call.code(), await call.details()

        try:
            async with grpc.aio.insecure_channel(target) as bare:
                code, details = await refusal(bare)
                assert code == grpc.StatusCode.UNAUTHENTICATED
                assert "API key" in details
                code, _ = await refusal(bare, (("authorization", "Bearer key-3"),))
                assert code == grpc.StatusCode.UNAUTHENTICATED
                assert "test.Svc" in await names(bare, (("authorization", "Bearer key-2"),))
            async with rpc.aio_channel(target) as ch:  # the cluster secret is accepted too
                assert "test.Svc" in await names(ch)
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_credentials_check_without_requirements_accepts_anything():
    assert auth.Credentials().check(None) is None
    assert auth.Credentials(api_keys=["k"]).check([("authorization", "Bearer k")]) is None
    assert auth.Credentials(api_keys=["k"]).check([("authorization", "Bearer kk")]) is not None
    assert auth.Credentials(secret="s").check([]) is not None


def test_an_api_key_spec_gives_the_key_and_its_options():
    assert settings.split_key_spec("sk-1") == ("sk-1", {})
    assert settings.split_key_spec("sk-1:min_priority=-5:max_inflight=8") == (
        "sk-1",
        {"min_priority": -5, "max_inflight": 8},
    )
    assert settings.split_key_spec("sk-1:tokens_per_min=900:cache_group=acme") == (
        "sk-1",
        {"tokens_per_min": 900, "cache_group": "acme"},
    )
    for bad, words in (
        ("sk-1:burst=3", "expected one of min_priority, max_inflight, tokens_per_min, cache_group"),
        ("sk-1:cache_group=", "cache_group: empty"),
        ("sk-1:max_inflight=many", "not an integer"),
        (":max_inflight=2", "without a key"),
    ):
        with pytest.raises(ValueError, match=words):
            settings.split_key_spec(bad)
    # what clients send is the key alone, and it is what the server checks
    creds = auth.Credentials(None, ["sk-1:max_inflight=8", "sk-2"])
    assert creds.key_ok("sk-1") and creds.key_ok("sk-2") and not creds.key_ok("sk-1:max_inflight=8")


def test_key_policies_and_salts():
    from kvferry.router.admission import KeyPolicy, key_policies, tenant_salt
    from kvferry.router.config import RouterConfig

    cfg = RouterConfig(
        api_keys=("a", "b:min_priority=-3", "c:cache_group=g"),
        min_priority=1,
        max_inflight_per_key=4,
        tokens_per_min_per_key=500,
    )
    assert key_policies(cfg) == {
        auth.owner_of_key("b"): KeyPolicy(min_priority=-3, max_inflight=4, tokens_per_min=500),
        auth.owner_of_key("c"): KeyPolicy(
            min_priority=1, max_inflight=4, tokens_per_min=500, cache_group="g"
        ),
    }
    assert tenant_salt("s", "", "key") == "s"  # no key: as it is
    assert tenant_salt("s", "o1", "key") != tenant_salt("s", "o2", "key") != "s"
    assert tenant_salt("s", "o1", "cluster") == "s"
    # keys of one cache group salt alike, and unlike any key outside it
    assert (
        tenant_salt("s", "o1", "key", "g")
        == tenant_salt("s", "o2", "key", "g")
        != tenant_salt("s", "o1", "key")
    )


def test_the_keys_file_and_the_one_check_of_key_specs(tmp_path):
    from kvferry.router.config import RouterConfig

    keys = tmp_path / "keys"
    keys.write_text("# tenants\n\nk-1\n  k-2:max_inflight=3  \n#k-3\n")
    assert settings.read_key_file(str(keys)) == ("k-1", "k-2:max_inflight=3")
    assert RouterConfig(api_keys=("k-0",), api_keys_file=str(keys)).key_specs() == (
        "k-0",
        "k-1",
        "k-2:max_inflight=3",
    )
    keys.write_text("k-1\nk-2:max_inflight=lots\n")
    with pytest.raises(ValueError, match="keys:2: API key option max_inflight"):
        RouterConfig(api_keys_file=str(keys)).key_specs()
    with pytest.raises(ValueError, match=r"--api-keys-file: .*No such file"):
        RouterConfig(api_keys_file=str(tmp_path / "missing")).key_specs()
    with pytest.raises(ValueError, match="--api-key: API key option"):
        RouterConfig(api_keys=("k:oops",)).key_specs()


def test_tokens_a_minute_are_counted_in_redis_for_every_router(redis_url):
    from kvferry.kvpool.metadata import MetadataStore

    one, other = MetadataStore(redis_url, "rate-test"), MetadataStore(redis_url, "rate-test")  # two routers
    now = 60 * 1000 + 15.0  # 15 s into a minute
    assert one.charge_tokens("owner-a", 600, 1000, now) == 0
    assert other.charge_tokens("owner-a", 600, 1000, now) == 45.0  # 1200 > 1000, whichever router counts
    assert one.charge_tokens("owner-a", 400, 1000, now) == 0  # the refused one was not counted: 1000
    assert one.charge_tokens("owner-a", 1, 1000, now + 44.5) == 1.0  # (at least a second)
    assert one.charge_tokens("owner-a", 1, 1000, now + 45) == 0  # the next minute
    assert one.charge_tokens("owner-b", 5000, 1000, now) == 0  # alone in its window, a big one passes
    assert one.charge_tokens("owner-b", 1, 1000, now) > 0
    assert 0 < one.client.ttl(f"kvf:rate-test:rate:owner-b:{int(now // 60)}") <= 120  # windows expire
