"""kvferry.kvpool.dataplane: the transfer header and the put answer, as raw bytes (never pickle)."""

from __future__ import annotations

import pytest
import torch

from kvferry.kvpool.dataplane import (
    ANSWER_TAG,
    GET,
    MAX_BLOCKS,
    PUT,
    Header,
    answer_tag,
    encode_answer,
    header_buffer,
)
from kvferry.kvpool.metadata import Location
from kvferry.kvpool.transfer import next_tag


def test_a_put_header_round_trips_through_a_larger_receive_buffer():
    keys = [bytes([i]) + bytes(15) for i in range(3)]  # trailing zero bytes are part of the key
    header = Header(PUT, "req-é", 1, 3, 2, keys, [7, -1, 9], [4, 0, 2**40], [False, True, False])
    buf = header_buffer()
    encoded = header.encode()
    buf[: encoded.numel()] = encoded  # a gloo receive into the fixed-size buffer
    assert Header.decode(buf) == header
    assert header.messages == 2  # 3 blocks in messages of 2


def test_a_get_header_names_slots_and_generations():
    header = Header(GET, "r", 0, 4, 64, [b"k" * 16], [3], [5])
    decoded = Header.decode(header.encode())
    assert (decoded.op, decoded.slots, decoded.generations, decoded.private) == (GET, [3], [5], [False])


def test_headers_that_cannot_be_sent_or_read_are_refused():
    with pytest.raises(ValueError, match="16 bytes"):
        Header(PUT, "r", 0, 4, 1, [b"short"]).encode()
    with pytest.raises(ValueError, match="carries"):
        Header(PUT, "r", 0, 4, 1, [b"k" * 16] * (MAX_BLOCKS + 1)).encode()
    with pytest.raises(ValueError, match="malformed"):
        Header.decode(header_buffer())  # op 0: nothing was received


def test_answers_and_transfer_tags_never_meet():
    assert encode_answer(5, [Location(b"k", "n", 2, 9), Location(b"j", "n", 0, 0)]).tolist() == [
        5,
        2,
        2,
        9,
        0,
        0,
    ]
    assert answer_tag(0) == ANSWER_TAG and answer_tag(2**29) == ANSWER_TAG
    tag = 1
    for _ in range(1000):
        tag = next_tag(tag, 1000)
        assert 0 < tag < ANSWER_TAG


def test_header_buffer_is_bytes():
    assert header_buffer().dtype == torch.uint8
