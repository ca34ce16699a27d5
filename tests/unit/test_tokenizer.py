"""The byte tokenizer: encode/decode round trips and the handling of specials and bad UTF-8."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spider_titan.data.tokenizer import decode, encode, encode_bytes
from spider_titan.vocab import BOS_ID, EOS_ID, PAD_ID

TEXTS = ["", "hello world", "héllo wörld — ünïcode ✓ 日本語 🙂", "line\nbreaks\tand\x00nul"]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_is_bos_bytes_eos(text):
    assert encode(text) == [BOS_ID, *text.encode("utf-8"), EOS_ID]
    np.testing.assert_array_equal(encode_bytes(text.encode("utf-8")), np.array(encode(text), dtype=np.uint16))
    assert encode_bytes(text.encode("utf-8")).dtype == np.uint16


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(text):
    ids = encode(text)
    assert decode(ids) == text
    assert decode(np.array(ids, dtype=np.uint16)) == text
    assert decode(torch.tensor(ids)) == text
    assert decode(iter(ids)) == text


def test_decode_drops_specials_and_ignore_index():
    raw = list(b"ab")
    assert decode([PAD_ID, BOS_ID, raw[0], EOS_ID, -100, raw[1], 271]) == "ab"


def test_decode_replaces_invalid_utf8():
    data = "é".encode()[:1] + b"ok" + b"\xff"
    assert decode(list(data)) == data.decode("utf-8", errors="replace")
