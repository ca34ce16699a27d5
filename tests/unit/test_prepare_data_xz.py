""".xz inputs (the standard library's lzma, no extra package): the same shards as the plain input, and a
corrupt or truncated file is one line naming it."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import numpy as np
import pytest

from spider_titan.data.ingest import prepare_shards, source_kind
from spider_titan.data.shards import find_shards, read_shard


def _shards(folder: Path) -> np.ndarray:
    return np.concatenate([read_shard(p) for p in find_shards(folder)])


def test_xz_jsonl_and_xz_file_give_the_plain_shards(tmp_path):
    docs = [f"xz document {i}: ünïcode ✓\n" + "lorem ipsum " * (7 * i) for i in range(25)]
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    (tmp_path / "plain.jsonl").write_text(lines, encoding="utf-8")
    (tmp_path / "packed.jsonl.xz").write_bytes(lzma.compress(lines.encode()))
    (tmp_path / "note.txt").write_text("one document\n" * 40)
    (tmp_path / "note.txt.xz").write_bytes(lzma.compress((tmp_path / "note.txt").read_bytes()))
    assert source_kind("packed.jsonl.xz") == ("jsonl", "xz") and source_kind("note.TXT.XZ") == ("compressed", "xz")
    for name, inputs in (
        ("plain", ["plain.jsonl", "note.txt"]),
        ("xz", ["packed.jsonl.xz", "note.txt.xz"]),
    ):
        prepare_shards([tmp_path / i for i in inputs], tmp_path / name, val_fraction=0.2, workers=2)
    for split in ("train", "val"):
        assert np.array_equal(_shards(tmp_path / "plain" / split), _shards(tmp_path / "xz" / split)), split


@pytest.mark.parametrize("damage", ["truncated", "not xz"])
def test_a_broken_xz_file_is_one_error_naming_it(tmp_path, damage):
    data = lzma.compress(("".join(json.dumps({"text": "x" * 50}) + "\n" for _ in range(200))).encode())
    bad = tmp_path / "bad.jsonl.xz"
    bad.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"plain bytes, not an xz stream" * 10)
    with pytest.raises(ValueError) as info:
        prepare_shards([bad], tmp_path / "out", val_fraction=0.1, workers=1)
    message = str(info.value)
    assert str(bad) in message and "xz -t" in message and "\n" not in message, message
