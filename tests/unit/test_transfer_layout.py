"""Block layout conversions between the paged cache and the pool's canonical layout."""

from __future__ import annotations

import pytest
import torch

from kvferry.kvpool.transfer import BlockLayout, Staging, chunk_plan, pack_blocks, runs, unpack_blocks


def test_runs_groups_consecutive_ids():
    assert runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert runs([]) == []


def test_chunk_plan_covers_every_block_once():
    assert chunk_plan(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_plan(0, 4) == []


@pytest.mark.parametrize("ids", [[0, 1, 2], [5, 2, 7, 8, 3], [9]])
def test_pack_matches_reference_and_unpack_inverts_it(ids):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 2, 4, 10, 16, 8, generator=gen)  # [L, 2, H, blocks, bs, D]
    packed = pack_blocks(cache, ids)
    reference = torch.stack([cache[:, :, :, b] for b in ids])  # [n, L, 2, H, bs, D]
    assert torch.equal(packed, reference)
    other = torch.zeros_like(cache)
    unpack_blocks(other, ids, packed)
    assert torch.equal(other[:, :, :, ids], cache[:, :, :, ids])
    untouched = [b for b in range(10) if b not in ids]
    assert other[:, :, :, untouched].abs().sum() == 0


def test_head_slices_reassemble_the_block():
    cache = torch.randn(2, 2, 4, 6, 16, 8)
    ids = [4, 1]
    low, high = pack_blocks(cache, ids, 0, 2), pack_blocks(cache, ids, 2, 4)
    assert low.shape == (2, 2, 2, 2, 16, 8)
    other = torch.zeros_like(cache)
    unpack_blocks(other, ids, low, head_begin=0)
    unpack_blocks(other, ids, high, head_begin=2)
    assert torch.equal(other[:, :, :, ids], cache[:, :, :, ids])


def test_pack_into_a_given_buffer():
    cache = torch.randn(2, 2, 2, 5, 4, 8)
    out = torch.empty(2, 2, 2, 2, 4, 8)
    assert pack_blocks(cache, [3, 0], out=out) is out
    assert torch.equal(out[0], cache[:, :, :, 3])


def test_layout_shape_bytes_and_heads():
    layout = BlockLayout(8, 4, 16, 32, "float32")
    assert layout.shape == (8, 2, 4, 16, 32)
    assert layout.block_bytes == 8 * 2 * 4 * 16 * 32 * 4
    assert BlockLayout.from_list(layout.to_list()) == layout
    with pytest.raises(ValueError, match="KV-head slice"):
        layout.check_heads(2, 5)
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        _ = BlockLayout(1, 1, 1, 1, "int7").torch_dtype


def test_staging_reuses_and_grows():
    st = Staging(torch.float32, torch.device("cpu"))
    a = st.view((2, 3))
    b = st.view((1, 3))
    assert a.data_ptr() == b.data_ptr()
    assert st.view((2, 3), 1).data_ptr() != a.data_ptr()  # the second buffer
    assert st.view((10, 10)).numel() == 100
