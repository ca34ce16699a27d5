"""Every lab tool's usual mistakes, one table: each is refused in one line of stderr, exit status 1 or 2,
no traceback, before any work (missing paths, a dense model where Spider is needed, zero or negative
sizes, an unavailable device, an output into a missing folder or onto its own input, a zero FLOPs budget).

Each tool runs in this process as ``python -m lab.<package>.<tool>`` runs it (``runpy``, ``__main__``), so
the table starts no interpreter per case. The corpus makers' data-loss cases check the files after."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.integration.test_evaluate_cli import assert_one_line, run_script, tiny_data, tiny_export

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lab_mistakes")
    (root / "empty").mkdir()
    (root / "a_file").write_text("x")
    (root / "page.html").write_text("<html><body><nav>menu</nav><pre>code only</pre></body></html>")
    (root / "man1").mkdir()
    (root / "man1" / "frob.1").write_bytes(b".TH FROB 1\n.SH NAME\nfrob \\- a short page\n")
    (root / "study_out").mkdir()
    return {
        "spider": tiny_export("spider", root / "spider"),
        "dense": tiny_export("dense", root / "dense"),
        "data": tiny_data(root / "data"),
        "empty": root / "empty",
        "file": root / "a_file",
        "html": root / "page.html",
        "man": root / "man1",
        "study_out": root / "study_out",
    }


QUALITY = "lab.quality.benchmark"
STUDY = "lab.quality.study"
BENCH = "lab.bench.benchmark"
COMM = "lab.bench.comm"
PROSE = "lab.corpus.html_to_prose"
MAN = "lab.corpus.man_to_text"
CAPACITY = "lab.analysis.segment_capacity"
CELL = "debug/built-in:1e13:0={study_out}"

# (module, flags with {spider} {dense} {data} {empty} {file} {html} {man} {study_out} {missing}, what the line says)
MISTAKES = [
    (QUALITY, ["--flops", "0"], "--flops 0: give a positive number"),
    (QUALITY, ["--flops=-1e13"], "--flops -1e+13: give a positive number"),
    (QUALITY, ["--ablation_flops", "0"], "--ablation_flops 0"),
    (QUALITY, ["--data", "{missing}"], "does not exist"),
    (QUALITY, ["--data", "{empty}"], "no train/ or val/ split"),
    (QUALITY, ["--runs", "spider,nope"], "unknown ['nope']"),
    (QUALITY, ["--val_points", "0"], "--val_points 0"),
    (QUALITY, ["--probe_steps", "1"], "at least 2"),
    (QUALITY, ["--flavor", "huge"], "not a flavor of both models"),
    (QUALITY, ["--eval_loops", "trained,deep"], "positive integers, 'trained' or 'max'"),
    (QUALITY, ["--plot_to", "{missing}/q.png"], "does not exist"),
    (QUALITY, ["--out", "{file}"], "is a file"),
    (QUALITY, ["--spider_set", "n_experts=16"], "expected section.key=value"),
    (QUALITY, ["--val-points", "4"], "unrecognized arguments: --val-points"),
    (STUDY, [], "give --cell"),
    (STUDY, ["--cell", "debug:1e13"], "expected SCALE/CORPUS:BUDGET"),
    (STUDY, ["--cell", "debug/built-in:1e13:0={missing}"], "no folder"),
    (STUDY, ["--study", "loops", "--out", "{empty}"], "give --prose DIR"),
    (STUDY, ["--study", "loops", "--prose", "{empty}"], "not a bytes folder"),
    (STUDY, ["--study", "loops", "--minutes", "0"], "--minutes 0"),
    (STUDY, ["--study", "loops", "--seeds", "a"], "whole numbers"),
    (STUDY, ["--cell", CELL, "--md", "{missing}/s.md"], "does not exist"),
    (STUDY, ["--study", "depth"], "invalid choice: 'depth'"),
    (BENCH, ["nope"], "unknown scenario(s) ['nope']"),
    (BENCH, ["pooling_memory", "--steps", "0"], "--steps 0"),
    (BENCH, ["pooling_memory", "--warmup", "-1"], "--warmup -1: give zero or a positive number"),
    (BENCH, ["moe_layer", "--tokens", "0"], "--tokens 0: give positive whole numbers"),
    (BENCH, ["moe_layer", "--tokens", "many"], "--tokens many"),
    (BENCH, ["moe_layer", "--moe_backends", "torch,fast"], "unknown ['fast']"),
    (BENCH, ["pooling_memory", "--markdown", "{missing}/b.md"], "does not exist"),
    (BENCH, ["generate", "--model", "{missing}"], "no such folder"),
    (BENCH, ["eager_bytes", "--config", "{missing}.toml"], "no such file"),
    (BENCH, ["dense_debug", "--set", "seq_len=64"], "expected section.key=value"),
    (BENCH, ["pooling_memory", "gpu_1b"], "has its own command line"),
    (BENCH, ["dense_debug", "spider_debug", "moe_layer"], "give one, or two to compare"),
    (BENCH, ["gpu_1b", "--reduced", "--batch", "0"], "--batch 0"),
    (BENCH, ["gpu_1b", "--reduced", "--seq", "-4"], "--seq -4"),
    (BENCH, ["gpu_1b", "--reduced", "--steps", "0"], "--steps 0"),
    (BENCH, ["gpu_1b", "--reduced", "--packed", "1.3"], "SLOTS,POSITIONS"),
    (BENCH, ["gpu_1b", "--reduced", "--rows", "spider_2b"], "unknown ['spider_2b']"),
    (BENCH, ["gpu_1b", "--reduced", "--variant", "spider_1b=model.dim=8"], "a new row NAME"),
    (BENCH, ["gpu_1b", "--reduced", "--set", "model.dim"], "expected section.key=value"),
    (BENCH, ["gpu_1b", "--reduced", "--out", "{file}"], "is a file"),
    (BENCH, ["gpu_1b", "--reduced", "--total_s", "0"], "--total_s 0"),
    (BENCH, ["gpu_1b", "--reduced", "--compile", "maybe"], "invalid choice: 'maybe'"),
    (BENCH, ["quantize"], "--model"),
    (BENCH, ["quantize", "--model", "{missing}"], "does not exist"),
    (BENCH, ["quantize", "--model", "{empty}"], "no complete checkpoint"),
    (BENCH, ["quantize", "--model", "{spider}", "--seq_len", "0"], "--seq_len 0"),
    (BENCH, ["quantize", "--model", "{spider}", "--data", "{missing}"], "does not exist"),
    (BENCH, ["quantize", "--model", "{spider}", "--markdown", "{missing}/q.md"], "does not exist"),
    (BENCH, ["quantize", "--model", "{spider}", "--out", "{file}"], "is a file"),
    (COMM, ["nope"], "unknown scenarios ['nope']"),
    (COMM, ["--steps", "0"], "--steps 0"),
    (COMM, ["--world_size", "1"], "at least 2"),
    (COMM, ["--world_size", "two"], "invalid int value"),
    (COMM, ["--fast"], "unrecognized arguments: --fast"),
    (PROSE, ["{missing}.html", "--out", "{missing}.jsonl"], "not a file"),
    (PROSE, ["{html}", "--out", "{html}"], "is the input"),
    (PROSE, ["{html}", "--out", "{empty}"], "is a folder"),
    (PROSE, ["{html}"], "--out"),
    (PROSE, ["{html}", "--out", "{file}"], "no prose"),
    (MAN, ["{missing}", "--out", "{missing}.jsonl"], "is not a folder"),
    (MAN, ["{man}", "--every", "0", "--out", "{missing}.jsonl"], "--every 0"),
    (MAN, ["{man}", "--min_chars", "-1", "--out", "{missing}.jsonl"], "--min_chars -1"),
    (MAN, ["{man}", "--out", "{empty}"], "is a folder"),
    (MAN, ["--out", "{missing}.jsonl"], "folders"),
    (CAPACITY, ["--model", "{missing}"], "does not exist"),
    (CAPACITY, ["--model", "{empty}"], "config.json"),
    (CAPACITY, ["--model", "{dense}"], "has no segments; give a Spider export"),
    (CAPACITY, ["--model", "{spider}", "--seq", "0"], "--seq 0"),
    (CAPACITY, ["--model", "{spider}", "--batch", "0"], "--batch 0"),
    (CAPACITY, ["--model", "{spider}", "--batches", "-1"], "--batches -1"),
    (CAPACITY, ["--model", "{spider}", "--data", "{missing}"], "does not exist"),
    (CAPACITY, ["--model", "{spider}", "--json", "{missing}/c.json"], "does not exist"),
    (CAPACITY, ["--model", "{spider}", "--split", "test"], "invalid choice: 'test'"),
]
if shutil.which("groff"):
    MISTAKES.append((MAN, ["{man}", "--out", "{file}"], "0 pages kept"))
if not CUDA:
    MISTAKES += [
        (BENCH, ["gpu_1b"], "no CUDA device"),
        (BENCH, ["moe_layer", "--moe_backends", "triton"], "no CUDA device"),
    ]


@pytest.mark.parametrize(
    "module,flags,expect", MISTAKES, ids=[f"{m.rsplit('.', 1)[1]} {' '.join(f)}" for m, f, _ in MISTAKES]
)
def test_a_mistake_is_one_line(files, tmp_path, monkeypatch, module, flags, expect):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the tools run from the repository root
    names = {k: str(v) for k, v in files.items()} | {"missing": str(tmp_path / "missing")}
    before = files["file"].read_text()
    code, _, err = run_script(module, [f.format(**names) for f in flags], module=True)
    assert_one_line(code, err, expect)
    assert files["file"].read_text() == before  # an output it refused is left as it was
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())  # nothing written for a refused command


def test_the_tools_each_have_five_mistakes_at_least():
    """The table covers every lab tool with a command line (gpu_1b and quantize through benchmark.py)."""
    per_tool: dict[str, int] = {}
    for module, flags, _ in MISTAKES:
        key = flags[0] if module == BENCH and flags and flags[0] in ("gpu_1b", "quantize") else module
        per_tool[key] = per_tool.get(key, 0) + 1
    tools = {QUALITY, STUDY, BENCH, COMM, PROSE, MAN, CAPACITY, "gpu_1b", "quantize"}
    assert set(per_tool) == tools and min(per_tool.values()) >= 5, per_tool
