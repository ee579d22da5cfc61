"""The Triton kernels (kernels/triton_*.py) against their torch references.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set below before any
kernel is decorated) on CPU tensors; with CUDA they run compiled on the GPU. Shapes are kept small: the
interpreter runs every program instance in Python.

Dtypes: float32 and float16 only for the arithmetic kernels. bfloat16 loads/stores are broken in the
interpreter (NaN / garbage, checked with triton 3.9.0); pack/unpack move elements as same-width
integers, so bfloat16 is tested there. Tolerances: float32 atol = rtol = 1e-4 (the kernels use IEEE
float32 dots; the observed error is ~1e-6, the slack covers summation order), float16 atol = rtol = 2e-2
(16-bit inputs and rounding of intermediate products); pack/unpack must be bit-exact (torch.equal).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kvferry.kernels import triton_attention as ta
from kvferry.kernels import triton_moe as tm
from kvferry.kernels import triton_pack as tp
from kvferry.kernels.paged_attention import paged_decode_attention_reference
from kvferry.kvpool import transfer
from kvferry.model.moe import experts_forward, route

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = [torch.float32, torch.float16]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def caches(g, hkv, num_blocks, bs, d, dtype):
    return randn(g, hkv, num_blocks, bs, d, dtype=dtype), randn(g, hkv, num_blocks, bs, d, dtype=dtype)


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("bs", "half", "rank", "heads", "skip"),
    [(16, 40, 64, 16, 0), (8, 32, 48, 4, 0), (4, 9, 17, 20, 0), (8, 32, 48, 4, 1), (4, 9, 17, 20, 1)],
)
def test_latent_decode_attention(dtype, bs, half, rank, heads, skip):
    """MLA's absorbed decode against `mla.latent_decode_attention_reference`: V in both planes (rank >
    half) or the first only, an unpadded half (9), more heads than a program's 16; lengths 1 (2 with a
    skip), a block, block boundaries +- 1 over shuffled tables; position 0 attended or skipped (the MTP
    layer's draft, whose slot 0 holds nothing)."""
    from kvferry.model.mla import latent_decode_attention_reference

    g = gen(11)
    num_blocks, lens = 32, [1 + skip, bs, bs + 1, 3 * bs - 1, 5 * bs]
    first, second = (randn(g, 1, num_blocks, bs, half, dtype=dtype) for _ in range(2))
    width = max(-(-n // bs) for n in lens)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).to(DEVICE)
    q = randn(g, len(lens), heads, 2 * half, dtype=dtype)
    context = tensor(lens)
    out = ta.latent_decode_attention(q, first, second, tables, context, 0.2, rank, skip)
    want = latent_decode_attention_reference(
        q.float(), first.float(), second.float(), tables, context, 0.2, rank, skip
    )
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bs", "d", "hq", "hkv"), [(8, 32, 8, 2), (16, 64, 8, 2), (32, 24, 3, 3)])
def test_paged_decode_attention(dtype, bs, d, hq, hkv):
    """GQA (G=4) and no GQA with an unpadded D=24; lengths 1, one block exactly, block boundaries +- 1,
    the whole table; non-consecutive block tables over a shuffled pool."""
    g = gen(1)
    width, num_blocks = 4, 29
    k_cache, v_cache = caches(g, hkv, num_blocks, bs, d, dtype)
    lens = tensor([1, bs, bs + 1, 2 * bs - 1, 3 * bs + 5, width * bs])
    tables = torch.randperm(num_blocks, generator=g)[: lens.numel() * width].view(-1, width).to(DEVICE)
    q = randn(g, lens.numel(), hq, d, dtype=dtype)
    scale = d**-0.5
    out = ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    ref = paged_decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    # length 1 attends to exactly the first slot of its first block
    head_of = torch.arange(hq, device=DEVICE) // (hq // hkv)
    torch.testing.assert_close(out[0].float(), v_cache[head_of, tables[0, 0], 0].float(), **TOL[dtype])


def prefill_case(g, bs, dtype, hq=8, hkv=2, d=32):
    """Four chunks in one flat batch, with unused rows between them:
    0: no cached prefix (context_len == q_len); 1: a prefix ending mid-block, so the chunk starts mid-block;
    2: one new token after a long prefix (a decode); 3: a prefix of exactly two blocks."""
    width, num_blocks = 6, 40
    k_cache, v_cache = caches(g, hkv, num_blocks, bs, d, dtype)
    q_lens = [13, 9, 1, 20]
    context_lens = [13, bs + 5 + 9, 4 * bs + 3, 2 * bs + 20]
    q_starts = [0, 15, 24, 27]  # rows 13, 14 and 25, 26 belong to no chunk
    tables = torch.randperm(num_blocks, generator=g)[: 4 * width].view(4, width).to(DEVICE)
    q = randn(g, 47, hq, d, dtype=dtype)
    # the per-chunk scalars as strided views of one [C, 3] tensor, as model.attention builds them
    starts, lens, contexts = tensor(list(zip(q_starts, q_lens, context_lens, strict=True))).unbind(1)
    assert starts.stride() == (3,)
    return q, k_cache, v_cache, tables, starts, lens, contexts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [8, 16])
def test_paged_prefill_attention(dtype, bs):
    q, k_cache, v_cache, tables, q_starts, q_lens, context_lens = prefill_case(gen(2), bs, dtype)
    scale = q.shape[-1] ** -0.5
    out = ta.paged_prefill_attention(q, k_cache, v_cache, tables, q_starts, q_lens, context_lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    args = (q.float(), k_cache.float(), v_cache.float(), tables, q_starts, q_lens, context_lens, scale)
    ref = ta.paged_prefill_attention_reference(*args)
    chunks = zip(q_starts.tolist(), q_lens.tolist(), strict=True)
    covered = torch.cat([torch.arange(s, s + n) for s, n in chunks])
    assert covered.numel() == 43
    torch.testing.assert_close(out[covered].float(), ref[covered], **TOL[dtype])
    assert torch.count_nonzero(ref[[13, 14, 25, 26]]) == 0  # the reference leaves gaps at zero


def test_prefill_reference_matches_decode_and_plain_causal():
    """The prefill reference itself: a one-token chunk is a decode, and a chunk without a cached prefix is
    plain causal attention over its own K/V."""
    q, k_cache, v_cache, tables, q_starts, q_lens, context_lens = prefill_case(gen(3), 8, torch.float32)
    ref = ta.paged_prefill_attention_reference(
        q, k_cache, v_cache, tables, q_starts, q_lens, context_lens, 0.3
    )
    decode = paged_decode_attention_reference(q[24:25], k_cache, v_cache, tables[2:3], context_lens[2:3], 0.3)
    torch.testing.assert_close(ref[24:25], decode, atol=1e-5, rtol=1e-5)
    rows = ta.block_rows(k_cache, tables[0])
    keys = ta.gather_rows(k_cache, rows).view(2, -1, 32)[:, :13].repeat_interleave(4, 0)
    values = ta.gather_rows(v_cache, rows).view(2, -1, 32)[:, :13].repeat_interleave(4, 0)
    scores = (q[:13].transpose(0, 1) @ keys.transpose(1, 2)) * 0.3
    scores = scores.masked_fill(torch.ones(13, 13, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
    plain = (scores.softmax(-1) @ values).transpose(0, 1)
    torch.testing.assert_close(ref[:13], plain, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- MoE


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_topk(renormalize):
    g = gen(4)
    x, router = randn(g, 19, 32), randn(g, 32, 7)  # 7 experts: a padded expert axis
    weights, ids = tm.route_topk(x @ router, 3, renormalize)
    ref_weights, ref_ids = route(x, router, 3, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (19, 3)
    assert torch.equal(ids, ref_ids)  # random logits: no ties
    torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(19, device=DEVICE))


def test_moe_align_invariants():
    g = gen(5)
    num_tokens, top_k, num_experts, block_m = 13, 2, 5, 16
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=g).to(DEVICE)
    ids[0] = torch.tensor([4, 1])  # expert 4 has at least one assignment, expert 3 none
    ids[ids == 3] = 2
    expert_map = tensor([0, -1, 1, 2, -1])  # experts 1 and 4 live on another rank
    sorted_ids, block_expert, post_pad = tm.moe_align(ids, num_experts, block_m, expert_map)
    _, plain_block_expert, _ = tm.moe_align(ids, num_experts, block_m)
    flat, sentinel = ids.flatten(), num_tokens * top_k
    counts = torch.bincount(flat, minlength=num_experts)
    used = int(post_pad)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum()) and used % block_m == 0
    assert sorted_ids.numel() % block_m == 0 and block_expert.numel() == sorted_ids.numel() // block_m
    real = sorted_ids[:used][sorted_ids[:used] != sentinel]
    assert torch.equal(real.sort().values, torch.arange(sentinel, device=DEVICE))  # each assignment once
    assert torch.all(sorted_ids[used:] == sentinel)
    blocks = [-(-c // block_m) for c in counts.tolist()]
    expected = torch.repeat_interleave(torch.arange(num_experts), torch.tensor(blocks)).to(DEVICE)
    assert torch.equal(plain_block_expert[: expected.numel()], expected)
    assert torch.all(plain_block_expert[expected.numel() :] == -1)
    assert torch.equal(block_expert[: expected.numel()], expert_map[expected])
    start = 0
    for e, count in enumerate(counts.tolist()):  # each group: its assignments ascending, then the padding
        group = sorted_ids[start : start + blocks[e] * block_m]
        assert torch.equal(group[:count], torch.nonzero(flat == e).flatten())
        assert torch.all(group[count:] == sentinel)
        start += group.numel()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize(("first", "num_local"), [(0, 5), (0, 3), (3, 2)])
def test_fused_moe(dtype, num_tokens, first, num_local):
    """All 5 experts, and the two ranks of an uneven 3 + 2 split; H, I not multiples of the GEMM tiles."""
    g = gen(6 + num_tokens)
    hidden, inter = (48, 40) if dtype == torch.float32 else (64, 32)
    num_experts, top_k = 5, 2
    x = randn(g, num_tokens, hidden, dtype=dtype)
    weights, ids = route(x.float(), randn(g, hidden, num_experts), top_k, True)
    weights = weights.to(dtype)
    w13 = randn(g, num_experts, hidden, 2 * inter, dtype=dtype) * hidden**-0.5
    w2 = randn(g, num_experts, inter, hidden, dtype=dtype) * inter**-0.5
    local13, local2 = w13[first : first + num_local], w2[first : first + num_local]
    out = tm.fused_moe(x, ids, weights, local13, local2, first)
    assert out.shape == x.shape and out.dtype == dtype
    ref = experts_forward(x, ids, weights, local13, local2, first)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    if first == 3:  # the two ranks' partial sums add up to the full layer
        other = tm.fused_moe(x, ids, weights, w13[:3], w2[:3], 0)
        full = experts_forward(x, ids, weights, w13, w2)
        torch.testing.assert_close((out.float() + other.float()), full.float(), **TOL[dtype])


def test_fused_moe_no_local_assignment():
    g = gen(7)
    x = randn(g, 4, 32)
    ids = tensor([[0, 1]] * 4)
    out = tm.fused_moe(
        x, ids, torch.full((4, 2), 0.5, device=DEVICE), randn(g, 2, 32, 64), randn(g, 2, 32, 32), 2
    )
    assert torch.equal(out, torch.zeros_like(x))


@pytest.mark.parametrize(
    ("owner", "num_ranks", "top_k"), [([0, 0, 0, 1, 1], 2, 2), ([2, 0, 0, 2, 2, 0], 3, 3)]
)
def test_ep_dispatch_layout(owner, num_ranks, top_k):
    """Uneven owner maps (5 experts on 2 ranks; 6 on 3 with rank 1 owning none, top-3: a padded k axis);
    T over one program."""
    g = gen(8)
    owner = tensor(owner)
    ids = torch.stack([torch.randperm(owner.numel(), generator=g)[:top_k] for _ in range(37)]).to(DEVICE)
    order, counts = tm.ep_dispatch_layout(ids, owner, num_ranks)
    ref_order, ref_counts = tm.ep_dispatch_layout_reference(ids, owner, num_ranks)
    assert torch.equal(order, ref_order) and torch.equal(counts, ref_counts)
    assert int(counts.sum()) == order.numel() >= 37
    empty_order, empty_counts = tm.ep_dispatch_layout(ids[:0], owner, num_ranks)
    assert empty_order.numel() == 0 and torch.equal(empty_counts, torch.zeros_like(counts))


# ---------------------------------------------------------------- pack / unpack


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_begin", "head_end"), [(0, 4), (1, 3), (3, 4)])
def test_pack_unpack_bit_exact(dtype, head_begin, head_end):
    """Against `kvpool.transfer`'s torch copies, run on CPU copies (on CUDA transfer itself may pick
    these kernels); compared as bytes, NaN payloads included."""
    g = gen(9)
    cache = randn(g, 3, 2, 4, 20, 8, 16).to(dtype)  # [L, 2, H, num_blocks, bs, D]
    cache.view(-1)[::97] = float("nan")
    ids = [7, 3, 4, 5, 19, 0]  # out of order, with a run 3-4-5

    def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.equal(a.cpu().view(torch.int8), b.cpu().view(torch.int8))

    ref = transfer.pack_blocks(cache.cpu(), ids, head_begin, head_end)
    assert same_bits(tp.pack_blocks(cache, ids, head_begin, head_end), ref)
    wide = torch.zeros(ref.shape[0], 3, 2, ref.shape[3] + 1, 8, 16, dtype=dtype, device=DEVICE)
    out = wide[:, :, :, 1:]  # a strided destination
    assert tp.pack_blocks(cache, tensor(ids), head_begin, head_end, out=out) is out
    assert same_bits(out, ref) and torch.count_nonzero(wide[:, :, :, 0]) == 0

    data = randn(g, *ref.shape).to(dtype)
    mine = randn(g, *cache.shape).to(dtype)
    theirs = mine.cpu()
    tp.unpack_blocks(mine, tensor(ids), data, head_begin)
    transfer.unpack_blocks(theirs, ids, data.cpu(), head_begin)
    assert same_bits(mine, theirs)  # only the named blocks' head slice changed
    assert same_bits(tp.pack_blocks(mine, ids, head_begin, head_end), data)  # round trip


@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 40), (20, 128, 96), (70, 96, 130)])
def test_w8a8_linear_is_the_reference_bit_for_bit(m, k, n):
    """`--quantization int8` on CUDA: the Triton W8A8 GEMM equals the torch reference (exact int32 sums)."""
    from kvferry.kernels import triton_w8a8
    from kvferry.model import quant

    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    q, scale = quant.quantize_weight(torch.randn(k, n, generator=gen))
    assert torch.equal(triton_w8a8.w8a8_linear(x, q, scale), quant.w8a8_linear(x, q, scale))
    # 7-bit activations (what the torch path on an AVX2-only CPU host takes, to match its C++ kernels)
    assert torch.equal(triton_w8a8.w8a8_linear(x, q, scale, 63), quant.w8a8_linear(x, q, scale, 63))


def test_int8_layers_run_the_triton_kernel_where_triton_runs(monkeypatch):
    """`model.layers.int8_linear` (every int8 layer off the CPU kernels) takes the Triton W8A8 kernel where
    Triton runs (CUDA, or here the interpreter) and gives the torch reference's result at the device's
    activation range. (The engine-level int8 parity test runs `--kernels torch` on the reference itself.)"""
    from kvferry.kernels import triton_w8a8
    from kvferry.model import layers, quant

    calls = []
    kernel = triton_w8a8.w8a8_linear
    monkeypatch.setattr(triton_w8a8, "w8a8_linear", lambda *a: calls.append(1) or kernel(*a))
    gen = torch.Generator().manual_seed(11)
    w = layers.quantize(torch.randn(96, 40, generator=gen).to(DEVICE))
    x = torch.randn(9, 96, generator=gen).to(DEVICE)
    got = layers.int8_linear(x, w, w.int8_scale)
    assert calls == [1]
    qmax = quant.act_qmax(x.device)
    assert torch.equal(got.cpu(), quant.w8a8_linear(x.cpu(), w.cpu(), w.int8_scale.cpu(), qmax))
