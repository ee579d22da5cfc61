"""Content-addressed block keys: key(i) = H(key(i-1), tokens of block i, model fingerprint).

The engine's prefix cache is keyed by them, and so is everything that holds KV for it elsewhere (the
pool, the router's routing view), which import them from here. A key names the KV of one full block *and
everything before it*, so equal keys mean equal KV. The fingerprint covers the checkpoint, the KV's
numerics and the KV layout version: a mismatch is a cache miss, never wrong KV. Hashing is blake2b over
fixed-width little-endian bytes, stable across processes and machines.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 16
KV_LAYOUT_VERSION = 1


def model_fingerprint(checkpoint_id: str, numerics: str, layout_version: int = KV_LAYOUT_VERSION) -> bytes:
    """`checkpoint_id`: the weights' digest (model.loader.checkpoint_digest); `numerics`: the dtype the
    KV is computed in, and the cache's where it differs ("torch.bfloat16/kv-torch.float32")."""
    text = f"{checkpoint_id}|{numerics}|kv-layout-v{layout_version}"
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def salt_key(cache_salt: str | bytes | None) -> bytes | None:
    """The parent of a salted request's first block key (vLLM's per-request `cache_salt`): requests with
    different salts share no block key, so one tenant cannot find another's cached prefix. None: unsalted."""
    if not cache_salt:
        return None
    data = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt
    return hashlib.blake2b(b"kvferry-cache-salt|" + data, digest_size=KEY_BYTES).digest()


def chain_key(parent: bytes | None, block_tokens: Sequence[int], fingerprint: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES, key=fingerprint)
    h.update(parent or b"\x00" * KEY_BYTES)
    h.update(struct.pack(f"<{len(block_tokens)}I", *block_tokens))
    return h.digest()


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: bytes,
    parent: bytes | None = None,
    start_block: int = 0,
) -> list[bytes]:
    """Keys of the full blocks of `token_ids` from block `start_block` on; the partial tail has no key.

    `parent` is the key of block `start_block - 1` (None when starting at block 0).
    """
    keys = []
    for begin in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent = chain_key(parent, token_ids[begin : begin + block_size], fingerprint)
        keys.append(parent)
    return keys
