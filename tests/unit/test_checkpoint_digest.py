"""The checkpoint fingerprint covers every weight byte, and is hashed once per content."""

from __future__ import annotations

import json
import os

from kvferry.model.loader import DIGEST_CACHE, checkpoint_digest


def _checkpoint(tmp_path, payload: bytes):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (tmp_path / "model.safetensors").write_bytes(payload)
    return tmp_path


def test_a_change_in_the_middle_of_the_weights_changes_the_digest(tmp_path):
    payload = bytearray(os.urandom(5 << 20))  # 5 MiB: the middle is past any first/last MiB sample
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = checkpoint_digest(_checkpoint(tmp_path / "a", bytes(payload)))
    payload[len(payload) // 2] ^= 0xFF
    b = checkpoint_digest(_checkpoint(tmp_path / "b", bytes(payload)))
    assert a != b


def test_the_digest_is_cached_beside_the_checkpoint_and_follows_the_files(tmp_path):
    model = _checkpoint(tmp_path, b"\x01" * 4096)
    first = checkpoint_digest(model)
    cached = json.loads((model / DIGEST_CACHE).read_text())
    assert cached["digest"] == first
    # a cached digest is what the next load answers, without reading the weights again
    (model / DIGEST_CACHE).write_text(json.dumps({**cached, "digest": "from-the-cache"}))
    assert checkpoint_digest(model) == "from-the-cache"
    # new weights (another size or mtime) are hashed again
    (model / "model.safetensors").write_bytes(b"\x02" * 4097)
    again = checkpoint_digest(model)
    assert again not in (first, "from-the-cache")
    assert json.loads((model / DIGEST_CACHE).read_text())["digest"] == again


def test_a_model_directory_that_takes_no_lock_file_is_hashed_without_a_cache(tmp_path):
    model = _checkpoint(tmp_path, b"\x03" * 4096)
    expected = checkpoint_digest(model)
    for name in (DIGEST_CACHE, DIGEST_CACHE + ".lock"):
        (model / name).unlink()
    (model / (DIGEST_CACHE + ".lock")).mkdir()  # cannot be opened as a file, as in a read-only directory
    assert checkpoint_digest(model) == expected
    assert not (model / DIGEST_CACHE).exists()
