"""scripts/evaluate.py from its command line: two exports scored on the same val windows, one Spider at two
loop counts, and its usual mistakes each refused in one line (exit 1 or 2, no traceback) before any work.

The script runs in this process as ``python scripts/evaluate.py`` runs it (``runpy`` with ``__main__``),
so the table costs no interpreter start per case; :func:`run_script` reports what a shell would see."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from spider_titan import registry
from spider_titan.checkpoint.export import write_export
from spider_titan.checkpoint.layout import ModelIdentity
from spider_titan.components.builder import materialize
from spider_titan.data.shards import write_shard
from tests.utils import REPO

SCRIPT = REPO / "scripts" / "evaluate.py"


def tiny_export(name: str, out: Path) -> Path:
    """A freshly initialised debug model of ``name`` (seed 0) written as an fp32 export."""
    torch.manual_seed(0)
    spec = registry.get("model", name)
    args = spec.flavors["debug"]
    model = spec.build_on_meta(args)
    materialize(model, torch.device("cpu"), seed=0)
    return write_export(model.state_dict(), ModelIdentity.of(name, "debug", args), out, dtype=torch.float32)


def tiny_data(out: Path, n_bytes: int = 4 * 64 + 1) -> Path:
    """A bytes folder (train/ and val/ shards of random bytes) of ``n_bytes`` per split."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        write_shard(out / split / "part_0.bin", rng.integers(0, 256, n_bytes).astype(np.uint16))
    return out


