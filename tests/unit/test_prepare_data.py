"""prepare_shards / scripts/prepare_data.py: text in, shards out, and the text comes back."""

from __future__ import annotations

import errno
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spider_titan.data import ingest
from spider_titan.data.ingest import prepare_shards
from spider_titan.data.loader import build_bytes_dataset
from spider_titan.data.shards import HEADER_BYTES, ShardWriter, find_shards, read_metadata, read_shard
from spider_titan.data.tokenizer import decode
from spider_titan.vocab import BOS_ID, EOS_ID, VOCAB_SIZE
from tests.utils import check_ok, run_train, tiny_run

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prepare_data.py"


def _inputs(tmp_path: Path) -> tuple[list[Path], list[str]]:
    """A .jsonl, a .txt and a folder (with a file that must be skipped); returns inputs and all documents."""
    jsonl_docs = [f'json document {i}: ünïcode ✓ "quoted"\nsecond line' * (i + 1) for i in range(30)]
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
    runs = {
        name: prepare_shards(inputs, tmp_path / name, val_fraction=0.3, seed=seed)
        for name, seed in (("a", 0), ("b", 0), ("c", 1))
    }
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


def test_progress_is_logged(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(ingest, "_BATCH_BYTES", 2**20)
    line = json.dumps({"text": "x" * 10240}) + "\n"
    (tmp_path / "big.jsonl").write_text(line * 320)  # 3.1 MB of text: 4 tasks of <= 1 MB
    with caplog.at_level("INFO", logger="spider_titan"):
        prepare_shards([tmp_path / "big.jsonl"], tmp_path / "out", progress_s=0)
    lines = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    assert len(lines) == 4 and "320 docs" in lines[-1] and "(100%)" in lines[-1] and "MB/s" in lines[-1]


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


# --------------------------------------------------------------------------------------------------
# Every input format through the CLI (spider_titan.data.ingest).

PERL_FILES = {  # relative path -> text; only *.pm and *.pod are picked up with --glob '*.pm' '*.pod'
    "lib/Foo/Bar.pm": "package Foo::Bar;\nsub baz { return 'ünïcode ✓' }\n1;\n",
    "lib/Foo.pm": "package Foo;\n# " + "comment " * 40 + "\n1;\n",
    "lib/Foo.pod": "=head1 NAME\n\nFoo - a module\n\n=cut\n",
    "README.txt": "not a perl file",
    "lib/Makefile": "all:\n",
}


def _corpus(tmp_path: Path) -> tuple[dict[str, Path], dict[str, list[str]]]:
    """Inputs in every format (built here) and the documents each holds, in order."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    zstandard = pytest.importorskip("zstandard")
    import gzip

    perl = tmp_path / "perl"
    for rel, text in PERL_FILES.items():
        (perl / rel).parent.mkdir(parents=True, exist_ok=True)
        (perl / rel).write_text(text)
    pm_docs = [PERL_FILES[r] for r in sorted(PERL_FILES, key=lambda r: Path(r).parts) if r.endswith((".pm", ".pod"))]

    gz_docs = [f'gzip doc {i}: ✓ "q"\n' + "abc " * (30 * i) for i in range(9)] + [""]
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(gz_docs))

    zst_docs = [f"zstd doc {i} 🕷" * (i + 1) for i in range(6)]
    lines = "".join(json.dumps({"text": d}) + "\n\n" for d in zst_docs)  # blank lines are skipped
    (tmp_path / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))

    pq_docs = [f"parquet row {i}: " + "lorem ipsum dolor sit amet " * (i % 5 + 3) for i in range(20)]
    table = pa.table({"id": list(range(len(pq_docs))), "text": pq_docs})
    pq.write_table(table, tmp_path / "data.parquet", row_group_size=6)  # 4 row groups

    big = "a big plain file, read in ranges ✓\n" * 120  # > the test's 1000-byte chunk
    (tmp_path / "big.txt").write_text(big)

    note = "a gzipped note\n" * 10
    (tmp_path / "note.txt.gz").write_bytes(gzip.compress(note.encode()))

    names = ("docs.jsonl.gz", "docs.jsonl.zst", "data.parquet", "big.txt", "note.txt.gz")
    paths = {name: tmp_path / name for name in names}
    docs = {
        "docs.jsonl.gz": gz_docs,
        "docs.jsonl.zst": zst_docs,
        "data.parquet": pq_docs,
        "big.txt": [big],
        "note.txt.gz": [note],
    }
    return {"perl": perl, **paths}, {"perl": pm_docs, **docs}


@pytest.fixture
def small_tasks(monkeypatch):
    """Tiny task sizes, so a few KB of fixtures make many tasks (ranges, batches) for the workers."""
    monkeypatch.setattr(ingest, "_CHUNK_BYTES", 1000)
    monkeypatch.setattr(ingest, "_BATCH_BYTES", 700)
    monkeypatch.setattr(ingest, "_BATCH_FILES", 2)


def _expected_split(docs: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """The documented split rule, written out independently of ingest._write_split."""
    draws = np.random.default_rng(seed).random(len(docs))
    is_val = [val_fraction > 0 and (i == 1 or (i > 1 and draws[i] < val_fraction)) for i in range(len(docs))]
    return [d for d, v in zip(docs, is_val) if not v], [d for d, v in zip(docs, is_val) if v]


def _check_framing(folder: Path, docs: list[str]) -> None:
    ids = np.concatenate([read_shard(p) for p in find_shards(folder)])
    assert ids.size == sum(len(d.encode()) + 2 for d in docs)
    starts = np.flatnonzero(ids == BOS_ID)
    assert starts.size == len(docs) and starts[0] == 0
    assert (ids[np.append(starts[1:], ids.size) - 1] == EOS_ID).all()  # every document ends with EOS


@pytest.mark.parametrize("fmt", ["raw", "header"])
def test_every_format_round_trips_and_workers_do_not_change_the_bytes(tmp_path, small_tasks, fmt):
    paths, docs = _corpus(tmp_path)
    order = ["perl", "docs.jsonl.gz", "docs.jsonl.zst", "data.parquet", "big.txt", "note.txt.gz"]
    all_docs = [d for name in order for d in docs[name]]
    args = [
        "--input",
        *(str(paths[n]) for n in order),
        "--glob",
        "*.pm",
        "*.pod",
        "--format",
        fmt,
        "--val_fraction",
        "0.2",
        "--seed",
        "3",
        "--shard_tokens",
        "1500",
        "--progress_s",
        "0",
    ]
    for workers in (1, 2):
        _script().main([*args, "--out", str(tmp_path / f"w{workers}"), "--workers", str(workers)])

    train, val = _expected_split(all_docs, 0.2, 3)
    out = tmp_path / "w1"
    assert _decoded_documents(out / "train") == train and _decoded_documents(out / "val") == val
    _check_framing(out / "train", train)
    _check_framing(out / "val", val)
    meta = read_metadata(out)
    assert meta["format"] == fmt and meta["documents"] == len(all_docs) and meta["files"] == 3 + len(order) - 1
    assert meta["splits"]["val"]["documents"] == len(val) >= 1

    shards = sorted(p.relative_to(out) for p in out.rglob("*.bin"))
    assert len(shards) > 2
    assert shards == sorted(p.relative_to(tmp_path / "w2") for p in (tmp_path / "w2").rglob("*.bin"))
    for rel in shards:
        assert (out / rel).read_bytes() == (tmp_path / "w2" / rel).read_bytes(), rel
    assert read_metadata(tmp_path / "w2") == meta


def test_val_gets_a_document_even_with_a_tiny_fraction(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second")
    meta = prepare_shards([tmp_path], tmp_path / "out", val_fraction=1e-9)
    assert meta["splits"]["val"]["documents"] == 1
    assert _decoded_documents(tmp_path / "out" / "val") == ["second"]


@pytest.mark.parametrize("stdin_jsonl", [False, True])
def test_stdin_is_one_document_or_jsonl(tmp_path, monkeypatch, stdin_jsonl):
    docs = ["stdin line one ✓", "", "line three"]
    data = "".join(json.dumps({"body": d}) + "\n" for d in docs) if stdin_jsonl else "\n".join(docs)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data.encode())))
    args = ["--input", "-", "--out", str(tmp_path / "out"), "--val_fraction", "0.5", "--workers", "2"]
    _script().main(args + (["--stdin_jsonl", "--text_key", "body"] if stdin_jsonl else []))
    if stdin_jsonl:
        train, val = _expected_split(docs, 0.5, 0)
        assert _decoded_documents(tmp_path / "out" / "val") == val and len(val) >= 1
    else:
        train = [data]
    assert _decoded_documents(tmp_path / "out" / "train") == train


@pytest.mark.parametrize("stdin_jsonl", [False, True])
@pytest.mark.parametrize("with_a_file", [False, True])
def test_empty_standard_input_is_a_one_line_error(tmp_path, monkeypatch, stdin_jsonl, with_a_file):
    (tmp_path / "a.txt").write_text("a document that alone must not hide the empty pipe")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"")))
    inputs = ["-", str(tmp_path / "a.txt")] if with_a_file else ["-"]
    with pytest.raises(SystemExit) as info:
        _script().main(["--input", *inputs, "--out", str(tmp_path / "out")] + ["--stdin_jsonl"] * stdin_jsonl)
    message = str(info.value.code)
    assert message.startswith("prepare_data: error: standard input is empty (0 bytes)") and "\n" not in message
    assert "--input -" in message  # how to pipe a corpus in
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("stdin_jsonl", [False, True])
def test_the_script_on_empty_standard_input_prints_one_line_and_exits_1(tmp_path, stdin_jsonl):
    args = [sys.executable, str(SCRIPT), "--input", "-", "--out", str(tmp_path / "out")]
    result = subprocess.run(args + ["--stdin_jsonl"] * stdin_jsonl, stdin=subprocess.DEVNULL, capture_output=True)
    assert result.returncode == 1
    assert result.stderr.decode().startswith("prepare_data: error: standard input is empty")
    assert result.stderr.count(b"\n") == 1 and b"Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_standard_input_from_a_terminal_is_refused_before_reading(tmp_path, monkeypatch):
    class Terminal(io.TextIOWrapper):
        def isatty(self):
            return True

        def read(self, *args):
            raise AssertionError("a terminal must not be read: it waits for typing")

    monkeypatch.setattr("sys.stdin", Terminal(io.BytesIO(b"")))
    with pytest.raises(SystemExit) as info:
        _script().main(["--input", "-", "--out", str(tmp_path / "out")])
    message = str(info.value.code)
    assert message.startswith("prepare_data: error: --input - reads standard input, which is a terminal")
    assert "\n" not in message and not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["an-empty-file", "a-folder-of-empty-files", "blank-stdin-jsonl"])
def test_inputs_without_text_are_a_one_line_error_and_out_is_left_as_it_was(tmp_path, monkeypatch, case):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")  # an existing --out keeps what it held
    if case == "an-empty-file":
        (tmp_path / "empty.txt").write_bytes(b"")
        inputs, fragment = [str(tmp_path / "empty.txt")], "hold no text (its one document is empty: 0 bytes)"
    elif case == "a-folder-of-empty-files":
        (tmp_path / "docs").mkdir()
        for name in ("a.txt", "b.md", "__init__.py"):
            (tmp_path / "docs" / name).write_bytes(b"")
        inputs, fragment = [str(tmp_path / "docs")], "hold no text (all 3 documents are empty: 0 bytes)"
    else:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\n\n")))
        inputs, fragment = ["-", "--stdin_jsonl"], "the inputs ['<stdin>'] hold no documents"
    with pytest.raises(SystemExit) as info:
        _script().main(["--input", *inputs, "--out", str(out)])
    message = str(info.value.code)
    assert message.startswith("prepare_data: error: ") and "\n" not in message and fragment in message, message
    assert sorted(p.name for p in out.rglob("*")) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "the user's own file"


def test_a_failure_after_writing_removes_the_parent_folders_it_made(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")  # its document is written, then refused: no text
    with pytest.raises(ValueError, match="hold no text"):
        prepare_shards([tmp_path / "empty.txt"], tmp_path / "new" / "data" / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


def test_empty_files_among_others_are_still_documents(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "__init__.py").write_bytes(b"")
    (tmp_path / "docs" / "a.py").write_text("x = 1\n")
    meta = prepare_shards([tmp_path / "docs"], tmp_path / "out", val_fraction=0)
    assert meta["documents"] == 2
    assert sorted(_decoded_documents(tmp_path / "out")) == ["", "x = 1\n"]


def _error_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Case name -> (CLI inputs, a fragment the one-line error must hold)."""
    (tmp_path / "only_txt").mkdir()
    (tmp_path / "only_txt" / "a.txt").write_text("x")
    (tmp_path / "nokey.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    return {
        "no-match": (["--input", str(tmp_path / "only_txt"), "--glob", "*.pm"], "no input matched"),
        "missing-path": (["--input", str(tmp_path / "nope.txt")], f"{tmp_path / 'nope.txt'} does not exist"),
        "jsonl-without-key": (["--input", str(tmp_path / "nokey.jsonl")], "nokey.jsonl:2: no string 'text' field"),
        "parquet-without-column": (
            ["--input", str(tmp_path / "t.parquet"), "--text_key", "content"],
            "no column 'content'",
        ),
        "missing-pyarrow": (["--input", str(tmp_path / "t.parquet")], "pyarrow: pip install -e '.[data]'"),
        "missing-zstandard": (["--input", str(tmp_path / "d.jsonl.zst")], "zstandard: pip install -e '.[data]'"),
    }


@pytest.mark.parametrize(
    "case",
    ["no-match", "missing-path", "jsonl-without-key", "parquet-without-column", "missing-pyarrow", "missing-zstandard"],
)
def test_user_errors_are_one_line(tmp_path, monkeypatch, case):
    if case.startswith("parquet") or case == "missing-pyarrow":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "t.parquet")
    (tmp_path / "d.jsonl.zst").write_bytes(b"")
    args, fragment = _error_cases(tmp_path)[case]
    if case.startswith("missing-") and case != "missing-path":
        monkeypatch.setitem(sys.modules, case.removeprefix("missing-"), None)  # import now fails
    with pytest.raises(SystemExit) as info:
        _script().main([*args, "--out", str(tmp_path / "out"), "--workers", "2"])
    message = str(info.value.code)
    assert message.startswith("prepare_data: error: ") and "\n" not in message
    assert fragment in message, message
    assert not list((tmp_path).rglob("out/**/*.bin"))


