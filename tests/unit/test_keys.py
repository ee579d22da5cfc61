"""kvferry.engine.block_hash: content-addressed, chained block keys."""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvferry.engine.block_hash import KEY_BYTES, block_keys, chain_key, model_fingerprint

BS = 4
FP = model_fingerprint("kvferry/known-answer", "bfloat16")
TOKENS = [(7919 * i + 13) % 151_000 for i in range(5 * BS + 3)]  # 5 full blocks + a 3-token tail


def test_fingerprint_is_deterministic_and_covers_every_field():
    assert model_fingerprint("kvferry/known-answer", "bfloat16") == FP
    assert isinstance(FP, bytes) and len(FP) == KEY_BYTES
    others = {
        model_fingerprint("kvferry/other-model", "bfloat16"),
        model_fingerprint("kvferry/known-answer", "float16"),
        model_fingerprint("kvferry/known-answer", "bfloat16", layout_version=2),
    }
    assert FP not in others and len(others) == 3


def test_keys_are_deterministic_bytes_of_key_bytes_length():
    keys = block_keys(TOKENS, BS, FP)
    assert keys == block_keys(list(TOKENS), BS, FP)
    assert keys == block_keys(tuple(TOKENS), BS, FP)
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize(("n", "expected"), [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (23, 5)])
def test_only_full_blocks_get_keys(n, expected):
    assert len(block_keys(TOKENS[:n], BS, FP)) == expected


def test_tail_tokens_do_not_affect_keys():
    assert block_keys(TOKENS[:20], BS, FP) == block_keys([*TOKENS[:20], 1, 2, 3], BS, FP)


def test_changing_block_0_changes_every_key():
    changed = list(TOKENS)
    changed[1] += 1
    for before, after in zip(block_keys(TOKENS, BS, FP), block_keys(changed, BS, FP), strict=True):
        assert before != after


def test_changing_block_2_keeps_earlier_keys_and_changes_later_ones():
    changed = list(TOKENS)
    changed[2 * BS + 3] += 1
    before, after = block_keys(TOKENS, BS, FP), block_keys(changed, BS, FP)
    assert before[:2] == after[:2]
    assert all(x != y for x, y in zip(before[2:], after[2:], strict=True))


def test_same_block_content_at_different_positions_gets_different_keys():
    repeated = [5, 6, 7, 8] * 3
    keys = block_keys(repeated, BS, FP)
    assert len(set(keys)) == 3


def test_fingerprint_changes_every_key():
    other = model_fingerprint("kvferry/known-answer", "float32")
    for a, b in zip(block_keys(TOKENS, BS, FP), block_keys(TOKENS, BS, other), strict=True):
        assert a != b


@pytest.mark.parametrize("start", [1, 2, 4, 5])
def test_resuming_from_parent_equals_computing_from_scratch(start):
    full = block_keys(TOKENS, BS, FP)
    resumed = block_keys(TOKENS, BS, FP, parent=full[start - 1], start_block=start)
    assert resumed == full[start:]


def test_keys_follow_the_documented_construction():
    parent = None
    for i, key in enumerate(block_keys(TOKENS, BS, FP)):
        h = hashlib.blake2b(digest_size=KEY_BYTES, key=FP)
        h.update(parent or bytes(KEY_BYTES))
        h.update(struct.pack(f"<{BS}I", *TOKENS[i * BS : (i + 1) * BS]))
        assert key == h.digest() == chain_key(parent, TOKENS[i * BS : (i + 1) * BS], FP)
        parent = key


def test_known_answer():
    # Pinned values: if these change, every stored KV block key (and the cross-process pool) changes.
    assert FP.hex() == "606ae9d69412608039b633f5751449f3"
    keys = block_keys(list(range(10)), BS, FP)
    assert [k.hex() for k in keys] == ["027e1fbaccf61b652e7fa043052d2660", "aa03e75814dc98a7b487b00715f57a4e"]
    assert chain_key(None, [1, 2, 3, 4], FP).hex() == "7c23ba5065426fce1467a0ed9b782985"


def test_a_cache_salt_changes_every_key_and_the_engine_hashes_it_as_the_router_does():
    from kvferry.engine.block_hash import salt_key
    from kvferry.engine.block_manager import BlockManager
    from kvferry.engine.request import Request, SamplingParams

    fp = model_fingerprint("ckpt", "torch.float32")
    ids = list(range(40))
    plain = block_keys(ids, 16, fp)
    salted = block_keys(ids, 16, fp, salt_key("tenant-a"))
    assert salt_key("") is None and salt_key("a") == salt_key(b"a") != salt_key("b")
    assert not set(plain) & set(salted) and salted != block_keys(ids, 16, fp, salt_key("tenant-b"))
    req = Request("r", ids, SamplingParams(), salt_key=salt_key("tenant-a"))
    BlockManager(8, 16, fp, True).update_keys(req)
    assert req.block_keys == salted
