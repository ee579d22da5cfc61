"""The Python standard library sources as a text corpus, split into a training and a held-out part.

The built-in tokenizer is trained on these sources (`create.train_tokenizer`), the `trained` model on
the training split (`train.py`), and `kvferry eval` measures perplexity on the held-out split. The split
is by file, fixed by each file's path relative to the standard library (a hash), so it is the same on
every machine with the same Python; about one file in HELD_OUT_EVERY is held out.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

SPLITS = ("train", "heldout")
HELD_OUT_EVERY = 20
# directories whose files are not ordinary library code (vendored packages, test data, generated tables)
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relpath: str) -> bool:
    digest = hashlib.blake2b(relpath.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELD_OUT_EVERY == 0


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    """The split's source files, sorted by relative path (the order training reads them in)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    root = root or stdlib_dir()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        if is_held_out(rel.as_posix()) == (split == "heldout"):
            files.append((rel.as_posix(), path))
    return [p for _, p in sorted(files)]


def token_stream(tokenizer, split: str, eos_id: int, max_tokens: int | None = None) -> list[int]:
    """The split's files tokenized and joined, each followed by `eos_id` (at most `max_tokens`).

    `tokenizer`: a `tokenizers.Tokenizer` or kvferry's `Tokenizer` (each has `encode_batch`)."""
    files = corpus_files(split)
    ids: list[int] = []
    for at in range(0, len(files), 32):  # batches: the Rust encoder runs them in parallel
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files[at : at + 32]]
        for encoded in tokenizer.encode_batch(texts, add_special_tokens=False):
            ids += encoded if isinstance(encoded, list) else encoded.ids
            ids.append(eos_id)
        if max_tokens is not None and len(ids) >= max_tokens:
            return ids[:max_tokens]
    return ids
