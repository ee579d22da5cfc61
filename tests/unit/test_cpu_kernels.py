"""The C++ CPU kernels against their torch references (float32; odd sizes, padding, GQA)."""

from __future__ import annotations

import pytest
import torch

from kvferry.kernels import cpu
from kvferry.kernels.paged_attention import paged_decode_attention_reference
from kvferry.model.layers import apply_rotary, linear, pack, rms_norm
from kvferry.model.moe import experts_forward

pytestmark = [
    pytest.mark.skipif(not cpu.load(), reason="the CPU kernels do not build or run here"),
    # the kernels with torch's own thread count (the other unit tests run on one: tests/unit/conftest.py)
    pytest.mark.usefixtures("all_torch_threads"),
]

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


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("n", [200, 190])
def test_decode_rows_take_several_blocks_at_once(m, bf16, n):
    """Decode's one or two rows run four (two) column blocks a tile. 13 blocks, the last one partial, leave
    single blocks after the wide tiles; 12 (n=190) put the partial block inside a wide tile. Every column is
    still x @ w."""
    x, w = randn(m, 96), randn(96, n)
    if bf16:
        w = w.bfloat16().float()
    packed = pack(w)
    assert packed.shape[0] == -(-n // 16) and packed.dtype == (torch.bfloat16 if bf16 else torch.float32)
    torch.testing.assert_close(linear(x, packed), x @ w, rtol=1e-5, atol=1e-4)


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
@pytest.mark.parametrize("norms", [True, False])  # Qwen3's q/k norms, or none (Llama: empty weights)
def test_qk_norm_rope_store(hq, hkv, d, norms):
    t, num_blocks, bs = 5, 6, 4
    qkv = randn(t, (hq + 2 * hkv) * d)
    q_w, k_w = (randn(d), randn(d)) if norms else (torch.empty(0), torch.empty(0))
    cos, sin = randn(t, d), randn(t, d)
    blocks, offsets = torch.tensor([3, 3, 0, 5, 1]), torch.tensor([0, 1, 3, 2, 0])
    caches = torch.zeros(2, hkv, num_blocks, bs, d)
    k_cache, v_cache = caches
    qk = cpu.ops().qk_norm_rope_store(qkv, q_w, k_w, 1e-6, cos, sin, k_cache, v_cache, blocks, offsets, hq)
    heads = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    if norms:
        heads = rms_norm(heads, torch.cat((q_w.expand(hq, d), k_w.expand(hkv, d))), 1e-6)
    expected = apply_rotary(heads, cos[:, None], sin[:, None])
    torch.testing.assert_close(qk, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0][:, blocks, offsets], expected[:, hq:].transpose(0, 1))
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    torch.testing.assert_close(caches[1][:, blocks, offsets], v.transpose(0, 1))
    assert caches[0][:, 2].abs().sum() == 0  # untouched blocks stay as they were


# d=24: the AVX2 kernel everywhere; d a multiple of 16 (up to 128): the AVX-512 kernel where the CPU has it;
# (32, 4, 128) is Qwen3-30B-A3B's shape; 12 and 16 query heads per KV head run in several passes
@pytest.mark.parametrize(
    ("hq", "hkv", "d"),
    [(4, 2, 32), (4, 4, 24), (16, 4, 32), (32, 4, 128), (24, 2, 64), (16, 1, 32), (3, 1, 16)],
)
@pytest.mark.parametrize("lens", [[1], [16, 3, 40], [8, 9, 17, 33, 64]])
@pytest.mark.parametrize("bs", [16, 8])
def test_paged_decode_attention(hq, hkv, d, lens, bs):
    num_blocks = 80
    k_cache, v_cache = randn(hkv, num_blocks, bs, d), randn(hkv, num_blocks, bs, d)
    width = max(-(-n // bs) for n in lens) + 1  # one more column than any needs: padding is ignored
    tables = torch.randperm(num_blocks, generator=GEN)[: len(lens) * width].view(len(lens), width)
    context = torch.tensor(lens)
    q = randn(len(lens), hq, d)
    out = cpu.ops().paged_decode_attention(q, k_cache, v_cache, tables, context, 0.3)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, context, 0.3)
    torch.testing.assert_close(out.view_as(expected), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 32), (16, 4, 32), (32, 4, 128), (24, 2, 64), (3, 1, 16)])
