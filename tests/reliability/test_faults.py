"""Fault injection on a real local cluster: kills, a pause, overload, a thousand cancellations, a fuzz of
the public request and unauthenticated callers. Each test runs one scenario of fault_scenarios (the
same code bench/reliability.py reports in docs/reliability.md) and asserts what every scenario must
hold — no wrong token, no hung request, nothing leaked, no unclean failure — plus its own expectations.
"""

from __future__ import annotations

import pytest

from kvferry.deploy.fault_harness import ScenarioResult
from kvferry.deploy.fault_scenarios import SCENARIOS

pytestmark = pytest.mark.slow


def check(result: ScenarioResult) -> None:
    summary = (
        f"{result.name}: {result.sent} sent, {result.ok} correct, codes {result.codes}; "
        f"examples {result.examples}; notes {result.notes}"
    )
    assert result.wrong == 0, f"wrong tokens: {summary}"
    assert result.hung == 0, f"hung requests: {summary}"
    assert result.leaked == 0, f"leaked after the load: {result.leak_detail}; {summary}"
    assert result.unclean == 0, f"unclean failures: {summary}"
    assert not result.problems, f"{result.problems}; {summary}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(ctx, name):
    result = SCENARIOS[name](ctx)
    check(result)
