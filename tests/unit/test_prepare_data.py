"""prepare_shards / scripts/prepare_data.py: text in, shards out, and the text comes back."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from spider_titan.data.loader import build_bytes_dataset
from spider_titan.data.shards import HEADER_BYTES, find_shards, prepare_shards, read_metadata, read_shard
from spider_titan.data.tokenizer import decode
from spider_titan.models.common import BOS_ID, VOCAB_SIZE

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prepare_data.py"


def _inputs(tmp_path: Path) -> tuple[list[Path], list[str]]:
    """A .jsonl, a .txt and a folder (with a file that must be skipped); returns inputs and all documents."""
    jsonl_docs = [f"json document {i}: ünïcode ✓ \"quoted\"\nsecond line" * (i + 1) for i in range(30)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in jsonl_docs) + "\n")
    txt = "plain text file\n" * 50
    (tmp_path / "b.txt").write_text(txt)
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "z.md").write_text("# markdown\n")
    (folder / "c.py").write_text("print('hi')\n")
    (folder / "skip.bin").write_bytes(b"\x00\x01")
    inputs = [tmp_path / "a.jsonl", tmp_path / "b.txt", folder]
    return inputs, [*jsonl_docs, txt, "print('hi')\n", "# markdown\n"]


def _decoded_documents(folder: Path) -> list[str]:
    ids = np.concatenate([read_shard(p) for p in find_shards(folder)])
    return [decode(d) for d in np.split(ids, np.flatnonzero(ids == BOS_ID))[1:]]


@pytest.mark.parametrize("fmt", ["header", "raw"])
def test_round_trip_gives_back_the_text(tmp_path, fmt):
    inputs, docs = _inputs(tmp_path)
    out = tmp_path / "out"
    meta = prepare_shards(inputs, out, val_fraction=0.2, shard_tokens=500, fmt=fmt, seed=1)

    train, val = _decoded_documents(out / "train"), _decoded_documents(out / "val")
    assert sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d in train] and val == [d for d in docs if d in val]  # order kept
    assert docs[0] in train and docs[1] in val and len(val) >= 2

    assert meta == read_metadata(out)
    assert meta["format"] == fmt and meta["vocab_size"] == VOCAB_SIZE and meta["documents"] == len(docs)
    for split, texts in (("train", train), ("val", val)):
        shards = find_shards(out / split)
        tokens = sum(read_shard(p).size for p in shards)
        assert meta["splits"][split] == {"documents": len(texts), "tokens": tokens, "shards": len(shards)}
        assert tokens == sum(len(t.encode()) + 2 for t in texts)
        assert all(read_shard(p).size <= 500 for p in shards)
        header_bytes = HEADER_BYTES if fmt == "header" else 0
        assert all(p.stat().st_size == header_bytes + 2 * read_shard(p).size for p in shards)

    loaded = build_bytes_dataset(str(out), split="val", seed=0)
    assert loaded.num_tokens == meta["splits"]["val"]["tokens"]


def test_split_depends_on_the_seed_only(tmp_path):
    inputs, _ = _inputs(tmp_path)
    runs = {name: prepare_shards(inputs, tmp_path / name, val_fraction=0.3, seed=seed)
            for name, seed in (("a", 0), ("b", 0), ("c", 1))}
    assert _decoded_documents(tmp_path / "a" / "val") == _decoded_documents(tmp_path / "b" / "val")
    assert _decoded_documents(tmp_path / "a" / "val") != _decoded_documents(tmp_path / "c" / "val")
    assert runs["a"]["splits"] == runs["b"]["splits"]


def test_zero_val_fraction_writes_train_only(tmp_path):
    inputs, docs = _inputs(tmp_path)
    meta = prepare_shards(inputs, tmp_path / "out", val_fraction=0.0)
    assert meta["splits"]["val"]["documents"] == 0
    assert sorted(_decoded_documents(tmp_path / "out" / "train")) == sorted(docs)


def test_refuses_to_mix_with_existing_shards(tmp_path):
    inputs, _ = _inputs(tmp_path)
    prepare_shards(inputs, tmp_path / "out")
    with pytest.raises(ValueError, match="already holds shards"):
        prepare_shards(inputs, tmp_path / "out")


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        prepare_shards([tmp_path / "bad.jsonl"], tmp_path / "out")


def test_inputs_without_documents_are_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no documents"):
        prepare_shards([tmp_path / "empty.jsonl"], tmp_path / "out")


def test_progress_is_logged(tmp_path, caplog):
    line = json.dumps({"text": "x" * 10240}) + "\n"
    (tmp_path / "big.jsonl").write_text(line * 320)  # 3.1 MB of text
    with caplog.at_level("INFO", logger="spider_titan"):
        prepare_shards([tmp_path / "big.jsonl"], tmp_path / "out", progress_mb=1)
    assert sum("MB read" in r.getMessage() for r in caplog.records) == 3


def _script():
    spec = importlib.util.spec_from_file_location("prepare_data_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_writes_the_layout(tmp_path):
    inputs, docs = _inputs(tmp_path)
    out = tmp_path / "out"
    _script().main(["--input", *map(str, inputs), "--out", str(out), "--format", "raw", "--shard_tokens", "300"])
    assert read_metadata(out)["format"] == "raw"
    assert sorted(_decoded_documents(out / "train") + _decoded_documents(out / "val")) == sorted(docs)


@pytest.mark.parametrize("make_folder", [True, False])
def test_script_without_inputs_exits_with_one_line(tmp_path, capsys, make_folder):
    empty = tmp_path / "empty"
    if make_folder:
        empty.mkdir()
    with pytest.raises(SystemExit) as info:
        _script().main(["--input", str(empty), "--out", str(tmp_path / "out")])
    message = str(info.value.code)
    assert info.value.code != 0 and "\n" not in message and str(empty) in message
    assert not (tmp_path / "out").exists()
