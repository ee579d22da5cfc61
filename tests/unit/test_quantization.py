"""int8 weights (`--quantization int8`, W8A8): quantizers, the C++ int8 GEMM against the torch reference
(bit for bit), experts, the AVX2 build, and the flag's validation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvferry.engine.engine import EngineConfig, EngineConfigError
from kvferry.kernels import cpu
from kvferry.model import quant
from kvferry.model.layers import linear, pack, quantize
from kvferry.model.moe import experts_forward

# the int8 kernels with torch's own thread count (the other unit tests run on one: tests/unit/conftest.py)
pytestmark = pytest.mark.usefixtures("all_torch_threads")

GEN = torch.Generator().manual_seed(0)
needs_kernels = pytest.mark.skipif(not cpu.load(), reason="the CPU kernels do not build or run here")


def randn(*shape):
    return torch.randn(*shape, generator=GEN)


def test_quantize_weight_per_channel():
    w = randn(64, 10)
    w[:, 3] = 0  # an all-zero channel: scale 0, q 0, no division by zero
    q, scale = quant.quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (10,)
    assert q.abs().max() == 127 and int(q[:, 3].abs().max()) == 0 and scale[3] == 0
    assert (q.abs().amax(0)[[0, 1, 2, 4]] == 127).all()  # each channel's largest weight maps to +-127
    err = (q.float() * scale - w).abs()
    assert (err <= scale / 2 + 1e-7).all()  # round to nearest


def test_quantize_rows_and_reference():
    x = randn(5, 32)
    x[2] = 0
    q, s = quant.quantize_rows(x)
    assert s[2] == 0 and int(q[2].abs().max()) == 0 and int(q.abs().max()) == 127
    w = randn(32, 24)
    out = quant.w8a8_linear(x, *quant.quantize_weight(w))
    assert (out[2] == 0).all()
    rel = (out - x @ w).norm() / (x @ w).norm()
    assert rel < 0.03  # 8-bit both sides: about 1% error
    q7, s7 = quant.quantize_rows(x, 63)  # the AVX2 kernels' 7-bit activations
    assert int(q7.abs().max()) == 63 and torch.allclose(s7 * 63, s * 127)
    rel7 = (quant.w8a8_linear(x, *quant.quantize_weight(w), 63) - x @ w).norm() / (x @ w).norm()
    assert rel < rel7 < 0.04


@needs_kernels
@pytest.mark.parametrize("m", [0, 1, 2, 5, 8, 9, 13, 40])
@pytest.mark.parametrize(("k", "n"), [(64, 48), (96, 40), (512, 8), (256, 100), (36, 20), (100, 70)])
def test_int8_packed_linear_is_the_reference_bit_for_bit(m, k, n):
    x, w = randn(m, k), randn(k, n)
    packed = pack(w, int8=True)
    assert packed.dtype == torch.int8 and packed.shape == (-(-n // 16), k // 4 + 2, 64)
    ref = quant.w8a8_linear(x, *quant.quantize_weight(w), cpu.int8_act_qmax())
    assert torch.equal(linear(x, packed), ref)


@needs_kernels
def test_int8_act_range_is_the_kernels_and_a_nan_row_stays_nan():
    # the range the torch path and the fingerprint take (from the flags) is the loaded build's
    assert cpu.int8_act_qmax() == cpu.ops().int8_act_qmax() == (127 if cpu.int8_dot() else 63)
    x, w = randn(3, 100), randn(100, 24)
    x[1, 97] = float("nan")  # in the scalar tail of the row's quantization
    out = linear(x, pack(w, int8=True))
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


def test_fingerprint_records_a_7bit_activation_range(make_engine, monkeypatch):
    """int8 KV made with 7-bit activations (an AVX2-only CPU) never matches 8-bit activations' KV."""
    from kvferry.engine import engine as engine_mod

    def fingerprint(qmax):
        monkeypatch.setattr(engine_mod, "act_qmax", lambda device: qmax)
        # the dtype `auto` picks, as a cluster's would
        return make_engine(dtype=None, kernels="torch", quantization="int8").fingerprint

    assert fingerprint(63) != fingerprint(127)


