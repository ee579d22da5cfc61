"""OutputState: stop strings across token boundaries, stop tokens, lengths, incremental UTF-8 text."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvferry.engine.output import OutputState
from kvferry.engine.request import Request, RequestStatus, SamplingParams
from kvferry.model.tokenizer import IncrementalDetokenizer, Tokenizer

PIECES = ["<unk>", "<eos>", "Hello", " wor", "ld", " ST", "O", "P", " tail", "!", "OP tail", "ar"]
PIECES += ["S", "T", "ST", "TOP", " ", "x", "a", "b", "xa", " b"]
ID = {p: i for i, p in enumerate(PIECES)}
EOS = ID["<eos>"]
PROMPT = [ID["Hello"], ID[" "]]


@pytest.fixture(scope="module")
def word_tok(tmp_path_factory) -> Tokenizer:
    """WordLevel tokenizer whose decoder concatenates the pieces verbatim."""
    path = tmp_path_factory.mktemp("wordlevel")
    tok = HFTokenizer(models.WordLevel(dict(ID), unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return Tokenizer(path)


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory) -> Tokenizer:
    """Byte-level BPE with one token per byte, so multi-byte characters span several tokens."""
    path = tmp_path_factory.mktemp("bytelevel")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = HFTokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    return Tokenizer(path)


def run(tok, pieces, max_model_len=10_000, prompt=PROMPT, eos=(EOS,), **params):
    """Feed tokens like the engine does; returns (state, streamed increments, statuses)."""
    req = Request("r", list(prompt), SamplingParams(**params))
    state = OutputState(req, tok, eos, max_model_len)
    streamed: list[str] = []
    for piece in pieces:
        status = state.add_token(ID[piece] if isinstance(piece, str) else piece)
        if status is not None:
            req.status = status
        out = state.emit()
        assert out.finished == (status is not None)
        streamed.append(out.text)
        assert state.text.startswith("".join(streamed))  # nothing streamed is ever retracted
        if out.finished:
            assert out.finish_reason == req.status.finish_reason
            break
    return state, streamed


def test_tokenizer_loads_eos_from_config(word_tok):
    assert word_tok.eos_token_id == EOS
    assert word_tok.decode([ID["Hello"], ID[" wor"], ID["ld"], EOS]) == "Hello world"


def test_stop_string_split_over_three_tokens(word_tok):
    pieces = ["Hello", " wor", "ld", " ST", "O", "P", " tail", "!"]
    state, streamed = run(word_tok, pieces, stop=("STOP",), max_tokens=50)
    assert state.req.status == RequestStatus.FINISHED_STOPPED
    assert state.req.output_token_ids == [ID[p] for p in pieces[:6]]  # generation stopped at "P"
    assert state.text == "Hello world " == "".join(streamed)
    assert "S" not in "".join(streamed[:-1])  # a possible stop prefix is held back until resolved
    assert state.completion().text == "Hello world " and state.completion().finish_reason == "stop"


@pytest.mark.parametrize(
    ("pieces", "stop", "final"),
    [
        (["Hello", " ST", "OP tail", "!"], ("STOP",), "Hello "),  # text after the stop is dropped
        (["Hello", " ST", "OP tail"], ("tail", "STOP"), "Hello "),  # the earliest stop string wins
        (["Hello", " wor", "ld", " ST"], ("ld ST",), "Hello wor"),
        (["S", "TOP"], ("STOP",), ""),
        (["x", "a", " b", "!"], ("xa b",), ""),
        (["Hello", "!", "T", "T"], ("!T",), "Hello"),
    ],
)
def test_stop_strings_across_token_boundaries(word_tok, pieces, stop, final):
    state, streamed = run(word_tok, pieces, stop=stop, max_tokens=50)
    assert state.req.status == RequestStatus.FINISHED_STOPPED
    assert state.text == final == "".join(streamed)


def test_near_miss_of_stop_string_is_released(word_tok):
    state, streamed = run(word_tok, ["Hello", " ST", "ar", "!"], stop=("STOP",), max_tokens=4)
    assert state.req.status == RequestStatus.FINISHED_LENGTH
    assert state.text == "Hello STar!" == "".join(streamed)


@pytest.mark.parametrize("seed", range(6))
def test_random_streams_match_final_text(word_tok, seed):
    rng = random.Random(seed)
    stops = ("STOP", "TT", "xa b")
    vocab = [p for p in PIECES[2:] if p not in ("<eos>",)]
    for _ in range(40):
        pieces = [rng.choice(vocab) for _ in range(12)]
        state, streamed = run(word_tok, pieces, stop=stops, max_tokens=12)
        full = word_tok.decode(state.req.output_token_ids)
        assert "".join(streamed) == state.text
        assert not any(s in state.text for s in stops)
        if state.req.status == RequestStatus.FINISHED_STOPPED:
            assert full.startswith(state.text)
            assert any(full[len(state.text) :].startswith(s) for s in stops)
        else:
            assert state.req.status == RequestStatus.FINISHED_LENGTH and state.text == full


def test_stop_token_ids_stop_and_are_not_in_text(word_tok):
    state, streamed = run(word_tok, ["Hello", " wor", "!", "ld"], stop_token_ids=(ID["!"],))
    assert state.req.status.finish_reason == "stop"
    assert state.req.output_token_ids[-1] == ID["!"] and len(state.req.output_token_ids) == 3
    assert state.text == "Hello wor" == "".join(streamed)


def test_eos_stops(word_tok):
    state, _ = run(word_tok, ["Hello", EOS, "ld"], max_tokens=10)
    assert state.req.status.finish_reason == "stop" and state.text == "Hello"
    assert state.req.output_token_ids == [ID["Hello"], EOS]


def test_ignore_eos_keeps_generating(word_tok):
    state, streamed = run(word_tok, ["Hello", EOS, " wor", "ld"], max_tokens=4, ignore_eos=True)
    assert state.req.status.finish_reason == "length"
    assert len(state.req.output_token_ids) == 4
    assert state.text == "Hello world" == "".join(streamed)


def test_ignore_eos_still_honours_stop_token_ids(word_tok):
    state, _ = run(word_tok, ["Hello", EOS, "!"], ignore_eos=True, stop_token_ids=(ID["!"],))
    assert state.req.status.finish_reason == "stop" and len(state.req.output_token_ids) == 3


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_max_tokens_gives_length(word_tok, max_tokens):
    req = Request("r", PROMPT, SamplingParams(max_tokens=max_tokens))
    state = OutputState(req, word_tok, (EOS,), 10_000)
    for _ in range(max_tokens - 1):
        assert state.add_token(ID["x"]) is None
    assert state.add_token(ID["x"]) == RequestStatus.FINISHED_LENGTH
    req.status = RequestStatus.FINISHED_LENGTH
    out = state.emit()
    assert out.finished and out.finish_reason == "length" and out.text == "x" * max_tokens


def test_max_model_len_gives_length(word_tok):
    state, _ = run(word_tok, ["a"] * 10, max_model_len=len(PROMPT) + 3, max_tokens=100)
    assert state.req.status.finish_reason == "length" and len(state.req.output_token_ids) == 3


def test_incremental_detokenizer_never_emits_partial_utf8(byte_tok):
    text = "a€b🙂é!"
    ids = byte_tok.encode(text)
    assert len(ids) == len(text.encode())  # one token per byte
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("hi "))
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text
    assert deltas[1:4] == ["", "", "€"]  # 3 bytes, emitted once complete
    assert deltas[5:9] == ["", "", "", "🙂"]


def test_output_state_streams_whole_characters_and_stops_inside_them(byte_tok):
    ids = byte_tok.encode("x€y🙂z€€q")
    req = Request("r", byte_tok.encode("p"), SamplingParams(stop=("z€",), max_tokens=50))
    state = OutputState(req, byte_tok, (), 10_000)
    streamed = []
    for i in ids:
        status = state.add_token(i)
        if status is not None:
            req.status = status
        streamed.append(state.emit().text)
        if status is not None:
            break
    assert all("\ufffd" not in s for s in streamed)
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert state.text == "x€y🙂" == "".join(streamed)
    assert len(req.output_token_ids) == len("x€y🙂z€".encode())
