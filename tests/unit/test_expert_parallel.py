"""Expert-parallel dispatch/combine and tensor/expert-parallel model shards against one-process references.

Every rank is its own process (spawn_ranks): gloo groups must not share a process.
"""

from __future__ import annotations

import pytest
import torch

from kvferry.model.moe import dispatch_combine, experts_forward
from kvferry.model.parallel import (
    Comm,
    Parallel,
    TPShard,
    expert_owner,
    expert_range,
    init_group,
    spawn_ranks,
)

pytestmark = pytest.mark.slow  # multi-process

H, I, E, K = 16, 8, 4, 2


def _weights(num_experts: int = E):
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(num_experts, H, 2 * I, generator=gen) * 0.3
    return w13, torch.randn(num_experts, I, H, generator=gen) * 0.3


def _case(name: str, rank: int, num_experts: int = E) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, ids, weights) of one rank's tokens in a named routing case (2 ranks, experts 0-1 | 2-3; the
    "mixed" case takes any number of experts and ranks)."""
    gen = torch.Generator().manual_seed(10 * CASES.index(name) + rank)
    tokens = {"mixed": 7 + 3 * rank, "rank1_empty": 5 if rank == 0 else 0}.get(name, 6)
    x = torch.randn(tokens, H, generator=gen)
    if name == "mixed":  # any experts: tokens go to both ranks, some to both at once
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:K] for _ in range(tokens)])
        ids = ids.view(tokens, K)
    elif name in ("to_rank0", "rank1_empty"):  # rank 1 receives nothing (and in rank1_empty sends nothing)
        ids = torch.tensor([[0, 1]] * tokens, dtype=torch.long).view(tokens, K)
    else:  # "single_rank": each token's top-k both on one rank, alternating ranks
        ids = torch.tensor([[0, 1] if t % 2 else [3, 2] for t in range(tokens)], dtype=torch.long).view(
            tokens, K
        )
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1)
    return x, ids, weights


CASES = ("mixed", "to_rank0", "rank1_empty", "single_rank")


def _dispatch_rank(store, rank: int, size: int, inline: bool):
    from kvferry.model import moe

    moe.INLINE_METADATA = inline  # ids/weights as extra columns of the rows, or their own all_to_all
    torch.set_num_threads(1)
    comm = init_group(store, "dispatch", rank, size, torch.device("cpu"))
    w13, w2 = _weights()
    mine = expert_range(E, size, rank)
    results = {}
    for name in CASES:
        x, ids, weights = _case(name, rank)
        out = dispatch_combine(
            x,
            ids,
            weights,
            w13[mine.start : mine.stop],
            w2[mine.start : mine.stop],
            comm,
            expert_owner(E, size),
            mine.start,
        )
        results[name] = out
    return results


def _uneven_rank(store, rank: int, size: int, num_experts: int, triton: bool):
    torch.set_num_threads(1)
    comm = init_group(store, "uneven", rank, size, torch.device("cpu"))
    w13, w2 = _weights(num_experts)
    mine = expert_range(num_experts, size, rank)
    x, ids, weights = _case("mixed", rank, num_experts)
    owner = expert_owner(num_experts, size)
    local = (w13[mine.start : mine.stop], w2[mine.start : mine.stop])
    return dispatch_combine(x, ids, weights, *local, comm, owner, mine.start, triton=triton)


def test_uneven_expert_maps():
    """The first E mod M ranks hold one expert more; every expert has exactly one owner."""
    assert [list(expert_range(5, 2, r)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(expert_range(8, 3, r)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [len(expert_range(12, 5, r)) for r in range(5)] == [3, 3, 2, 2, 2]
    assert expert_owner(8, 3).tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert [len(expert_range(6, 6, r)) for r in range(6)] == [1] * 6
    for e, m in ((5, 2), (8, 3), (7, 4), (64, 12)):
        covered = [x for r in range(m) for x in expert_range(e, m, r)]
        assert covered == list(range(e))


@pytest.mark.parametrize(
    ("num_experts", "size", "triton"), [(5, 2, False), (8, 3, False), (5, 2, True), (8, 3, True)]
)
def test_dispatch_combine_over_an_uneven_map_matches_one_process(num_experts, size, triton):
    """triton: the dispatch layout and the local experts on the Triton kernels (the interpreter on a
    CPU: the ranks inherit tests/conftest.py's TRITON_INTERPRET=1)."""
    if triton:
        pytest.importorskip("triton")
    w13, w2 = _weights(num_experts)
    ranks = spawn_ranks(_uneven_rank, size, (num_experts, triton))
    for rank, got in enumerate(ranks):
        x, ids, weights = _case("mixed", rank, num_experts)
        expected = experts_forward(x, ids, weights, w13, w2)
        assert torch.allclose(got, expected, atol=1e-5), (rank, (got - expected).abs().max())


@pytest.mark.parametrize("inline", [True, False])
def test_dispatch_combine_matches_single_process_moe(inline):
    w13, w2 = _weights()
    ranks = spawn_ranks(_dispatch_rank, 2, (inline,))
    for name in CASES:
        for rank, results in enumerate(ranks):
            x, ids, weights = _case(name, rank)
            expected = experts_forward(x, ids, weights, w13, w2)
            got = results[name]
            assert got.shape == x.shape, (name, rank)
            assert torch.allclose(got, expected, atol=1e-5), (name, rank, (got - expected).abs().max())


def _model_rank(store, rank: int, size: int, model_dir: str, kind: str):
    from kvferry.model.attention import AttentionMetadata, PrefillChunk
    from kvferry.model.loader import load_model

    torch.set_num_threads(1)
    comm = init_group(store, kind, rank, size, torch.device("cpu"))
    parallel = Parallel(comm, Comm.single()) if kind == "tp" else Parallel(Comm.single(), comm)
    model = load_model(model_dir, torch.float32, "cpu", 256, parallel)
    ids = torch.randint(0, model.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    cache = torch.zeros(model.cfg.num_layers, 2, model.num_local_kv_heads, 4, 16, model.cfg.head_dim)
    slots = list(range(20))
    chunk = PrefillChunk(0, 20, 20, torch.tensor([0, 1]))
    meta = AttentionMetadata.build(
        [p // 16 for p in slots], [p % 16 for p in slots], [], [], [chunk], cache.device
    )
    logits = model.compute_logits(model(ids, torch.arange(20), cache, meta))
    return logits, cache


@pytest.mark.parametrize(
    ("kind", "size", "checkpoint"),
    [
        ("tp", 2, "second_model_dir"),
        ("tp", 4, "tiny_model_dir"),
        ("ep", 2, "second_model_dir"),
        ("ep", 2, "five_expert_model_dir"),
        ("ep", 3, "eight_expert_model_dir"),
    ],
)
def test_sharded_model_matches_one_process(request, kind, size, checkpoint):
    """TP 4 over tiny's 2 KV heads replicates each on two ranks; every rank's cache holds its slice.
    The second model has a dense layer, 6 experts top-3 and tied embeddings."""
    from kvferry.model.config import ModelConfig

    second_model_dir = request.getfixturevalue(checkpoint)

    reference_logits, reference_cache = _model_rank(None, 0, 1, str(second_model_dir), "single")
    ranks = spawn_ranks(_model_rank, size, (str(second_model_dir), kind))
    cfg = ModelConfig.from_dir(second_model_dir)
    for rank, (logits, cache) in enumerate(ranks):
        assert torch.allclose(logits, reference_logits, atol=1e-4), (
            rank,
            (logits - reference_logits).abs().max(),
        )
        assert torch.equal(logits.argmax(-1), reference_logits.argmax(-1))
        heads = (
            TPShard(rank, size, cfg.num_heads, cfg.num_kv_heads).kv_heads
            if kind == "tp"
            else range(cfg.num_kv_heads)
        )
        expected = reference_cache[:, :, heads.start : heads.stop]
        assert torch.allclose(cache, expected, atol=1e-4), rank
