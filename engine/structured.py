"""Structured outputs: sampling constrained to a grammar, with llguidance.

A request asks for one constraint, `(kind, value)`:

    json_schema  a JSON schema (JSON text)      json_object  any JSON object (value "")
    regex        a regular expression           choice       one of a JSON list of strings
    grammar      a Lark or GBNF grammar

`Grammars` turns it into an llguidance matcher for one tokenizer: compiled once per distinct constraint
(an LRU cache of matchers in their start state; each request gets a copy), never on the engine thread:
the router compiles to refuse a bad one with a 400 before anything runs, the workers in their gRPC
handlers, both through `compile_off_loop` (a small pool of its own, so a flood of constraints queues
there, bounded, and takes no thread that Redis or tokenizing needs). A constraint the library refuses
raises StructuredOutputError with its message.

A grammar cannot hurt other requests: llguidance builds its lexer lazily, at the first masks, so
compiling here also computes the first mask and one step past it (`_warm`), under `LIMITS` (the fuel
a lexer may burn at its start and in any one step, its states: ~1-2 kB each): a constraint over them,
or slower than COMPILE_BUDGET_S, is refused before any prefill, with the limit it passed. Past that,
every mask step the engine thread computes for it is bounded by the step fuel.

Each step, `fill_mask` writes the tokens a matcher allows next into a row of the batch's bitmask
(`masks` unpacks it for the sampler), and the request's output state feeds every token it keeps to
its matcher; a matcher that is stopped (the grammar is complete) ends the request with "stop", one
that fails (a limit passed mid-generation) ends it with "error" and the library's message: the client
gets an error, never text that does not match its constraint. The matcher's state is never sent
anywhere: a worker that takes a request over rebuilds it by replaying the request's output tokens
(`replay`).

Why llguidance (measured against xgrammar 0.2.8 on this project's tokenizer, see the README): it
refuses the schema features it cannot enforce (`not`, `if/then`, unknown formats) with a clear message,
where xgrammar compiled them silently and did not enforce them; it keeps special tokens such as
<|im_end|> out of JSON strings without a hand-built vocabulary; it has no dependencies (xgrammar needs
torch, triton, transformers and apache-tvm-ffi); its masks cost 3-10 us more per sequence-step on JSON.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import llguidance as llg
import torch

from kvferry.engine.request import STRUCTURED_KINDS as KINDS
from kvferry.engine.request import InvalidRequestError

CACHE_SIZE = 128  # distinct constraints kept compiled
# llguidance's budget for one grammar (its defaults let one regex take seconds of an engine step and
# ~0.5 GB): lexer fuel at the start (~50k/ms) and per mask step (~14k/ms: a few ms at most on the
# engine thread), its lexer states (memory: ~1-2 kB each), the grammar's size; errors name no state
LIMITS = {
    "initial_lexer_fuel": 200_000,
    "step_lexer_fuel": 50_000,
    "step_max_items": 20_000,
    "max_lexer_states": 20_000,
    "max_grammar_size": 200_000,
    "verbose_errors": False,
}
COMPILE_BUDGET_S = 2.0  # the wall time a constraint may take to compile and warm (then: refused)
COMPILE_THREADS = 2  # the pool constraints compile in (per process)
COMPILE_QUEUE = 32  # constraints waiting to compile at most (more: RESOURCE_EXHAUSTED, retry)
# JSON comes out in one layout, json.dumps's (", " and ": ", no other whitespace): a model cannot spend
# its tokens on whitespace the schema allows but nobody reads
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(InvalidRequestError):
    """A constraint the grammar library refuses (the message says why)."""


class CompilerBusy(RuntimeError):
    """More constraints are waiting to compile than COMPILE_QUEUE: try again shortly."""


def first_line(message: str) -> str:
    """llguidance's message without the parser state it may append."""
    return message.strip().split("\n", 1)[0].strip()


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

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int], limits: dict | None = None
    ):
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=self.eos_ids or None)
        self._limits = llg.LLParserLimits(**(LIMITS if limits is None else limits))
        self._cache: OrderedDict[tuple[str, str], llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, kind: str, value: str) -> llg.LLMatcher | None:
        """A fresh matcher of a constraint compiled already, else None (no work)."""
        key = (kind, value)
        with self._lock:
            start = self._cache.get(key)
            if start is None:
                return None
            self._cache.move_to_end(key)
            return start.deep_copy()

    def matcher(self, kind: str, value: str) -> llg.LLMatcher:
        """A fresh matcher of the constraint (raises StructuredOutputError): compiled, and warmed within
        the budget, on first use."""
        fresh = self.cached(kind, value)
        if fresh is not None:
            return fresh
        t0 = time.monotonic()
        start = llg.LLMatcher(self._tokenizer, grammar_of(kind, value), log_level=0, limits=self._limits)
        if start.is_error():
            raise StructuredOutputError(first_line(start.get_error()))
        self._warm(start)
        took = time.monotonic() - t0
        if took > COMPILE_BUDGET_S:
            raise StructuredOutputError(
                f"the constraint took {took:.1f} s to compile, over the budget of {COMPILE_BUDGET_S:g} s"
            )
        with self._lock:
            self._cache[(kind, value)] = start
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return start.deep_copy()

    def _warm(self, start: llg.LLMatcher) -> None:
        """Build what llguidance builds lazily, here rather than on the engine thread: the first mask
        (in `start` itself), then, on a copy, one step on (the first token allowed, and the mask after
        it). A limit passed on the way refuses the constraint (StructuredOutputError naming it)."""
        words = (self.vocab_size + 31) // 32
        mask = fill_mask([start], self.vocab_size)
        if start.is_error():
            raise StructuredOutputError(f"over the grammar budget: {first_line(start.get_error())}")
        allowed = masks(mask, self.vocab_size)[0].nonzero().flatten().tolist()
        step = [t for t in allowed if t not in self.eos_ids][:1]
        if not step or start.is_stopped():
            return
        probe = start.deep_copy()
        probe.consume_token(step[0])
        if not probe.is_error() and not probe.is_stopped():
            scratch = torch.empty(words, dtype=torch.int32)  # (held: llguidance writes into it)
            probe.unsafe_compute_mask_ptr(scratch.data_ptr(), words * 4)
        if probe.is_error():
            raise StructuredOutputError(f"over the grammar budget: {first_line(probe.get_error())}")

    def check(self, kind: str, value: str) -> None:
        """Raise StructuredOutputError if the constraint does not compile (and keep it compiled)."""
        self.matcher(kind, value)


_pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
_waiting = 0  # compiles submitted to the pool and not finished (the event loop's thread counts them)


async def compile_off_loop(grammars: Grammars, kind: str, value: str, then=None):
    """`grammars.matcher(kind, value)` (then `then(matcher)`, if given, in the same thread), returned: a
    cached constraint at once (without `then`), else in the compile pool: CompilerBusy when
    COMPILE_QUEUE calls already wait there."""
    global _waiting
    if then is None:
        fresh = grammars.cached(kind, value)
        if fresh is not None:
            return fresh
    if _waiting >= COMPILE_QUEUE:
        raise CompilerBusy(f"{_waiting} constraints are compiling here: try again shortly")
    _waiting += 1
    try:

        def build():
            matcher = grammars.matcher(kind, value)
            return matcher if then is None else then(matcher)

        return await asyncio.get_running_loop().run_in_executor(_pool, build)
    finally:
        _waiting -= 1


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