@pytest.mark.slow
def test_training_runs_on_prepared_shards(tmp_path):
    paths, _ = _corpus(tmp_path)
    out = tmp_path / "data"
    _script().main(
        [
            "--input",
            str(paths["perl"]),
            str(paths["docs.jsonl.gz"]),
            str(paths["data.parquet"]),
            "--glob",
            "*.pm",
            "*.pod",
            "--out",
            str(out),
            "--val_fraction",
            "0.1",
            "--workers",
            "2",
        ]
    )
    proc = run_train(
        tiny_run(
            training__dataset="bytes",
            training__dataset_path=out,
            training__local_batch_size=None,  # the config's 8
            metrics__log_freq=None,
            job__dump_folder=tmp_path / "run",
        ),
        timeout=300,
    )
    check_ok(proc)


# --------------------------------------------------------------------------------------------------
# Broken inputs and unwritable outputs: one line naming the input and the fix, nothing left behind.


def _jsonl_gz(path: Path, n: int = 3000) -> Path:
    import gzip

    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": f"document {i}: " + "words " * 40}) + "\n" for i in range(n))
    return path


def _run_script(args: list[str]) -> str:
    """The one-line error of a failing main(); asserts the exit is non-zero."""
    with pytest.raises(SystemExit) as info:
        _script().main(args)
    message = str(info.value.code)
    assert info.value.code not in (0, None) and message.startswith("prepare_data: error: "), message
    assert "\n" not in message and "Traceback" not in message, message
    return message


