"""Fixtures of the fault-injection suite: one cluster for the whole module (scenarios wait for its
topology to come back after each other's kills), the prompt set and its greedy reference."""

from __future__ import annotations

import pytest

from kvferry.deploy.fault_harness import FaultCluster, fixed_prompts, reference_tokens
from kvferry.deploy.fault_scenarios import MAX_INFLIGHT, Context

API_KEY = "reliability-api-key"


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return fixed_prompts()


@pytest.fixture(scope="session")
def reference(tiny_model_dir, prompts) -> list[list[int]]:
    return reference_tokens(tiny_model_dir, prompts)


@pytest.fixture(scope="module")
def ctx(tiny_model_dir, tmp_path_factory, prompts, reference):
    """2 prefill + 2 decode workers, a pool node, a router (--max-inflight 12, an API key when the
    launcher supports them), all with the cluster secret."""
    workdir = tmp_path_factory.mktemp("faults")
    with FaultCluster(tiny_model_dir, workdir, max_inflight=MAX_INFLIGHT, api_keys=(API_KEY,)) as cluster:
        yield Context(cluster, prompts, reference)