@pytest.mark.parametrize(
    ("q_len", "context"), [(1, 1), (5, 5), (17, 17), (1, 40), (7, 33), (40, 100), (16, 64)]
)
@pytest.mark.parametrize("bs", [16, 8])
def test_paged_prefill_attention(hq, hkv, d, q_len, context, bs):
    """A chunk of q_len tokens after context - q_len cached ones, causal: every query token equals a decode
    over the keys up to its own position. q is a strided view, as the model passes it (q beside k)."""
    num_blocks = 40
    k_cache, v_cache = randn(hkv, num_blocks, bs, d), randn(hkv, num_blocks, bs, d)
    table = torch.randperm(num_blocks, generator=GEN)[: -(-context // bs) + 1]  # one spare column
    q = randn(q_len, hq + hkv, d)[:, :hq]
    out = cpu.ops().paged_prefill_attention(q, k_cache, v_cache, table, context, 0.3)
    lens = torch.arange(context - q_len + 1, context + 1)
    tables = table.expand(q_len, -1).contiguous()
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.3)
    torch.testing.assert_close(out.view_as(expected), expected, rtol=1e-5, atol=1e-5)


def moe_inputs(tokens: int, experts: int = 4, hidden: int = 48, inter: int = 32, id_range: int = 6):
    """x [T, H], top-2 ids drawn from 0..id_range-1 (beyond `experts`: someone else's), router weights,
    and unpacked w13 [E, H, 2I] / w2 [E, I, H]."""
    x = randn(tokens, hidden)
    ids = torch.stack([torch.randperm(id_range, generator=GEN)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=GEN)
    return x, ids, weights, randn(experts, hidden, 2 * inter), randn(experts, inter, hidden)


@pytest.mark.parametrize(("tokens", "first"), [(1, 0), (3, 0), (40, 0), (9, 2)])
def test_moe_experts(tokens, first):
    x, ids, weights, w13, w2 = moe_inputs(tokens)
    out = experts_forward(x, ids, weights, pack(w13), pack(w2), first)
    expected = experts_forward(x, ids, weights, w13, w2, first)  # ids outside first..first+3 skipped
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


bf16_dot = pytest.mark.skipif(
    not cpu.bf16_dot(), reason="the kernels have no bf16 dot product here (AVX512-BF16)"
)


def bf16(t: torch.Tensor) -> torch.Tensor:
    """Rounded to bfloat16 (nearest even), as float32."""
    return t.bfloat16().float()


@bf16_dot
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 8, 9, 40])
# n=100: 7 column blocks, so up to 8 rows run wide tiles (4 or 2 blocks) and then single blocks
@pytest.mark.parametrize(("k", "n"), [(64, 48), (96, 40), (512, 8), (30, 17), (64, 100)])
def test_bf16_dot_linear(m, k, n):
    """Weights and activations rounded to bf16, products summed in float32; rows are independent."""
    x, w = randn(m, k), randn(k, n)
    packed = pack(w, bf16_dot=True)
    assert packed.dtype == torch.bfloat16 and packed.shape == (-(-n // 16), k // 2, 32)
    out = linear(x, packed)
    torch.testing.assert_close(out, bf16(x) @ bf16(w), rtol=1e-5, atol=1e-4)
    if m > 1:  # a row's result does not depend on the rows beside it (prefill chunks == decode rows)
        assert torch.equal(out[-1:], linear(x[-1:], packed))


@bf16_dot
def test_bf16_dot_odd_k_keeps_the_float_layout():
    x, w = randn(4, 33), randn(33, 20)
    packed = pack(w, bf16_dot=True)
    assert packed.shape == (2, 33, 16)  # k pairs need an even K: the widened-bf16 / float32 layout serves
    torch.testing.assert_close(linear(x, packed), x @ w, rtol=1e-5, atol=1e-4)


@bf16_dot
@pytest.mark.parametrize(("tokens", "first"), [(1, 0), (13, 0), (9, 2)])
def test_bf16_dot_moe_experts(tokens, first):
    x, ids, weights, w13, w2 = moe_inputs(tokens)
    out = experts_forward(x, ids, weights, pack(w13, bf16_dot=True), pack(w2, bf16_dot=True), first)
    # the reference rounds each GEMM's inputs as the kernel does
    expected = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(2):
            e = int(ids[t, j]) - first
            if 0 <= e < len(w13):
                gate, up = (bf16(x[t]) @ bf16(w13[e])).chunk(2)
                h = torch.nn.functional.silu(gate) * up
                expected[t] += weights[t, j] * (bf16(h) @ bf16(w2[e]))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3)


@bf16_dot
def test_bf16_engine_runs_the_kernels_in_bf16(tiny_model_dir, make_engine):
    """--dtype bfloat16 on an AVX512-BF16 CPU: the kernels serve with bf16 matmuls and a float32 KV cache,
    under a fingerprint of its own, and its logits stay close to float32 arithmetic on the bf16 weights."""
    from kvferry.model.attention import AttentionMetadata, PrefillChunk
    from kvferry.model.loader import load_model

    engine, fp32 = make_engine(dtype="bfloat16"), make_engine(dtype="float32")
    assert engine.cpu_kernels and engine.dtype == torch.bfloat16 and engine.kv_dtype == torch.float32
    assert engine.runner.kv_cache.dtype == torch.float32
    assert engine.fingerprint != fp32.fingerprint
    reference = load_model(tiny_model_dir, torch.bfloat16).float()  # float32 arithmetic, bf16 weights
    ids = torch.randint(3, 8000, (40,), generator=GEN)
    blocks = torch.arange(3)
    logits = []
    for model in (engine.model, reference):
        cfg = model.cfg
        kv = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, 3, 16, cfg.head_dim)
        meta = AttentionMetadata.build(
            [p // 16 for p in range(40)],
            [p % 16 for p in range(40)],
            [],
            [],
            [PrefillChunk(0, 40, 40, blocks)],
            kv.device,
        )
        logits.append(model.compute_logits(model(ids, torch.arange(40), kv, meta)))
    ours, theirs = logits
    assert (ours - theirs).abs().max() <= 0.01 * theirs.abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "checkpoint",
    ["tiny_model_dir", "second_model_dir", "tiny_llama_dir", "tiny_deepseek_dir", "tiny_deepseek_nolora_dir"],
)
def test_decode_layers_equals_the_layer_by_layer_forward(request, checkpoint, dtype):
    """A decode-only step in one decode_layers call gives bit for bit what the Python forward gives
    (MoE with and without renormalisation, a dense layer, Llama's attention without q/k norms, two
    sequences of different lengths; DeepSeek-V3's latent attention with and without a q LoRA, grouped
    routing and shared experts in latent_decode_layers)."""
    from kvferry.model.attention import AttentionMetadata, PrefillChunk
    from kvferry.model.loader import load_model

    if dtype == torch.bfloat16 and not cpu.bf16_dot():
        pytest.skip("no bf16 dot product here (AVX512-BF16)")
    model = load_model(request.getfixturevalue(checkpoint), dtype)
    assert model.pack_weights() and model.decode_weights
    cfg, bs = model.cfg, 16
    kv = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, 8, bs, cfg.kv_cache_dim)
    lens, tables = [21, 40], [[0, 1], [2, 3, 4]]
    for n, table in zip(lens, tables, strict=True):  # prefill both prompts into the cache
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=GEN)
        chunk = PrefillChunk(0, n, n, torch.tensor(table))
        meta = AttentionMetadata.build(
            [table[p // bs] for p in range(n)], [p % bs for p in range(n)], [], [], [chunk], kv.device
        )
        model(ids, torch.arange(n), kv, meta)
    step_ids, positions = torch.tensor([5, 77]), torch.tensor(lens)
    meta = decode_meta(lens, tables, bs)
    kv_fused = kv.clone()
    fused = model(step_ids, positions, kv_fused, meta)
    weights, model.decode_weights = model.decode_weights, []
    layered = model(step_ids, positions, kv, meta)
    model.decode_weights = weights
    assert torch.equal(fused, layered)
    assert torch.equal(kv_fused, kv)  # the same K/V written to the same slots


def decode_meta(lens: list[int], tables: list[list[int]], bs: int):
    """The metadata of a step of decodes: sequence i's next token at position lens[i], blocks tables[i]."""
    from kvferry.model.attention import AttentionMetadata

    slots = [t[n // bs] for n, t in zip(lens, tables, strict=True)]
    return AttentionMetadata.build(slots, [n % bs for n in lens], tables, [n + 1 for n in lens], [], "cpu")


@pytest.mark.parametrize(
    ("checkpoint", "seqs", "threads", "quantization", "kv_dtype", "strided_router", "float32_up"),
    [
        ("tiny_deepseek_dir", 1, 2, None, torch.float32, False, False),
        ("tiny_deepseek_nolora_dir", 3, 3, None, torch.float32, False, False),
        ("tiny_deepseek_dir", 3, 1, None, torch.float32, False, False),
        ("tiny_deepseek_dir", 2, 2, "int8", torch.float32, False, False),
        ("tiny_deepseek_dir", 2, 2, None, torch.int8, False, False),
        ("tiny_deepseek_dir", 2, 2, None, torch.float32, True, False),
        ("tiny_deepseek_dir", 2, 2, None, torch.float32, False, True),
        ("tiny_deepseek_dir", 2, 2, None, torch.int8, False, True),
    ],
)
def test_latent_decode_step_equals_the_layer_by_layer_forward(
    request, checkpoint, seqs, threads, quantization, kv_dtype, strided_router, float32_up
):
    """latent_decode_layers runs a float32-cache step in one parallel region (its members meet at barriers)
    and an int8-cache step, or one whose routers are not contiguous, op by op: each gives bit for bit what
    the Python forward gives, for one sequence or several (groups of heads and rows split unevenly), on 1-3
    threads, with int8 weights, with W_uk / W_uv in bfloat16 (a bf16 checkpoint's) or float32 (`float32_up`:
    kv_b's values are not all bf16 numbers)."""
    from kvferry.kernels.int8 import kv_row_width
    from kvferry.model.attention import AttentionMetadata, PrefillChunk
    from kvferry.model.loader import load_model

    model = load_model(request.getfixturevalue(checkpoint), torch.float32)
    if float32_up:
        for layer in model.layers:
            layer.attn.kv_b.mul_(1 + 2**-12)
    assert model.pack_weights(quantization) and model.decode_weights
    assert model.decode_weights[6].dtype == (torch.float32 if float32_up else torch.bfloat16)  # W_uk
    if strided_router:  # the same values in a transposed layout (slot 10 of each layer's 16: the router)
        strided = [w.t().contiguous().t() if w.dim() == 2 else w for w in model.decode_weights[10::16]]
        model.decode_weights[10::16] = strided
        assert not model.decode_weights[16 + 10].is_contiguous()
    cfg, bs = model.cfg, 16
    shape = (cfg.num_layers, 2, cfg.num_kv_heads, 12, bs, kv_row_width(cfg.kv_cache_dim, kv_dtype))
    kv = torch.zeros(shape, dtype=kv_dtype)
    lens = [21, 40, 7][:seqs]
    tables = [[0, 1], [2, 3, 4], [5]][:seqs]
    for n, table in zip(lens, tables, strict=True):
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=GEN)
        chunk = PrefillChunk(0, n, n, torch.tensor(table))
        meta = AttentionMetadata.build(
            [table[p // bs] for p in range(n)], [p % bs for p in range(n)], [], [], [chunk], kv.device
        )
        model(ids, torch.arange(n), kv, meta)
    step_ids, positions = torch.tensor([5, 77, 300][:seqs]), torch.tensor(lens)
    meta = decode_meta(lens, tables, bs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kv_fused = kv.clone()
        fused = model(step_ids, positions, kv_fused, meta)
        assert model.step_logits[0] is fused  # the LM head ran in the same call
        fused_logits = model.compute_logits(fused)
        assert model.step_logits is None and model.compute_logits(fused) is not fused_logits  # taken once
        weights, model.decode_weights = model.decode_weights, []
        layered = model(step_ids, positions, kv, meta)
        model.decode_weights = weights
    finally:
        torch.set_num_threads(before)
    assert fused.isfinite().all() and fused.abs().max() > 0
    assert torch.equal(fused, layered)
    assert torch.equal(kv_fused, kv)
    assert fused_logits.shape == (seqs, cfg.vocab_size)
    assert torch.equal(fused_logits, model.compute_logits(layered))
    rows = list(range(seqs))[::-1]  # rows out of order (a speculative step's): from the same call's logits
    again = model(step_ids, positions, kv.clone(), meta)
    assert model.step_logits[0] is again
    assert torch.equal(model.compute_logits(again, rows), fused_logits[rows])


def test_latent_decode_layers_refuses_a_token_or_position_outside_its_tables(tiny_deepseek_dir):
    """The one-call step looks up the embeddings and rope rows itself: an id past the vocabulary or a
    position past the rope tables is an error before anything is written, not a read out of bounds."""
    from kvferry.kernels.int8 import kv_row_width
    from kvferry.model.loader import load_model

    model = load_model(tiny_deepseek_dir, torch.float32)
    assert model.pack_weights() and model.decode_weights
    cfg = model.cfg
    kv = torch.zeros((cfg.num_layers, 2, 1, 4, 16, kv_row_width(cfg.kv_cache_dim, torch.float32)))
    meta = decode_meta([3], [[0]], 16)
    with pytest.raises(RuntimeError, match="token id out of range"):
        model(torch.tensor([cfg.vocab_size]), torch.tensor([3]), kv, meta)
    with pytest.raises(RuntimeError, match="position out of range"):
        model(torch.tensor([5]), torch.tensor([model.rotary.cos.shape[0]]), kv, meta)
    assert not kv.any()
    assert model(torch.tensor([5]), torch.tensor([3]), kv, meta).isfinite().all() and kv.any()


def test_the_latent_step_is_checked_once_and_refuses_a_cache_of_other_layers(tiny_deepseek_dir):
    """The model's weights go to the kernels once (a LatentStep, built at the first decode step and reused
    by every later one); a step checks its own inputs: a cache with another number of layers is an error."""
    from kvferry.kernels.int8 import kv_row_width
    from kvferry.model.loader import load_model

    model = load_model(tiny_deepseek_dir, torch.float32)
    assert model.pack_weights() and model.latent_step is None
    cfg = model.cfg
    kv = torch.zeros((cfg.num_layers, 2, 1, 4, 16, kv_row_width(cfg.kv_cache_dim, torch.float32)))
    meta = decode_meta([3], [[0]], 16)
    first = model(torch.tensor([5]), torch.tensor([3]), kv, meta)
    step = model.latent_step
    assert step is not None
    assert torch.equal(model(torch.tensor([5]), torch.tensor([3]), kv, meta), first)
    assert model.latent_step is step
    with pytest.raises(RuntimeError, match="one layer per 16 weights"):
        model(torch.tensor([5]), torch.tensor([3]), kv[1:], meta)
    assert model.latent_step is step


@pytest.mark.parametrize("checkpoint", ["tiny_deepseek_dir", "tiny_deepseek_nolora_dir"])
def test_a_decode_step_from_lists_equals_the_forward_and_steps_aside_for_a_layer_hook(checkpoint, request):
    """decode_lists (the engine's decode-only steps, straight from the scheduler's lists) gives the forward's
    hidden states, logits and cache rows, padded block tables included, with an MTP layer (whose cache rows
    it leaves) or without; with a layer hook (KV streaming) it does not serve, so the forward calls the
    hook."""
    from kvferry.kernels.int8 import kv_row_width
    from kvferry.model.loader import load_model

    model = load_model(request.getfixturevalue(checkpoint), torch.float32)
    assert model.pack_weights()
    cfg, bs = model.cfg, 16
    layers = cfg.num_layers + (model.mtp is not None)
    kv = torch.zeros((layers, 2, 1, 8, bs, kv_row_width(cfg.kv_cache_dim, torch.float32)))
    kv[:, :, :, :5] = torch.randn(kv[:, :, :, :5].shape, generator=GEN)  # earlier rows of both sequences
    lens, tables = [21, 3], [[0, 1], [4]]
    ids, positions = [5, 77], [n - 1 for n in lens]
    slots = ([t[p // bs] for t, p in zip(tables, positions, strict=True)], [p % bs for p in positions])
    kv_lists = kv.clone()
    hidden = model.decode_lists(ids, positions, *slots, tables, lens, kv_lists)
    assert hidden is not None
    logits = model.compute_logits(hidden)
    assert model.step_argmax is not None and model.step_argmax[0] is logits
    assert model.step_argmax[1] == logits.numpy().argmax(-1).tolist()  # each row's greedy token
    forward = model(torch.tensor(ids), torch.tensor(positions), kv, decode_meta(positions, tables, bs))
    assert torch.equal(hidden, forward) and torch.equal(kv_lists, kv)
    assert torch.equal(logits, model.compute_logits(forward))
    seen = []
    model.after_layer = seen.append
    assert model.decode_lists(ids, positions, *slots, tables, lens, kv) is None and not seen
    # the per-step state is a plain attribute (set past nn.Module's lookups): never a child module
    model.after_layer = hook = torch.nn.Identity()
    assert model.after_layer is hook and "after_layer" not in dict(model.named_children())
    assert "after_layer" in vars(model)


def test_a_decode_burst_equals_that_many_steps_and_stays_in_its_blocks(tiny_deepseek_nolora_dir):
    """decode_burst (multi-step decode): each step's tokens and the cache equal decode_lists called once a
    step, each fed the last step's argmax, padded block tables included; a row whose blocks do not hold
    every step's position is refused before any step runs (a padded table's block 0 is another's)."""
    from kvferry.kernels.int8 import kv_row_width
    from kvferry.model.loader import load_model

    model = load_model(tiny_deepseek_nolora_dir, torch.float32)
    assert model.pack_weights()
    cfg, bs = model.cfg, 16
    kv = torch.zeros((cfg.num_layers, 2, 1, 8, bs, kv_row_width(cfg.kv_cache_dim, torch.float32)))
    kv[:, :, :, :5] = torch.randn(kv[:, :, :, :5].shape, generator=GEN)
    lens, tables, steps = [30, 3], [[0, 1, 2], [4]], 5  # the first crosses into its third block
    ids, positions = [5, 77], [n - 1 for n in lens]
    kv_burst = kv.clone()
    burst = model.decode_burst(ids, positions, tables, [*lens], kv_burst, steps)
    assert model.step_argmax is None and model.step_logits is None
    expect = []
    for _ in range(steps):
        slots = ([t[p // bs] for t, p in zip(tables, positions, strict=True)], [p % bs for p in positions])
        assert model.decode_lists(ids, positions, *slots, tables, lens, kv) is not None
        ids = model.step_argmax[1]
        expect.append(ids)
        positions, lens = [p + 1 for p in positions], [n + 1 for n in lens]
    assert burst == expect and torch.equal(kv_burst, kv)
    before = kv.clone()
    with pytest.raises(RuntimeError, match="do not hold the positions"):
        model.decode_burst([5, 77], [29, 13], [[0, 1], [4]], [30, 14], kv, 4)  # position 32: a third block
    assert torch.equal(kv, before)
    model.after_layer = print
    assert model.decode_burst([5], [2], [[4]], [3], kv, 2) is None


def test_the_kernels_argmax_is_numpys_with_ties_nans_and_infinities():
    """logits_argmax (a list-fed step's greedy tokens) picks what the sampler's numpy argmax picks: the first
    of equal values, the first NaN before any number, -inf rows, widths that are not a multiple of 8."""
    inf, nan = float("inf"), float("nan")
    rows = [
        torch.randn(8192, generator=GEN),
        torch.tensor([1.0, 3.0, 3.0, 2.0] * 5),  # a tie: the first
        torch.tensor([0.0] * 11 + [5.0]),  # the largest in the tail after the 8-wide blocks
        torch.tensor([-inf] * 13),
        torch.tensor([1.0, inf, 2.0, inf, nan, 4.0, nan, 0.0, 9.0]),  # the first NaN wins
        torch.tensor([-0.0, 0.0, -1.0]),  # equal zeros: the first
        torch.tensor([2.0]),
    ]
    for row in rows:
        assert torch.ops.kvferry_cpu.logits_argmax(row[None]) == row[None].numpy().argmax(-1).tolist(), row
    batch = torch.randn(5, 1000, generator=GEN)
    batch[3, 17] = batch[3, 900] = 50.0
    assert torch.ops.kvferry_cpu.logits_argmax(batch) == batch.numpy().argmax(-1).tolist()
    with pytest.raises(RuntimeError, match="logits"):
        torch.ops.kvferry_cpu.logits_argmax(torch.zeros(3, 4, dtype=torch.float64))


# (the tiny model's step has 36 barriers: 11 in its dense first layer, 12 in each of its two MoE layers, one
# before the LM head)
@pytest.mark.parametrize(
    ("member", "sync", "threads"), [(1, 0, 2), (0, 7, 2), (2, 20, 3), (1, 33, 3), (0, 35, 2)]
)
def test_latent_decode_step_error_in_one_member_leaves_the_region(tiny_deepseek_dir, member, sync, threads):
    """A member of the one-region step that raises (a fault set at one of its barriers) makes every member
    leave at its next barrier; the call raises that error instead of hanging or ending the process, and the
    next step runs in a new region, exact."""
    from kvferry.kernels.cpu import ops as cpu_ops
    from kvferry.kernels.int8 import kv_row_width
    from kvferry.model.loader import load_model

    model = load_model(tiny_deepseek_dir, torch.float32)
    assert model.pack_weights() and model.decode_weights
    cfg, bs = model.cfg, 16
    width = kv_row_width(cfg.kv_cache_dim, torch.float32)
    kv = torch.zeros((cfg.num_layers, 2, cfg.num_kv_heads, 8, bs, width))
    lens, tables = [3, 17, 5], [[0], [1, 2], [3]]
    meta = decode_meta(lens, tables, bs)
    step = lambda: model(torch.tensor([5, 77, 300]), torch.tensor(lens), kv, meta)  # noqa: E731
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_ops().set_team_fault(member, sync)
        with pytest.raises(RuntimeError, match="set_team_fault"):
            step()
        fused = step()
        weights, model.decode_weights = model.decode_weights, []
        layered = step()
        model.decode_weights = weights
    finally:
        cpu_ops().set_team_fault(-1, -1)
        torch.set_num_threads(before)
    assert torch.equal(fused, layered)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pool_layout_matches_the_engines_kv_cache(tiny_model_dir, make_engine, dtype):
    """The launcher sizes the pool's blocks by the same rule the engine picks its KV dtype with (float32
    under the CPU kernels, also for a bf16 model): otherwise every KV write-out is refused."""
    from kvferry.deploy.config import ClusterConfig
    from kvferry.deploy.local import cluster_layout

    layout = cluster_layout(ClusterConfig(model=str(tiny_model_dir), dtype=dtype), tiny_model_dir)
    engine = make_engine(dtype=dtype, num_kv_blocks=16)
    assert layout.torch_dtype == engine.kv_dtype == engine.runner.kv_cache.dtype


def test_moe_experts_long_step_in_chunks():
    """A step longer than the kernel's 512-token chunk gives each token what it gets alone."""
    x, ids, weights, w13, w2 = moe_inputs(1100, hidden=32, inter=16, id_range=4)
    w13, w2 = pack(w13), pack(w2)
    out = experts_forward(x, ids, weights, w13, w2)
    for t in (0, 511, 512, 1099):
        assert torch.equal(
            out[t : t + 1], experts_forward(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], w13, w2)
        )


def test_moe_experts_w13_and_w2_stored_differently():
    """w13 bf16-exact (stored as bf16) next to a float32 w2: each GEMM reads its own storage."""
    x, ids, weights = randn(3, 32), torch.tensor([[0, 1], [1, 0], [1, 1]]), torch.rand(3, 2, generator=GEN)
    w13, w2 = randn(2, 32, 32).bfloat16().float(), randn(2, 16, 32)
    p13, p2 = pack(w13), pack(w2)
    assert p13.dtype == torch.bfloat16 and p2.dtype == torch.float32
    out = experts_forward(x, ids, weights, p13, p2)
    torch.testing.assert_close(out, experts_forward(x, ids, weights, w13, w2), rtol=1e-4, atol=1e-4)


def latent_inputs(lens: list[int], heads: int, half: int, bs: int, int8: bool):
    from kvferry.kernels.int8 import quantize_kv

    num_blocks = 80
    first, second = randn(1, num_blocks, bs, half), randn(1, num_blocks, bs, half)
    if int8:
        first, second = quantize_kv(first), quantize_kv(second)
    width = max(-(-n // bs) for n in lens) + 1  # one more column than any needs: padding is ignored
    tables = torch.randperm(num_blocks, generator=GEN)[: len(lens) * width].view(len(lens), width)
    return randn(len(lens), heads, 2 * half), first, second, tables, torch.tensor(lens)


LATENT_CASES = [(16, 40, 64), (4, 32, 48), (5, 9, 17), (3, 24, 40)]  # heads, half a row, rank


@pytest.mark.parametrize(("heads", "half", "rank"), LATENT_CASES)
@pytest.mark.parametrize("lens", [[1], [16, 3, 40], [8, 9, 17, 33, 64], [150, 3]])  # 150: three runs of rows
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("skip", [0, 1])
def test_latent_decode_attention(heads, half, rank, lens, int8, skip):
    """MLA's absorbed decode (`mla.latent_decode_attention_reference`): rows read through the tables from
    both half planes, float32 or int8 rows with their scales; V is the rows' first `rank` values (all of
    the first plane and part of the second, or part of the first); `skip` leading positions unread (the
    MTP layer's slot 0; a sequence of one position then attends over none: zeros)."""
    from kvferry.model.mla import latent_decode_attention_reference

    args = latent_inputs(lens, heads, half, 8, int8)
    out = cpu.ops().latent_decode_attention(*args, 0.2, rank, skip)
    expected = latent_decode_attention_reference(*args, 0.2, rank, skip).nan_to_num(0.0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("heads", "nope", "rank", "rope", "vd"), [(16, 32, 64, 16, 32), (5, 10, 28, 12, 12), (4, 16, 140, 16, 76)]
)
def test_latent_decode_reads_bf16_up_projections_exactly(heads, nope, rank, rope, vd):
    """latent_decode (W_uk into the query, the latent attention, W_uv) with bfloat16 W_uk / W_uv (how a
    bf16 checkpoint's are kept: half the bytes) gives bit for bit what their float32 widening gives, also
    where a row's length is not a multiple of 8 or spans several 64-value chunks, and both match the torch
    reference; mixed dtypes are refused."""
    from kvferry.model.mla import latent_decode_attention_reference

    _, first, second, tables, lens = latent_inputs([16, 3, 40], heads, (rank + rope) // 2, 8, False)
    q = randn(3, heads, nope + rope)
    w_uk, w_uv = randn(heads, nope, rank).bfloat16(), randn(heads, rank, vd).bfloat16()
    planes = (first, second, tables, lens, 0.2, 0)
    got = cpu.ops().latent_decode(q, w_uk, w_uv, *planes)
    assert torch.equal(got, cpu.ops().latent_decode(q, w_uk.float(), w_uv.float(), *planes))
    q_lat = torch.einsum("thn,hnr->thr", q[..., :nope], w_uk.float())
    query = torch.cat((q_lat, q[..., nope:]), dim=-1)
    attn = latent_decode_attention_reference(query, first, second, tables, lens, 0.2, rank, 0)
    torch.testing.assert_close(got, torch.einsum("thr,hrv->thv", attn, w_uv.float()), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        cpu.ops().latent_decode(q, w_uk, w_uv.float(), *planes)


@pytest.mark.parametrize("heads", [12, 16, 20])
def test_a_heads_latent_attention_does_not_depend_on_the_grouping(heads):
    """Work items group a sequence's heads by the thread count and the batch (one sequence on two threads:
    two groups; on one thread, or in a batch of two: one). Every head's scores go through the same 8-head
    kernel whatever its group, so a sequence's result is bit for bit the same alone or batched, on one
    thread or two."""
    args = latent_inputs([150, 40], heads, 40, 8, False)
    q, first, second, tables, lens = args
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            alone = cpu.ops().latent_decode_attention(q[:1], first, second, tables[:1], lens[:1], 0.2, 64)
            results += [alone, cpu.ops().latent_decode_attention(*args, 0.2, 64)[:1]]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


LATENT_AVX2_CHECK = """
import torch
from kvferry.kernels import cpu
from kvferry.model.mla import latent_decode_attention_reference
import tests.unit.test_cpu_kernels as t
assert cpu.load() and not cpu.has_avx512_bf16()
for heads, half, rank in t.LATENT_CASES:
    for int8 in (False, True):
        args = t.latent_inputs([8, 9, 17, 33, 64], heads, half, 8, int8)
        out = cpu.ops().latent_decode_attention(*args, 0.2, rank)
        want = latent_decode_attention_reference(*args, 0.2, rank)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
print("avx2 latent ok")
"""


@pytest.mark.slow  # the AVX2-only build of the kernels (~20 s, once per cache)
def test_latent_decode_attention_on_the_avx2_build():
    """The same kernel where the CPU is seen as AVX2-only (its 8-lane loops instead of the AVX-512 ones)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, cpu.ISA_ENV: "avx2"}
    done = subprocess.run(
        [sys.executable, "-c", LATENT_AVX2_CHECK],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "avx2 latent ok" in done.stdout


@pytest.mark.parametrize(
    ("experts", "groups", "kept", "k"), [(8, 4, 2, 2), (6, 1, 1, 3), (16, 4, 1, 4), (72, 8, 3, 6)]
)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("logits_inside", [False, True])
def test_grouped_topk(experts, groups, kept, k, renormalize, logits_inside):
    """The C++ noaux_tc routing chooses the experts `moe.grouped_route` chooses, with its weights; from the
    router's logits (grouped_topk) or from the tokens and the router (grouped_route: its own logits, in
    column runs of 32, 8 and 1 for 72 experts)."""
    from kvferry.model.moe import Gating, grouped_route

    gating = Gating(k, renormalize, True, groups, kept, 2.5)
    x, router, bias = randn(37, 24), randn(24, experts), randn(experts) * 0.3
    want_w, want_ids = grouped_route(x, router, bias, gating)
    if logits_inside:
        got_w, got_ids = cpu.ops().grouped_route(x, router, bias, k, renormalize, groups, kept, 2.5)
    else:
        got_w, got_ids = cpu.ops().grouped_topk(x @ router, bias, k, renormalize, groups, kept, 2.5)
    order_w, order_g = want_ids.sort(-1).indices, got_ids.sort(-1).indices
    assert torch.equal(want_ids.gather(1, order_w), got_ids.gather(1, order_g))
    torch.testing.assert_close(got_w.gather(1, order_g), want_w.gather(1, order_w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [0, 1, 5])
@pytest.mark.parametrize("inter", [64, 40])
def test_gated_mlp(tokens, inter):
    """The dense gated MLP in one call (the dense layers and shared experts under the kernels) against
    silu(x W_gate) * (x W_up) W_2."""
    x, w13, w2 = randn(tokens, 48), randn(48, 2 * inter) * 0.2, randn(inter, 48) * 0.2
    out = cpu.ops().gated_mlp(x, pack(w13), pack(w2))
    gate, up = (x @ w13).chunk(2, -1)
    torch.testing.assert_close(out, (torch.nn.functional.silu(gate) * up) @ w2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("int8", [False, True])
def test_latent_rope_store(int8):
    """The C++ rotation and latent cache write: the query's rope part rotated as `apply_rotary` does, and
    each token's row [c | rotated k_rope] in its slot of the two half planes (int8: `quantize_kv` rows)."""
    from kvferry.kernels.int8 import kv_row_width, quantize_kv

    tokens, heads, nope, rope, rank, bs = 5, 3, 8, 16, 32, 4
    half = (rank + rope) // 2
    dtype = torch.int8 if int8 else torch.float32
    first = torch.zeros(1, 6, bs, kv_row_width(half, dtype), dtype=dtype)
    second = torch.zeros_like(first)
    q, latent, c = randn(tokens, heads, nope + rope), randn(tokens, rank + rope), randn(tokens, rank)
    angles = randn(tokens, rope // 2)
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)
    blocks, offsets = torch.tensor([5, 0, 2, 2, 3]), torch.tensor([1, 3, 0, 2, 3])
    q_out, rows = cpu.ops().latent_rope_store(q, latent, c, cos, sin, first, second, blocks, offsets)
    want_q = torch.cat((q[..., :nope], apply_rotary(q[..., nope:], cos[:, None], sin[:, None])), -1)
    want_rows = torch.cat((c, apply_rotary(latent[:, None, rank:], cos[:, None], sin[:, None])[:, 0]), -1)
    torch.testing.assert_close(q_out, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rows, want_rows, rtol=1e-6, atol=1e-6)
    halves = (rows[:, :half], rows[:, half:])
    for plane, values in zip((first, second), halves, strict=True):
        stored = plane[0, blocks, offsets]
        if int8:
            assert torch.equal(stored, quantize_kv(values))
        else:
            assert torch.equal(stored, values)
    untouched = torch.ones(6, bs, dtype=torch.bool)
    untouched[blocks, offsets] = False
    assert not first[0][untouched].any() and not second[0][untouched].any()


def test_a_builder_killed_midway_does_not_hold_every_later_start(tmp_path):
    """A process killed while it builds the kernels (a worker stopped at start-up, a cut-off CI run) leaves
    torch's baton file behind; the next start must not wait on it forever (as `cpp_extension.load` alone
    does), while a live builder still holds everyone else off."""
    import fcntl
    import signal
    import subprocess
    import sys

    holder = (
        "import pathlib, sys, time\n"
        "from kvferry.kernels import cpu\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "with cpu._build_lock(d):\n"
        "    (d / cpu.TORCH_BATON).touch()\n"  # what cpp_extension.load makes first
        "    print('building', flush=True)\n"
        "    time.sleep(120)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "building"
        # a live builder holds the directory
        with open(tmp_path / "build.flock", "a") as probe, pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        child.kill()
        child.wait()
    assert (tmp_path / cpu.TORCH_BATON).exists()  # the dead builder's baton
    with cpu._build_lock(tmp_path):
        assert not (tmp_path / cpu.TORCH_BATON).exists()
