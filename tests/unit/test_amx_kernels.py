"""The AMX path of the C++ CPU kernels (kernels/cpu/brgemm.h): oneDNN's brgemm microkernel over the packed
weights, for the bf16 and int8 GEMMs (dense projections, LM head, MoE experts) and the bf16 prefill
attention's QK^T and PV.

Most tests force the path on (`set_brgemm_min_rows`) wherever `cpublas::brgemm` runs with VNNI-packed
weights (`brgemm_runs`): on an AMX host that is the AMX microkernel itself; on an AVX-512 host with BF16 and
VNNI, oneDNN's AVX-512 microkernel, through the same calls, so the blocking, row padding, column tails,
leading dimensions, accumulation (add_C) and threads are checked there too. The `amx_host` tests need
the real thing: the choice at load, oneDNN's own packing. bf16 within float32 rounding of the AVX-512
loop (attention: within bf16 rounding of SDPA), int8 bit for bit with the torch reference.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from kvferry.kernels import cpu
from kvferry.model import quant
from kvferry.model.layers import linear, pack, quantize
from kvferry.model.moe import experts_forward

pytestmark = [
    pytest.mark.skipif(not cpu.load(), reason="the CPU kernels do not build or run here"),
    pytest.mark.usefixtures("all_torch_threads"),
]

BRGEMM_RUNS = cpu.load() and cpu.ops().brgemm_runs()
brgemm = pytest.mark.skipif(not BRGEMM_RUNS, reason="oneDNN's brgemm microkernel does not run here")
brgemm_bf16 = pytest.mark.skipif(
    not (BRGEMM_RUNS and cpu.bf16_dot()), reason="no brgemm microkernel or bf16-pair weights here"
)
amx_host = pytest.mark.skipif(
    not (cpu.load() and cpu.has_amx() and cpu.ops().amx_could_pack()), reason="this CPU has no AMX"
)

GEN = torch.Generator().manual_seed(0)
ROWS = [1, 2, 9, 16, 17, 33, 64, 70, 129]  # calls of 16, 32, 48, 64 rows; the last one past M


def randn(*shape):
    return torch.randn(*shape, generator=GEN)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@pytest.fixture()
def forced():
    """The brgemm path for every GEMM (from one row) while the test runs; the setting restored after."""
    ops = cpu.ops()
    before = ops.set_brgemm_min_rows(1)
    yield ops
    ops.set_brgemm_min_rows(before)


def with_rows(min_rows: int, fn):
    ops = cpu.ops()
    before = ops.set_brgemm_min_rows(min_rows)
    try:
        return fn()
    finally:
        ops.set_brgemm_min_rows(before)


@brgemm_bf16
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("k", "n"), [(64, 48), (96, 40), (512, 8), (30, 17), (64, 100), (136, 16)])
def test_bf16_linear(m, k, n):
    x, w = randn(m, k), randn(k, n)
    packed = pack(w, bf16_dot=True)
    tiles = with_rows(1, lambda: linear(x, packed))
    loops = with_rows(0, lambda: linear(x, packed))
    torch.testing.assert_close(tiles, bf16(x) @ bf16(w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(tiles, loops, rtol=1e-5, atol=1e-4)


@brgemm
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("k", "n"), [(64, 48), (96, 40), (512, 8), (256, 100), (36, 20), (100, 70)])
def test_int8_linear_is_the_reference_bit_for_bit(m, k, n):
    x, w = randn(m, k), randn(k, n)
    packed = pack(w, int8=True)
    tiles = with_rows(1, lambda: linear(x, packed))
    assert torch.equal(tiles, quant.w8a8_linear(x, *quant.quantize_weight(w), cpu.int8_act_qmax()))
    assert torch.equal(tiles, with_rows(0, lambda: linear(x, packed)))


@brgemm
def test_int8_nan_row_stays_nan(forced):
    x, w = randn(40, 100), randn(100, 24)
    x[1, 97] = float("nan")
    out = linear(x, pack(w, int8=True))
    assert out[1].isnan().all() and not out[[0, *range(2, 40)]].isnan().any()


@brgemm_bf16
def test_min_rows_picks_the_path_per_gemm():
    """Below the threshold the AVX-512 loop serves (its bits), from it the microkernel (the forced bits)."""
    w = randn(64, 48)
    packed, packed8 = pack(w, bf16_dot=True), pack(w, int8=True)
    for m in (8, 9):
        x = randn(m, 64)
        at_9 = with_rows(9, lambda x=x: linear(x, packed))
        path = 0 if m < 9 else 1
        assert torch.equal(at_9, with_rows(path, lambda x=x: linear(x, packed)))
        assert torch.equal(with_rows(9, lambda x=x: linear(x, packed8)), linear(x, packed8))


@brgemm_bf16
def test_threads_split_columns_without_changing_a_bit(forced):
    x, w = randn(70, 96), randn(96, 200)
    packed, packed8 = pack(w, bf16_dot=True), pack(w, int8=True)
    many = linear(x, packed), linear(x, packed8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = linear(x, packed), linear(x, packed8)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(many, one, strict=True))


def moe_inputs(tokens: int, experts: int = 4, hidden: int = 64, inter: int = 48, id_range: int = 6):
    x = randn(tokens, hidden)
    ids = torch.stack([torch.randperm(id_range, generator=GEN)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=GEN)
    return x, ids, weights, randn(experts, hidden, 2 * inter) * 0.2, randn(experts, inter, hidden) * 0.2


@brgemm_bf16
@pytest.mark.parametrize(("tokens", "first"), [(1, 0), (13, 0), (70, 2), (150, 0)])
def test_bf16_moe_experts(tokens, first, forced):
    x, ids, weights, w13, w2 = moe_inputs(tokens)
    out = experts_forward(x, ids, weights, pack(w13, bf16_dot=True), pack(w2, bf16_dot=True), first)
    expected = torch.zeros_like(x)  # each GEMM's inputs rounded to bf16 as the kernel rounds them
    for t in range(tokens):
        for j in range(2):
            e = int(ids[t, j]) - first
            if 0 <= e < len(w13):
                gate, up = (bf16(x[t]) @ bf16(w13[e])).chunk(2)
                expected[t] += weights[t, j] * (bf16(F.silu(gate) * up) @ bf16(w2[e]))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3)


@brgemm
@pytest.mark.parametrize(("tokens", "first"), [(1, 0), (13, 0), (70, 2), (150, 0)])
def test_int8_moe_experts_bit_for_bit(tokens, first):
    x, ids, weights, w13, w2 = moe_inputs(tokens)
    p13, p2 = pack(w13, int8=True), pack(w2, int8=True)
    tiles = with_rows(1, lambda: experts_forward(x, ids, weights, p13, p2, first))
    assert torch.equal(tiles, with_rows(0, lambda: experts_forward(x, ids, weights, p13, p2, first)))
    ref = experts_forward(x, ids, weights, quantize(w13), quantize(w2), first)  # the torch W8A8 path
    torch.testing.assert_close(tiles, ref, rtol=1e-5, atol=1e-5)


def sdpa_reference(q, k_cache, v_cache, table, context, scale):
    """torch's SDPA over the sequence's keys, gathered from the paged cache, causal by position."""
    q_len, hq, _ = q.shape
    hkv, d = k_cache.shape[0], k_cache.shape[-1]
    keys = k_cache[:, table].reshape(hkv, -1, d)[:, :context].repeat_interleave(hq // hkv, 0)
    values = v_cache[:, table].reshape(hkv, -1, d)[:, :context].repeat_interleave(hq // hkv, 0)
    positions = torch.arange(context - q_len, context)
    mask = torch.arange(context)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(q_len, hq * d)


@brgemm_bf16
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 32), (16, 4, 32), (32, 4, 128), (24, 2, 64), (3, 1, 16)])
@pytest.mark.parametrize(
    ("q_len", "context"), [(1, 1), (5, 5), (17, 17), (1, 40), (7, 33), (40, 100), (70, 200)]
)
def test_bf16_prefill_attention(hq, hkv, d, q_len, context, forced):
    """bf16 QK^T and PV: within bf16 rounding of SDPA (float32), and close to SDPA on the same bf16-rounded
    q, k, v (what is left: P rounded to bf16); q a strided view, as the model passes it."""
    bs, num_blocks, scale = 16, 16, d**-0.5
    k_cache, v_cache = randn(hkv, num_blocks, bs, d), randn(hkv, num_blocks, bs, d)
    table = torch.randperm(num_blocks, generator=GEN)[: -(-context // bs) + 1]
    q = randn(q_len, hq + hkv, d)[:, :hq]
    out = forced.paged_prefill_attention(q, k_cache, v_cache, table, context, scale, True)
    torch.testing.assert_close(
        out, sdpa_reference(q, k_cache, v_cache, table, context, scale), rtol=0, atol=3e-2
    )
    rounded = sdpa_reference(bf16(q * scale), bf16(k_cache), bf16(v_cache), table, context, 1.0)
    torch.testing.assert_close(out, rounded, rtol=0, atol=1e-2)


@brgemm_bf16
def test_prefill_attention_bf16_flag_only_with_the_path():
    """Without the flag, or with the path off, the float32 kernel serves (its exact bits)."""
    hq, hkv, d, bs, context, q_len = 8, 2, 32, 16, 90, 40
    k_cache, v_cache = randn(hkv, 8, bs, d), randn(hkv, 8, bs, d)
    table, q = torch.randperm(8, generator=GEN)[:6], randn(q_len, hq, d)
    ops = cpu.ops()
    f32 = with_rows(0, lambda: ops.paged_prefill_attention(q, k_cache, v_cache, table, context, 0.2))
    assert torch.equal(
        f32, with_rows(0, lambda: ops.paged_prefill_attention(q, k_cache, v_cache, table, context, 0.2, True))
    )
    assert torch.equal(
        f32, with_rows(1, lambda: ops.paged_prefill_attention(q, k_cache, v_cache, table, context, 0.2))
    )
    tiles = with_rows(1, lambda: ops.paged_prefill_attention(q, k_cache, v_cache, table, context, 0.2, True))
    assert not torch.equal(f32, tiles)
    torch.testing.assert_close(tiles, f32, rtol=0, atol=3e-2)
    # a chunk of fewer query rows than the threshold keeps the float32 kernel
    few = q[:2]  # 2 tokens x 4 query heads per KV head = 8 rows < 9
    assert torch.equal(
        with_rows(9, lambda: ops.paged_prefill_attention(few, k_cache, v_cache, table, context, 0.2, True)),
        with_rows(0, lambda: ops.paged_prefill_attention(few, k_cache, v_cache, table, context, 0.2)),
    )


@brgemm_bf16
def test_bf16_prefill_attention_int8_cache(forced):
    from kvferry.kernels.int8 import dequantize_kv, quantize_kv

    hkv, hq, d, bs = 2, 8, 32, 16
    kc, vc = quantize_kv(randn(hkv, 6, bs, d)), quantize_kv(randn(hkv, 6, bs, d))
    table, chunk = torch.tensor([3, 1, 5, 0]), randn(30, hq, d)
    got = forced.paged_prefill_attention(chunk, kc, vc, table, 60, 0.17, True)
    ref = forced.paged_prefill_attention(chunk, dequantize_kv(kc), dequantize_kv(vc), table, 60, 0.17, True)
    assert torch.equal(got, ref)


@brgemm_bf16
def test_bf16_model_through_brgemm(tiny_model_dir):
    """The tiny model in bf16 (QKV, O, experts, dense MLP, LM head): a 40-token prefill and a decode step of
    two sequences give about the loops' logits, and decode_layers (one call) the layer-by-layer bits."""
    from kvferry.model.attention import AttentionMetadata, PrefillChunk
    from kvferry.model.loader import load_model

    model = load_model(tiny_model_dir, torch.bfloat16)
    assert model.pack_weights() and model.decode_weights
    cfg, bs = model.cfg, 16
    lens, tables = [21, 40], [[0, 1], [2, 3, 4]]
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=GEN) for n in lens]

    def run(kv):
        logits = []
        for ids, table in zip(prompts, tables, strict=True):
            n = len(ids)
            chunk = PrefillChunk(0, n, n, torch.tensor(table))
            meta = AttentionMetadata.build(
                [table[p // bs] for p in range(n)], [p % bs for p in range(n)], [], [], [chunk], kv.device
            )
            logits.append(model.compute_logits(model(ids, torch.arange(n), kv, meta)))
        return torch.cat(logits)

    kv_loops = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, 8, bs, cfg.head_dim)
    kv_tiles = kv_loops.clone()
    loops = with_rows(0, lambda: run(kv_loops))
    tiles = with_rows(1, lambda: run(kv_tiles))
    assert (tiles - loops).abs().max() <= 0.01 * loops.abs().max()
    assert (tiles.argmax(-1) == loops.argmax(-1)).float().mean() >= 0.9

    meta = AttentionMetadata.build(
        [tables[0][21 // bs], tables[1][40 // bs]], [21 % bs, 40 % bs], tables, [n + 1 for n in lens], [],
        kv_tiles.device,
    )  # fmt: skip
    step_ids, positions, kv_fused = torch.tensor([5, 77]), torch.tensor(lens), kv_tiles.clone()
    fused = with_rows(1, lambda: model(step_ids, positions, kv_fused, meta))
    weights, model.decode_weights = model.decode_weights, []
    layered = with_rows(1, lambda: model(step_ids, positions, kv_tiles, meta))
    model.decode_weights = weights
    assert torch.equal(fused, layered) and torch.equal(kv_fused, kv_tiles)


@brgemm_bf16
def test_self_check_passes_and_restores_the_setting():
    ops = cpu.ops()
    before = ops.brgemm_min_rows()
    assert cpu.amx_self_check(layout=False) is None
    assert ops.brgemm_min_rows() == before


def fake_ops(could_pack: bool):
    """The kernels' ops, with oneDNN's answer to "can you pack for AMX here" replaced."""
    set_rows = cpu.ops().set_brgemm_min_rows
    return lambda: types.SimpleNamespace(set_brgemm_min_rows=set_rows, amx_could_pack=lambda: could_pack)


def test_select_amx(monkeypatch, caplog):
    """AMX only with the flags, oneDNN's packing and a passing self-check; a failing or raising check is
    logged and leaves the loops serving."""
    ops = cpu.ops()
    before = ops.brgemm_min_rows()
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    try:
        monkeypatch.setattr(cpu, "has_amx", lambda: False)
        assert not cpu.select_amx()
        monkeypatch.setattr(cpu, "has_amx", lambda: True)
        monkeypatch.setattr(cpu, "ops", fake_ops(could_pack=False))
        assert not cpu.select_amx() and ops.brgemm_min_rows() == 0
        monkeypatch.setattr(cpu, "ops", fake_ops(could_pack=True))
        monkeypatch.setattr(cpu, "amx_self_check", lambda **_: "int8 9x64x16: not bit for bit the VNNI loop")
        with caplog.at_level(logging.WARNING, logger=cpu.__name__):
            assert not cpu.select_amx() and ops.brgemm_min_rows() == 0
        assert "AMX self-check failed (int8 9x64x16" in caplog.text

        def raises(**_):
            raise RuntimeError("I8 Brgemm is only supported on X64 when oneDNN ukernel is enabled")

        monkeypatch.setattr(cpu, "amx_self_check", raises)
        assert not cpu.select_amx() and ops.brgemm_min_rows() == 0
        assert "RuntimeError: I8 Brgemm" in caplog.text
        checked = []
        monkeypatch.setattr(cpu, "amx_self_check", lambda layout=True: checked.append(layout))
        assert cpu.select_amx() and ops.brgemm_min_rows() == cpu.AMX_MIN_ROWS
        # the stand-in (KVFERRY_CPU_ISA=brgemm): the path without AMX, where oneDNN cannot pack for it
        monkeypatch.setattr(cpu, "has_amx", lambda: False)
        monkeypatch.setattr(cpu, "ops", fake_ops(could_pack=False))
        monkeypatch.setenv(cpu.ISA_ENV, "brgemm")
        ops.set_brgemm_min_rows(0)
        if cpu.has_avx512_bf16() and cpu.has_avx512_vnni():
            assert cpu.select_amx() and ops.brgemm_min_rows() == cpu.AMX_MIN_ROWS
            assert checked == [True, False]  # no layout check against a packing oneDNN does not do here
        monkeypatch.delenv(cpu.ISA_ENV)
        monkeypatch.setattr(cpu, "select_amx", raises)  # whatever goes wrong at load: no AMX, no error
        assert not cpu._select_amx_or_not()
    finally:
        ops.set_brgemm_min_rows(before)


SAPPHIRE_RAPIDS = frozenset(
    [
        "fma",
        "avx2",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_bf16",
        "avx512_vnni",
        "avx_vnni",
        "amx_bf16",
        "amx_int8",
        "amx_tile",
    ]
)


def test_isa_env(monkeypatch):
    monkeypatch.setattr(cpu, "_cpuinfo_flags", lambda: SAPPHIRE_RAPIDS)
    for value in ("", "native", "NATIVE"):
        monkeypatch.setenv(cpu.ISA_ENV, value)
        assert cpu.cpu_flags() == SAPPHIRE_RAPIDS and cpu.has_amx()
    monkeypatch.setenv(cpu.ISA_ENV, "avx512")  # AMX hidden, AVX-512 kept
    assert cpu.cpu_flags() == SAPPHIRE_RAPIDS - cpu.AMX_FLAGS
    assert not cpu.has_amx() and cpu.has_avx512_bf16() and cpu.has_avx512_vnni()
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    assert cpu.cpu_flags() == {"fma", "avx2"} and not cpu.has_amx() and not cpu.has_avx512_bf16()
    monkeypatch.setenv(cpu.ISA_ENV, "amx")
    with pytest.raises(ValueError, match="native, avx512, avx2"):
        cpu.cpu_flags()


def test_isa_names_amx_where_it_serves():
    """amx_bf16 + amx_int8 where AMX serves; `brgemm` where the stand-in runs the path without AMX."""
    tiles = cpu.amx() and cpu.has_amx()
    assert ("amx_bf16" in cpu.isa()) == ("amx_int8" in cpu.isa()) == tiles
    assert ("brgemm" in cpu.isa()) == (cpu.amx() and not tiles)
    assert cpu.amx() == (cpu.ops().brgemm_min_rows() == cpu.AMX_MIN_ROWS)


# ---- on AMX hosts only ----


@amx_host
def test_amx_serves_after_load():
    assert cpu.amx() and cpu.ops().brgemm_min_rows() == cpu.AMX_MIN_ROWS
    assert "amx_bf16" in cpu.isa() and "amx_int8" in cpu.isa()


@amx_host
def test_packed_layouts_are_onednns_vnni_layouts():
    """kvferry's bf16-pair and int8 blocks are byte for byte what cpublas::pack makes for the AMX kernel."""
    assert cpu.ops().brgemm_layout_check() == [1, 1]
    assert cpu.amx_self_check(layout=True) is None
    assert cpu.amx()  # the check left the path on


@amx_host
@pytest.mark.parametrize("m", [9, 40, 100])
def test_amx_default_threshold(m):
    """As loaded (AMX from AMX_MIN_ROWS rows): bf16 within float32 rounding, int8 the torch reference."""
    x, w = randn(m, 256), randn(256, 72)
    torch.testing.assert_close(linear(x, pack(w, bf16_dot=True)), bf16(x) @ bf16(w), rtol=1e-5, atol=1e-4)
    ref = quant.w8a8_linear(x, *quant.quantize_weight(w), cpu.int8_act_qmax())
    assert torch.equal(linear(x, pack(w, int8=True)), ref)


@amx_host
def test_isa_avx512_hides_amx_in_a_fresh_process():
    code = "from kvferry.kernels import cpu; assert cpu.load() and not cpu.amx(), cpu.isa(); print(cpu.isa())"
    env = {**os.environ, cpu.ISA_ENV: "avx512"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "amx" not in done.stdout and "avx512_bf16" in done.stdout


@brgemm_bf16
@pytest.mark.parametrize("m", [2, 9, 17, 70, 130])
def test_a_row_is_the_same_whatever_the_rows_beside_it(forced, m):
    """The microkernel path keeps the AVX-512 loops' promise (AMX_MIN_ROWS = 1, so one path serves every
    GEMM): a prefill chunk's row equals that row alone (a decode step), bit for bit, bf16 and int8."""
    x, w = randn(m, 136), randn(136, 40)
    for packed in (pack(w, bf16_dot=True), pack(w, int8=True)):
        out = linear(x, packed)
        for row in (0, m - 1):
            assert torch.equal(out[row : row + 1], linear(x[row : row + 1], packed))
