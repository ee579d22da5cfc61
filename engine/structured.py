"""Structured outputs: sampling constrained to a grammar, with llguidance.

A request asks for one constraint, `(kind, value)`:

    json_schema  a JSON schema (JSON text)      json_object  any JSON object (value "")
    regex        a regular expression           choice       one of a JSON list of strings
    grammar      a Lark or GBNF grammar

`Grammars` turns it into an llguidance matcher for one tokenizer: compiled once per distinct constraint
(an LRU cache of matchers in their start state; each request gets a copy), off the engine thread where
the caller can (the workers compile in their gRPC handlers; the router compiles to refuse a bad one with
a 400 before anything runs). A constraint the library refuses raises StructuredOutputError with its
message. Each step, `fill_mask` writes the tokens a matcher allows next into a row of the batch's
bitmask (`masks` unpacks it for the sampler), and the request's output state feeds every token it
keeps to its matcher; a matcher that is stopped (the grammar is complete) ends the request with
"stop". The matcher's state is never sent anywhere: a worker that takes a request over rebuilds it by
replaying the request's output tokens (`replay`).

Why llguidance (measured against xgrammar 0.2.8 on this project's tokenizer, see the README): it
refuses the schema features it cannot enforce (`not`, `if/then`, unknown formats) with a clear message,
where xgrammar compiled them silently and did not enforce them; it keeps special tokens such as
<|im_end|> out of JSON strings without a hand-built vocabulary; it has no dependencies (xgrammar needs
torch, triton, transformers and apache-tvm-ffi); its masks cost 3-10 us more per sequence-step on JSON.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance as llg
import torch

from kvferry.engine.request import STRUCTURED_KINDS as KINDS
from kvferry.engine.request import InvalidRequestError

CACHE_SIZE = 256  # distinct constraints kept compiled
# JSON comes out in one layout, json.dumps's (", " and ": ", no other whitespace): a model cannot spend
# its tokens on whitespace the schema allows but nobody reads
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(InvalidRequestError):
    """A constraint the grammar library refuses (the message says why)."""


def grammar_of(kind: str, value: str) -> str:
    """The llguidance grammar of a constraint (not compiled: `Grammars.matcher` compiles it)."""
    try:
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_LAYOUT)
        if kind == "json_schema":
            schema = json.loads(value)
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputError("a JSON schema must be an object")
            return llg.LLMatcher.grammar_from_json_schema(schema, JSON_LAYOUT)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            choices = json.loads(value)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise StructuredOutputError("choice must be a list of non-empty strings")
            return llg.grammar_from("choice", choices)
        if kind == "grammar":
            return llg.grammar_from("grammar", value)
    except (ValueError, TypeError) as err:  # not JSON; a GBNF grammar that does not convert
        raise StructuredOutputError(str(err)) from None
    raise StructuredOutputError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")


class Grammars:
    """Compiles and caches constraints for one tokenizer (thread-safe)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=self.eos_ids or None)
        self._cache: OrderedDict[tuple[str, str], llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, kind: str, value: str) -> llg.LLMatcher:
        """A fresh matcher of the constraint (raises StructuredOutputError)."""
        key = (kind, value)
        with self._lock:
            start = self._cache.get(key)
            if start is not None:
                self._cache.move_to_end(key)
                return start.deep_copy()
        start = llg.LLMatcher(self._tokenizer, grammar_of(kind, value), log_level=0)
        if start.is_error():
            raise StructuredOutputError(start.get_error())
        with self._lock:
            self._cache[key] = start
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return start.deep_copy()

    def check(self, kind: str, value: str) -> None:
        """Raise StructuredOutputError if the constraint does not compile (and keep it compiled)."""
        self.matcher(kind, value)


def replay(matcher: llg.LLMatcher, tokens: Sequence[int]) -> None:
    """Bring a fresh matcher to where a request's output stands (tokens made by an earlier worker)."""
    if tokens and not matcher.consume_tokens(list(tokens)):
        raise StructuredOutputError(f"the output so far does not match the constraint: {matcher.get_error()}")


def fill_mask(matchers: Sequence[llg.LLMatcher], vocab_size: int) -> torch.Tensor:
    """The bitmask [N, ceil(V / 32)] int32 of the tokens each matcher allows next (bit t of word t // 32)."""
    words = (vocab_size + 31) // 32
    bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        view = bitmask[row]
        matcher.unsafe_compute_mask_ptr(view.data_ptr(), words * 4)
    return bitmask


_BITS = torch.arange(32, dtype=torch.int32)


def masks(bitmask: torch.Tensor, vocab_size: int, eos_ids: Sequence[int] = ()) -> torch.Tensor:
    """bool [N, V]: the bitmask unpacked. A row that allows nothing (a matcher in its error state) allows
    EOS, which ends its request."""
    out = ((bitmask.unsqueeze(-1) >> _BITS) & 1).flatten(1)[:, :vocab_size].bool()
    empty = ~out.any(-1)
    if eos_ids and empty.any():
        out[empty.nonzero().flatten()[:, None], torch.tensor(list(eos_ids))] = True
    return out
