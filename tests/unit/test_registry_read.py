"""MetadataStore.members_of: the whole registry in two round trips, as `members` reads one role."""

from __future__ import annotations

import pytest

from kvferry.kvpool.metadata import MetadataStore


@pytest.fixture()
def meta(redis_url, request):
    store = MetadataStore(redis_url, namespace=request.node.name)
    yield store
    store.client.close()


def test_members_of_reads_every_role_and_forgets_expired_records(meta):
    meta.register("prefill", "p0", {"addr": "h:1"}, ttl_s=30)
    meta.register("prefill", "p1", {"addr": "h:2"}, ttl_s=30)
    meta.register("decode", "d0", {"addr": "h:3"}, ttl_s=30)
    meta.client.delete(meta._nkey("prefill", "p1"))  # its TTL ran out: the set still names it
    meta.client.set(meta._nkey("decode", "bad"), b"not json")
    meta.client.sadd(meta._mkey("decode"), "bad")
    read = meta.members_of(("prefill", "decode", "pool"))
    assert read == {"prefill": {"p0": {"addr": "h:1"}}, "decode": {"d0": {"addr": "h:3"}}, "pool": {}}
    assert meta.client.smembers(meta._mkey("prefill")) == {b"p0"}  # the lapsed one is forgotten
    assert {role: meta.members(role) for role in ("prefill", "decode", "pool")} == read


def test_members_of_says_none_for_every_role_when_redis_is_down():
    meta = MetadataStore("redis://127.0.0.1:1", namespace="down")
    assert meta.members_of(("prefill", "decode")) == {"prefill": None, "decode": None}
    assert meta.members("prefill") is None
