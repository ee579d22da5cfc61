"""experts_forward (padded and looped paths, local expert ranges) against a per-token reference."""

from __future__ import annotations

import pytest
import torch

from kvferry.model import moe
from kvferry.model.moe import experts_forward, route, silu_and_mul

H, I, E, K = 16, 8, 6, 3


def reference(x, ids, weights, w13, w2, first=0):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first
            if 0 <= e < w13.shape[0]:
                out[t] += weights[t, j] * (silu_and_mul(x[t] @ w13[e]) @ w2[e])
    return out


@pytest.fixture
def weights():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(E, H, 2 * I, generator=gen), torch.randn(E, I, H, generator=gen), torch.randn(H, E)


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("padded", [True, False])
def test_matches_reference(weights, tokens, padded, monkeypatch):
    monkeypatch.setattr(moe, "PADDED_MAX_TOKENS", 10**6 if padded else 0)
    w13, w2, router = weights
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    w, ids = route(x, router, K, renormalize=False)
    want = reference(x, ids, w, w13, w2)
    # float32 rounding of sums whose terms reach |want|.max() (~200 here), whatever the summation order
    assert torch.allclose(experts_forward(x, ids, w, w13, w2), want, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("padded", [True, False])
def test_local_expert_range_sums_to_whole(weights, padded, monkeypatch):
    """Splitting the experts over two 'ranks' and summing gives the single-process result."""
    monkeypatch.setattr(moe, "PADDED_MAX_TOKENS", 10**6 if padded else 0)
    w13, w2, router = weights
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(1))
    w, ids = route(x, router, K, renormalize=True)
    whole = experts_forward(x, ids, w, w13, w2)
    low = experts_forward(x, ids, w, w13[:2], w2[:2], first_expert=0)
    high = experts_forward(x, ids, w, w13[2:], w2[2:], first_expert=2)
    assert torch.allclose(low + high, whole, atol=1e-5)
    assert torch.allclose(high, reference(x, ids, w, w13[2:], w2[2:], first=2), atol=1e-5)


def test_no_local_assignments_gives_zeros(weights):
    w13, w2, _ = weights
    x = torch.randn(4, H)
    ids = torch.zeros(4, K, dtype=torch.long)  # every token picks expert 0, which is not local
    out = experts_forward(x, ids, torch.ones(4, K), w13[3:], w2[3:], first_expert=3)
    assert torch.count_nonzero(out) == 0
