"""The C++ CPU kernels against their torch references (float32; odd sizes, padding, GQA)."""

from __future__ import annotations

import pytest
import torch

from kvferry.kernels import cpu
from kvferry.kernels.paged_attention import paged_decode_attention_reference
from kvferry.model.layers import apply_rotary, linear, pack, rms_norm
from kvferry.model.moe import experts_forward

pytestmark = pytest.mark.skipif(not cpu.load(), reason="the CPU kernels do not build or run here")
GEN = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, generator=GEN)


@pytest.mark.parametrize("m", [0, 1, 2, 5, 6, 7, 13, 40])
@pytest.mark.parametrize(("k", "n"), [(64, 48), (96, 40), (512, 8)])  # n=40, 8: a partial last block
def test_packed_linear(m, k, n):
    x, w = randn(m, k), randn(k, n)
    packed = pack(w)
    assert packed.shape == (-(-n // 16), k, 16) and packed.out_features == n
    out = linear(x, packed)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, x @ w, rtol=1e-5, atol=1e-4)


def test_bf16_exact_weights_are_stored_as_bf16():
    """A float32 weight holding only bf16 values (a bf16 checkpoint) packs to bf16, with the same products."""
    x, w = randn(3, 64), randn(64, 32).bfloat16().float()
    packed = pack(w)
    assert packed.dtype == torch.bfloat16
    torch.testing.assert_close(linear(x, packed), x @ w, rtol=1e-5, atol=1e-4)
    tall = randn(13, 64)  # more rows than one register tile: the block is widened once, then reused
    torch.testing.assert_close(linear(tall, packed), tall @ w, rtol=1e-5, atol=1e-4)
    assert pack(randn(64, 32)).dtype == torch.float32  # not bf16-exact: kept in float32
    stack = randn(2, 64, 32).bfloat16().float()
    ids, weights = torch.tensor([[0, 1], [1, 0], [1, 1]]), torch.rand(3, 2, generator=GEN)
    w2 = randn(2, 16, 64).bfloat16().float()
    out = experts_forward(x, ids, weights, pack(stack), pack(w2))
    torch.testing.assert_close(out, experts_forward(x, ids, weights, stack, w2), rtol=1e-4, atol=1e-4)


def test_packed_expert_stack():
    w = randn(3, 32, 64)
    packed = pack(w)
    assert packed.shape == (3, 4, 32, 16)
    x = randn(5, 32)
    torch.testing.assert_close(linear(x, pack(w[1])), x @ w[1], rtol=1e-5, atol=1e-4)


def test_rms_norms():
    ops = cpu.ops()
    x, weight = randn(7, 96), randn(96)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))
    residual = randn(7, 96)
    expected_residual = residual + x
    out = ops.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, expected_residual)  # updated in place
    torch.testing.assert_close(out, rms_norm(expected_residual, weight, 1e-6))


@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 32), (6, 6, 16), (8, 1, 64)])
def test_qk_norm_rope_store(hq, hkv, d):
    t, num_blocks, bs = 5, 6, 4
    qkv = randn(t, (hq + 2 * hkv) * d)
    q_w, k_w = randn(d), randn(d)
    cos, sin = randn(t, d), randn(t, d)
    blocks, offsets = torch.tensor([3, 3, 0, 5, 1]), torch.tensor([0, 1, 3, 2, 0])
    caches = torch.zeros(2, hkv, num_blocks, bs, d)
    k_cache, v_cache = caches
    qk = cpu.ops().qk_norm_rope_store(qkv, q_w, k_w, 1e-6, cos, sin, k_cache, v_cache, blocks, offsets, hq)
    heads = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    weight = torch.cat((q_w.expand(hq, d), k_w.expand(hkv, d)))
    expected = apply_rotary(rms_norm(heads, weight, 1e-6), cos[:, None], sin[:, None])
    torch.testing.assert_close(qk, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0][:, blocks, offsets], expected[:, hq:].transpose(0, 1))
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    torch.testing.assert_close(caches[1][:, blocks, offsets], v.transpose(0, 1))
    assert caches[0][:, 2].abs().sum() == 0  # untouched blocks stay as they were


@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 32), (4, 4, 24), (16, 4, 32)])
@pytest.mark.parametrize("lens", [[1], [16, 3, 40], [8, 9, 17, 33, 64]])
def test_paged_decode_attention(hq, hkv, d, lens):
    bs, num_blocks = 16, 32
    k_cache, v_cache = randn(hkv, num_blocks, bs, d), randn(hkv, num_blocks, bs, d)
    width = max(-(-n // bs) for n in lens) + 1  # one more column than any needs: padding is ignored
    tables = torch.randperm(num_blocks, generator=GEN)[: len(lens) * width].view(len(lens), width)
    context = torch.tensor(lens)
    q = randn(len(lens), hq, d)
    out = cpu.ops().paged_decode_attention(q, k_cache, v_cache, tables, context, 0.3)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, context, 0.3)
    torch.testing.assert_close(out.view_as(expected), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("tokens", "first"), [(1, 0), (3, 0), (40, 0), (9, 2)])
def test_moe_experts(tokens, first):
    experts, top_k, hidden, inter = 4, 2, 48, 32
    x = randn(tokens, hidden)
    ids = torch.stack([torch.randperm(6, generator=GEN)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=GEN)
    w13, w2 = randn(experts, hidden, 2 * inter), randn(experts, inter, hidden)
    out = experts_forward(x, ids, weights, pack(w13), pack(w2), first)
    expected = experts_forward(x, ids, weights, w13, w2, first)  # ids outside first..first+3 skipped
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
