"""scripts/quality_study.py: seeds are averaged per run and cell, a run short of its budget is left out,
and the paired loops difference comes from the run's eval_loops.json."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture
def main(monkeypatch):
    """quality_study.main, imported as ``python scripts/quality_study.py`` runs it: with scripts/ heading
    sys.path, where it finds its sibling quality_benchmark.py."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("quality_study").main


def fake_run(folder, name, *, flops, bpb, paired=None):
    dump = folder / name
    dump.mkdir(parents=True)
    rows = [
        {"step": 10, "loss": 2.0, "train_flops": flops / 2, "bytes_per_segment": 4.1, "expert_load_min": 0.1,
         "expert_load_max": 0.15},
        {"step": 20, "val_bpb": bpb, "train_flops": flops, "val_bytes_per_segment": 3.9, "val_bpb_loops2": bpb},
    ]  # fmt: skip
    (dump / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    if paired is not None:
        diff, se = paired
        loops = [{"n_loops": 2, "diff_bpb": 0.0, "se_bpb": 0.0}, {"n_loops": 4, "diff_bpb": diff, "se_bpb": se}]
        (dump / "eval_loops.json").write_text(json.dumps(loops))


def test_seeds_averaged_short_runs_left_out(main, tmp_path, capsys):
    s0, s1 = tmp_path / "s0", tmp_path / "s1"
    fake_run(s0, "spider", flops=1.05e13, bpb=2.0, paired=(0.0012, 0.0002))
    fake_run(s1, "spider", flops=1.02e13, bpb=2.2, paired=(-0.0003, 0.0001))
    fake_run(s0, "dense", flops=1.0e13, bpb=1.9)
    fake_run(s1, "dense", flops=0.7e13, bpb=2.5)  # stopped early: not at the budget
    out = tmp_path / "study.json"
    main(["--cell", f"debug/built-in:1e13:0={s0};1={s1}", "--json", str(out), "--md", str(tmp_path / "s.md")])
    md = (tmp_path / "s.md").read_text()
    assert "| spider | **2.100** (2.000 / 2.200) |" in md
    assert "| dense | 1.900 |" in md  # seed 1 left out, seed 0 alone
    assert "+0.0012 (0.0002) / -0.0003 (0.0001)" in md
    assert "dense stopped at 7.00e+12" in capsys.readouterr().err
    runs = json.loads(out.read_text())
    assert sorted((r["name"], r["seed"]) for r in runs) == [("dense", 0), ("spider", 0), ("spider", 1)]
    assert "bytes/segment train 4.10-4.10, eval 3.90-3.90" in md


def test_bad_cell_spec_is_one_line(main):
    with pytest.raises(SystemExit, match="expected SCALE/CORPUS:BUDGET"):
        main(["--cell", "debug:1e13"])


def test_every_benchmark_row_is_a_valid_config(monkeypatch):
    """Each row of quality_benchmark.RUNS parses and validates as the trainer would read it (a row
    naming an option the model no longer has would fail only hours into a study)."""
    from spider_titan.config.manager import parse_args
    from tests.utils import REPO

    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.chdir(REPO)
    runs = importlib.import_module("quality_benchmark").RUNS
    assert len({r.name for r in runs}) == len(runs)
    for run in runs:
        cfg = parse_args(["--job.config_file", run.config, *run.overrides])
        assert cfg.model.name in ("spider", "dense"), run.name
