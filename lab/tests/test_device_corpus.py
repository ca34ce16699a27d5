"""lab/corpus/device_corpus.py on folders made here: the same bytes twice, each source's cap, the documents it
leaves out or cuts, and shards that prepare_data makes of it."""

from __future__ import annotations

import gzip
import json
import lzma
import shutil

import numpy as np
import pytest

from lab.corpus import device_corpus as dc
from spider_titan.data.ingest import prepare_shards
from spider_titan.data.shards import find_shards, read_shard
from spider_titan.data.tokenizer import decode
from spider_titan.vocab import BOS_ID


@pytest.fixture
def tree(tmp_path, monkeypatch):
    docs, code, held = tmp_path / "doc", tmp_path / "code", tmp_path / "held"
    for i in range(40):
        (docs / f"pkg{i}").mkdir(parents=True)
        (docs / f"pkg{i}" / "copyright").write_text(f"package {i} licence text\n" * 30)
        (docs / f"pkg{i}" / "changelog.Debian.gz").write_bytes(gzip.compress(f"pkg{i} (1.{i}) stable\n".encode() * 40))
        (docs / f"pkg{i}" / "logo.png").write_bytes(b"\x89PNG" * 100)  # no pattern: not read
    (docs / "pkg0" / "README").write_bytes(b"binary \x00 inside" * 50)  # NUL: left out
    (docs / "pkg1" / "README").write_bytes("caf\xe9 latin-1 text ".encode("latin-1") * 50)  # not UTF-8: left out
    (docs / "pkg2" / "README").write_text("short")  # under 200 characters: left out
    code.mkdir()
    for i in range(10):
        (code / f"h{i}.h").write_text("".join(f"#define NAME_{i}_{j} {j}\n" for j in range(2000)))  # ~40 KB each
    held.mkdir()
    for i in range(5):
        (held / f"page{i}.txt").write_text(f"held-out page {i}\n" * 50)
    sources = (
        dc.Source("docs", (str(docs),), ("changelog*", "copyright", "readme*"), 0.05, "package docs"),
        dc.Source("headers", (str(code),), ("*.h",), 0.1, "headers"),
        dc.Source("absent", (str(tmp_path / "nothing here"),), ("*",), 1, "a folder this machine lacks"),
    )
    monkeypatch.setattr(dc, "SOURCES", sources)
    monkeypatch.setattr(dc, "HELD_OUT", dc.Source("held", (str(held),), ("*.txt",), 1, "held-out pages"))
    return tmp_path


def _documents(folder):
    ids = np.concatenate([read_shard(p) for p in find_shards(folder)])
    return [decode(d) for d in np.split(ids, np.flatnonzero(ids == BOS_ID))[1:]]


def test_recipe_is_reproducible_capped_and_prepares(tree):
    if shutil.which("groff") is None:
        pytest.skip("the recipe needs groff for its held-out manual pages")
    out1, out2 = tree / "out1", tree / "out2"
    assert dc.main(["--out", str(out1), "--doc_kb", "20"]) == 0
    assert dc.main(["--out", str(out2), "--doc_kb", "20"]) == 0
    for name in ("train.jsonl.xz", "held_out.jsonl.xz"):
        assert (out1 / name).read_bytes() == (out2 / name).read_bytes(), name
    manifest = json.loads((out1 / "manifest.json").read_text())
    train, held = manifest["files"]
    by_source = {s["source"]: s for s in train["sources"]}
    assert manifest["empty_sources"] == ["absent"]
    # a source stops at the first document past its cap: at most one document over it
    assert 0.05 <= by_source["docs"]["text_mb"] < 0.05 + 0.002, by_source["docs"]
    # headers cut to just under 20 KB each: five fall short of the 0.1 MB cap, the sixth passes it
    assert 0.1 <= by_source["headers"]["text_mb"] <= 0.12 and by_source["headers"]["documents"] == 6
    assert held["sources"][0]["documents"] == 5
    lines = [json.loads(x) for x in lzma.decompress((out1 / "train.jsonl.xz").read_bytes()).decode().splitlines()]
    texts = [r["text"] for r in lines]
    assert not any("binary" in t or "latin-1" in t or t.startswith("short") for t in texts)
    assert all(len(t.encode()) <= 20_000 and t.endswith("\n") for t in texts)  # headers cut at a line end
    assert {r["source"] for r in lines} == {"docs", "headers"}
    assert train["sha256"] == __import__("hashlib").sha256((out1 / "train.jsonl.xz").read_bytes()).hexdigest()
    prepare_shards([out1 / "train.jsonl.xz"], tree / "shards", val_fraction=0.1, workers=1)
    assert _documents(tree / "shards" / "train") + _documents(tree / "shards" / "val") != []
    assert sorted(_documents(tree / "shards" / "train") + _documents(tree / "shards" / "val")) == sorted(texts)


def test_a_bad_scale_is_one_line(tree, capsys):
    assert dc.main(["--out", str(tree / "o"), "--scale", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("device_corpus: --scale 0") and "\n" not in err