@needs_kernels
def test_int8_needs_k_multiple_of_4():
    w = randn(30, 16)
    assert pack(w, int8=True).dtype != torch.int8  # K = 30: kept in the dtype's packing


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_int8_experts_match_the_torch_path(tokens):
    x = randn(tokens, 64)
    w13, w2 = randn(4, 64, 96) * 0.1, randn(4, 48, 64) * 0.1
    ids = torch.stack([torch.randperm(4, generator=GEN)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=GEN)
    kernel = experts_forward(x, ids, weights, pack(w13, int8=True), pack(w2, int8=True), 1)
    ref = experts_forward(x, ids, weights, quantize(w13), quantize(w2), 1)  # experts 1..4: ids 0 skipped
    torch.testing.assert_close(kernel, ref, rtol=1e-5, atol=1e-5)
    exact = experts_forward(x, ids, weights, w13, w2, 1)
    assert (kernel - exact).norm() / exact.norm() < 0.05


AVX2_CHECK = """
import torch
from kvferry.kernels import cpu
from kvferry.model import quant
from kvferry.model.layers import linear, pack
assert cpu.load() and not cpu.int8_dot() and not cpu.bf16_dot(), cpu.isa()
assert cpu.int8_act_qmax() == 63  # 7-bit activations: vpmaddubsw's pair sums stay within int16
g = torch.Generator().manual_seed(1)
shapes = [(1, 64, 48), (7, 96, 40), (40, 512, 100), (9, 36, 20), (13, 100, 70)]
cases = [(torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)) for m, k, n in shapes]
# the largest pair sums: every activation at +-63 (stored 127 or 1) against weights at +-127
ones = torch.ones(5, 64)
ones[1] = -1
ones[2, ::2] = -1
cases.append((ones, torch.cat([torch.ones(64, 8), -torch.ones(64, 8), torch.randn(64, 8, generator=g)], 1)))
for x, w in cases:
    ref = quant.w8a8_linear(x, *quant.quantize_weight(w), 63)
    assert torch.equal(linear(x, pack(w, int8=True)), ref), tuple(x.shape) + tuple(w.shape)
x = torch.randn(2, 100, generator=g)
x[0, 3] = float("nan")
out = linear(x, pack(torch.randn(100, 24, generator=g), int8=True))
assert out[0].isnan().all() and not out[1].isnan().any()
print("avx2 int8 ok")
"""


@pytest.mark.slow  # builds the AVX2-only variant of the kernels (~20 s, once per cache)
@needs_kernels
def test_int8_avx2_loop_is_the_reference_bit_for_bit():
    """The AVX2 int8 loop (vpmaddubsw, for CPUs without AVX512-VNNI), built here by seeing the CPU as AVX2."""
    env = {**os.environ, cpu.ISA_ENV: "avx2"}
    done = subprocess.run(
        [sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "avx2 int8 ok" in done.stdout


def test_isa_env_hides_avx512(monkeypatch):
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    assert not any(f.startswith(("avx512", "amx")) for f in cpu.cpu_flags())
    monkeypatch.setenv(cpu.ISA_ENV, "sse")
    with pytest.raises(ValueError, match="KVFERRY_CPU_ISA"):
        cpu.cpu_flags()


def test_quantization_flag_is_checked():
    EngineConfig(quantization="int8").validate()
    EngineConfig(quantization=None).validate()
    with pytest.raises(EngineConfigError, match="--quantization 'fp4' is not supported"):
        EngineConfig(quantization="fp4").validate()


def test_kv_rows_round_trip():
    from kvferry.kernels.int8 import dequantize_kv, kv_row_width, quantize_kv

    x = randn(3, 4, 32)
    x[1, 2] = 0
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (3, 4, kv_row_width(32, torch.int8)) == (3, 4, 36)
    back = dequantize_kv(rows)
    assert (back[1, 2] == 0).all()
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= scale / 2 + 1e-6).all()  # half a step per row at most


@needs_kernels
def test_int8_kv_cache_kernels_match_the_torch_path():
    """An int8 KV cache: the C++ store writes exactly `quantize_kv`'s rows, and the decode and prefill
    attention kernels read them as the torch reference does (dequantized)."""
    from kvferry.kernels.int8 import dequantize_kv, quantize_kv
    from kvferry.kernels.paged_attention import paged_decode_attention_reference

    ops = cpu.ops()
    hkv, nb, bs, d, hq = 2, 10, 16, 32, 8
    kc = torch.zeros(hkv, nb, bs, d + 4, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    kf, vf = torch.zeros(hkv, nb, bs, d), torch.zeros(hkv, nb, bs, d)
    tokens = 60
    qkv = randn(tokens, (hq + 2 * hkv) * d)
    cos, sin = randn(tokens, d), randn(tokens, d)
    blocks = torch.tensor([b for b in (3, 1, 7, 9) for _ in range(16)][:tokens])
    offsets = torch.arange(tokens) % 16
    qw, kw = torch.rand(d, generator=GEN), torch.rand(d, generator=GEN)
    q8 = ops.qk_norm_rope_store(qkv, qw, kw, 1e-6, cos, sin, kc, vc, blocks, offsets, hq)
    qf = ops.qk_norm_rope_store(qkv, qw, kw, 1e-6, cos, sin, kf, vf, blocks, offsets, hq)
    assert torch.equal(q8, qf)
    assert torch.equal(kc, quantize_kv(kf)) and torch.equal(vc, quantize_kv(vf))
    q = randn(3, hq, d)
    tables, lens = torch.tensor([[3, 1, 7, 9], [3, 1, 0, 0], [3, 1, 7, 0]]), torch.tensor([60, 20, 33])
    got = ops.paged_decode_attention(q, kc, vc, tables, lens, 0.17)
    ref = paged_decode_attention_reference(q, kc, vc, tables, lens, 0.17).reshape(3, -1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    chunk = randn(12, hq, d)
    table = torch.tensor([3, 1, 7, 9])
    got = ops.paged_prefill_attention(chunk, kc, vc, table, 60, 0.17)
    ref = ops.paged_prefill_attention(chunk, dequantize_kv(kc), dequantize_kv(vc), table, 60, 0.17)
    assert torch.equal(got, ref)


def test_kv_cache_dtype_flag_is_checked():
    EngineConfig(kv_cache_dtype="int8").validate()
    with pytest.raises(EngineConfigError, match="fp8 KV caches are not implemented"):
        EngineConfig(kv_cache_dtype="fp8_e4m3").validate()
