"""Hot-block counting (`kvpool/hot.py`): a block becomes hot on its `reads`-th read within the window,
is queued once per window, and counting is off with reads 0 or a single replica."""

from __future__ import annotations

import pytest

from kvferry.deploy.config import ClusterConfigError
from kvferry.kvpool.config import PoolConfig
from kvferry.kvpool.hot import HotBlocks


def test_a_block_is_queued_on_its_nth_read_within_the_window():
    hot = HotBlocks(reads=3, window_s=10.0, replicas=2)
    hot.read([b"a", b"b"], now=0.0)
    hot.read([b"a"], now=1.0)
    assert hot.take(timeout=0) == []
    hot.read([b"a", b"b"], now=2.0)  # a's third read; b's second
    assert hot.take(timeout=0) == [b"a"]
    hot.read([b"a"] * 5, now=3.0)  # still hot within the window: not queued again
    assert hot.take(timeout=0) == []
    hot.read([b"b"], now=20.0)  # b's window ran out: its count starts over
    assert hot.take(timeout=0) == []
    hot.read([b"a"] * 3, now=30.0)  # a new window: hot again
    assert hot.take(timeout=0) == [b"a"]


@pytest.mark.parametrize("reads, replicas", [(0, 2), (3, 1)])
def test_counting_is_off(reads, replicas):
    hot = HotBlocks(reads=reads, window_s=10.0, replicas=replicas)
    hot.read([b"a"] * 10, now=0.0)
    assert not hot.enabled and hot.take(timeout=0) == [] and not hot.counts


@pytest.mark.parametrize(
    "bad", [{"replicas": 0}, {"hot_replicas": 0}, {"hot_reads": -1}, {"hot_window_s": 0.0}]
)
def test_pool_settings_refuse_bad_replica_settings(bad):
    with pytest.raises(ClusterConfigError):
        PoolConfig(**bad)