@pytest.mark.parametrize("case", ["truncated", "not-gzip"])
def test_a_broken_gzip_input_is_named_and_nothing_is_kept(tmp_path, small_tasks, case):
    good = _jsonl_gz(tmp_path / "good.jsonl.gz").read_bytes()
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(good[: len(good) * 3 // 4] if case == "truncated" else b'{"text": "plain jsonl"}\n')
    out = tmp_path / "out"
    message = _run_script(["--input", str(bad), "--out", str(out), "--shard_tokens", "2000"])
    assert f"{bad}: " in message and f"gzip -t {bad}" in message
    assert ("truncated" if case == "truncated" else "not valid .gz data") in message
    assert not out.exists()  # the shards written before the bad block were removed, and the folders


def test_out_naming_a_file_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "out").write_text("my notes")
    message = _run_script(["--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out")])
    assert f"--out {tmp_path / 'out'} is a file" in message
    assert (tmp_path / "out").read_text() == "my notes"


class _FailingFile:
    """A shard file whose writes fail with ``err`` once ``budget`` bytes were written (a disk filling up)."""

    def __init__(self, f, err: int, budget: list[int]):
        self.f, self.err, self.budget = f, err, budget

    def write(self, data) -> int:
        self.budget[0] -= len(memoryview(data).cast("B"))
        if self.budget[0] < 0:
            raise OSError(self.err, os.strerror(self.err))
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize("err, words", [(errno.ENOSPC, "disk full"), (errno.EROFS, "read-only file system")])
def test_a_write_failure_is_named_and_no_partial_shard_is_left(tmp_path, monkeypatch, capsys, err, words):
    """The disk fills up (or turns read-only) after a few whole shards: one line names the cause,
    and neither the finished shards nor the partial one (nor the folders made) are left."""
    from spider_titan.data import shards

    budget = [40_000]  # bytes: a few 4096-token shards, then the next write fails
    monkeypatch.setattr(shards, "open", lambda *a, **k: _FailingFile(open(*a, **k), err, budget), raising=False)
    src = _jsonl_gz(tmp_path / "in.jsonl.gz")
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    for out in (tmp_path / "new", tmp_path / "keep"):
        budget[0] = 40_000
        message = _run_script(["--input", str(src), "--out", str(out), "--shard_tokens", "4096"])
        assert f"--out {out}: cannot write the shards ({words}" in message, message
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in (tmp_path / "keep").rglob("*")) == ["notes.txt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to an unprivileged user")
def test_a_read_only_out_folder_as_an_unprivileged_user(tmp_path):
    """Root ignores file modes, so the script runs with the effective uid of 'nobody' (65534) on a
    folder that user may not write: the real EACCES of mkdir, reported in one line."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="prepare-ro-"))  # outside pytest's private (0700) tmp folder
    try:
        base.chmod(0o755)
        (base / "a.txt").write_text("some text\n" * 100)
        ro = base / "ro"
        ro.mkdir(mode=0o555)
        os.seteuid(65534)
        try:
            message = _run_script(["--input", str(base / "a.txt"), "--out", str(ro / "out")])
        finally:
            os.seteuid(0)
        assert f"--out {ro / 'out'}: cannot write the shards (permission denied" in message, message
        assert "choose an --out folder you can write to" in message
        assert list(ro.iterdir()) == []
    finally:
        shutil.rmtree(base)


def test_abort_removes_finished_and_partial_shards(tmp_path):
    writer = ShardWriter(tmp_path, "train", shard_tokens=10, header=True)
    writer.add(np.arange(25, dtype=np.uint16))
    assert [p.name for p in writer.paths] == ["train_000000.bin", "train_000001.bin"]
    assert (tmp_path / "train_000002.bin.partial").exists() and not (tmp_path / "train_000002.bin").exists()
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_help_shows_the_real_workers_default(capsys):
    with pytest.raises(SystemExit):
        _script().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {ingest.default_workers()}:" in text and "min(4, CPUs)" not in text
