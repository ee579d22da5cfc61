"""The decode KV mirror gives the same attention as gathering blocks from the paged cache."""

from __future__ import annotations

import torch

from kvferry.model.attention import AttentionMetadata, _decode_attention
from kvferry.model.decode_mirror import DecodeMirror

HKV, G, D, BS, NUM_BLOCKS = 2, 2, 8, 4, 64


class Seq:
    def __init__(self, blocks: list[int], length: int):
        self.blocks, self.length = blocks, length


def attend(seqs, caches, mirror, gen):
    """Append one token to each seq (written to the paged cache), then attend both ways."""
    k_cache, v_cache = caches
    for s in seqs:
        s.length += 1
    k_new = torch.randn(len(seqs), HKV, D, generator=gen)
    v_new = torch.randn(len(seqs), HKV, D, generator=gen)
    for i, s in enumerate(seqs):
        pos = s.length - 1
        k_cache[:, s.blocks[pos // BS], pos % BS] = k_new[i]
        v_cache[:, s.blocks[pos // BS], pos % BS] = v_new[i]
    lens = [s.length for s in seqs]
    meta = AttentionMetadata.build([0], [0], [s.blocks for s in seqs], lens, [], k_cache)
    q = torch.randn(len(seqs), HKV * G, D, generator=gen)
    reference = _decode_attention(q, k_new, v_new, k_cache, v_cache, meta, 0.3, layer=0)
    assert mirror.prepare(seqs, lens, HKV, D, k_cache)
    meta.mirror = mirror
    mirrored = _decode_attention(q, k_new, v_new, k_cache, v_cache, meta, 0.3, layer=0)
    assert torch.isfinite(mirrored).all()
    assert torch.allclose(mirrored, reference, atol=1e-5)
    return mirror.append


def test_append_rebuild_shrink_grow():
    gen = torch.Generator().manual_seed(0)
    caches = (
        torch.randn(HKV, NUM_BLOCKS, BS, D, generator=gen),
        torch.randn(HKV, NUM_BLOCKS, BS, D, generator=gen),
    )
    mirror = DecodeMirror(num_layers=1, slack=2)
    a, b, c = Seq([1, 2, 3, 4, 5], 5), Seq([6, 7, 8, 9], 2), Seq([10, 11, 12, 13, 14], 9)
    modes = [attend([a, b], caches, mirror, gen) for _ in range(4)]
    assert modes == [False, True, True, False]  # the 4th step outgrows the capacity (slack 2): rebuild
    assert attend([b], caches, mirror, gen) is False  # a left: rebuild into the (reused) buffers
    assert attend([b], caches, mirror, gen) is True
    assert attend([c, b], caches, mirror, gen) is False  # c joined
    assert attend([c, b], caches, mirror, gen) is True
    assert attend([b, c], caches, mirror, gen) is False  # same members in another order


def test_refuses_past_its_memory_budget():
    k_cache = torch.zeros(HKV, NUM_BLOCKS, BS, D)
    mirror = DecodeMirror(num_layers=4, max_bytes=1024)
    assert not mirror.prepare([object()], [100], HKV, D, k_cache)
    assert mirror.k_t is None