def run_script(target: str | Path, argv: list[str], *, module: bool = False) -> tuple[int, str, str]:
    """``python target argv`` (``python -m target`` with ``module``) in this process: (exit status, stdout,
    stderr) as a shell sees them; an exception other than SystemExit prints its traceback, as Python does."""
    out, err = io.StringIO(), io.StringIO()
    old = sys.argv
    sys.argv = [str(target), *argv]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if module:
                    runpy.run_module(str(target), run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(str(target), run_name="__main__")
            except SystemExit as e:
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                    code = 1
                else:
                    code = e.code or 0
            except Exception:  # noqa: BLE001 (what Python would print: the traceback the table must not see)
                import traceback

                traceback.print_exc()
                code = 1
    finally:
        sys.argv = old
    return code, out.getvalue(), err.getvalue()


def assert_one_line(code: int, err: str, expect: str) -> None:
    """A refusal: exit 1 or 2, stderr exactly one line holding ``expect``, no traceback."""
    lines = err.strip().splitlines()
    assert code in (1, 2) and "Traceback" not in err and len(lines) == 1, (code, err)
    assert expect in lines[0], (expect, lines[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("evaluate")
    (root / "empty").mkdir()
    (root / "a_file").write_text("x")
    return {
        "spider": tiny_export("spider", root / "spider"),
        "dense": tiny_export("dense", root / "dense"),
        "data": tiny_data(root / "data"),
        "empty": root / "empty",
        "file": root / "a_file",
    }


def test_two_models_and_two_loop_counts_on_the_same_windows(files, tmp_path):
    """Spider against dense as trained, then the Spider at 1 and 2 loops: each row paired with the first
    (the first against itself: 0), the JSON written whole."""
    out = tmp_path / "rows.json"
    common = ["--data", str(files["data"]), "--seq_len", "64", "--batch", "2", "--device", "cpu"]
    code, stdout, err = run_script(
        SCRIPT, ["--model", str(files["spider"]), "--model", str(files["dense"]), *common, "--json", str(out)]
    )
    assert code == 0, err
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == [str(files["spider"]), str(files["dense"])]
    assert (rows[0]["diff_bpb"], rows[0]["se_bpb"]) == (0.0, 0.0) and rows[0]["windows"] == rows[1]["windows"] == 4
    assert rows[1]["diff_bpb"] == pytest.approx(rows[1]["val_bpb"] - rows[0]["val_bpb"], abs=1e-9)
    code, stdout, err = run_script(
        SCRIPT, ["--model", str(files["spider"]), "--n_loops", "1,2", *common, "--json", str(out)]
    )
    assert code == 0, err
    assert [r["n_loops"] for r in json.loads(out.read_text())] == [1, 2] and "n_loops 2: val bpb" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]  # no temporary file left


def test_ttt_scores_each_model_with_and_without_adapting(files, tmp_path):
    """--ttt: each model over the split's documents, plain and adapted over the same chunks (the two
    differ: the adapters learned), every prediction scored once, the adapted linears named."""
    out = tmp_path / "ttt.json"
    flags = ["--model", str(files["spider"]), "--model", str(files["dense"]), "--data", str(files["data"])]
    flags += ["--seq_len", "64", "--ttt", "--ttt_chunk", "32", "--ttt_lr", "0.05", "--json", str(out)]
    code, stdout, err = run_script(SCRIPT, flags)
    assert code == 0, err
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == [str(files["spider"]), str(files["dense"])]
    for r in rows:
        assert r["chunks"] == 8 and r["documents"] == 1  # 256 predictions of one document, 32 a chunk
        assert r["diff_bpb"] == pytest.approx(r["ttt_bpb"] - r["val_bpb"], abs=1e-9) and r["diff_bpb"] != 0
        assert r["adapted"] and r["ttt"]["chunk_bytes"] == 32
    assert "with TTT" in stdout and "linears adapted" in stdout


MISTAKES = [
    # (flags, with {spider}, {dense}, {data}, {empty}, {file}, {missing} filled in; what the line says)
    (["--model", "{missing}"], "no such folder"),
    (["--model", "{empty}"], "config.json"),
    (["--model", "{dense}", "--n_loops", "1,2"], "has no core loops"),
    (["--model", "{spider}", "--n_loops", "1,99"], "outside 1.."),
    (["--model", "{spider}", "--n_loops", "2,deep"], "positive integers, 'trained' or 'max'"),
    (["--model", "{spider}", "--n_loops", "2"], "at least two different counts"),
    (["--model", "{spider}", "--model", "{dense}", "--n_loops", "1,2"], "takes one --model"),
    (["--model", "{spider}", "--seq_len", "0"], "--seq_len 0: give a positive number"),
    (["--model", "{spider}", "--batch", "-2"], "--batch -2: give a positive number"),
    (["--model", "{spider}", "--data", "{missing}"], "--data"),
    (["--model", "{spider}", "--json", "{missing}/rows.json"], "does not exist"),
    (["--model", "{spider}", "--json", "{empty}"], "is a folder"),
    (["--model", "{spider}", "--device", "tpu"], "choose auto, cpu or cuda"),
    (["--model", "{spider}", "--loops", "2,4"], "unrecognized arguments: --loops"),
    (["--model", "{spider}", "--seq_len", "many"], "invalid int value"),
    ([], "--model"),
    (["--model", "{spider}", "--ttt", "--n_loops", "1,2"], "leave out --n_loops"),
    (["--model", "{spider}", "--ttt", "--ttt_chunk", "999"], "chunk_bytes 999 must be in 1..seq_len"),
    (["--model", "{spider}", "--ttt", "--ttt_lr", "-1"], "lr -1.0 must be a finite number"),
    (["--model", "{spider}", "--ttt", "--ttt_steps", "0"], "steps 0 must be >= 1"),
    (["--model", "{spider}", "--ttt", "--ttt_blocks", "0"], "blocks 0 must be >= 1"),
    (["--model", "{spider}", "--max_bytes", "-5"], "--max_bytes -5"),
]
if not torch.cuda.is_available():
    MISTAKES.append((["--model", "{spider}", "--device", "cuda"], "no CUDA device"))


@pytest.mark.parametrize("flags,expect", MISTAKES, ids=[" ".join(f) or "no flags" for f, _ in MISTAKES])
def test_a_mistake_is_one_line(files, tmp_path, flags, expect):
    names = {k: str(v) for k, v in files.items()} | {"missing": str(tmp_path / "missing")}
    code, _, err = run_script(SCRIPT, [f.format(**names) for f in flags])
    assert_one_line(code, err, expect)
