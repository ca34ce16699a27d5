"""lab/quality/study.py: seeds are averaged per run and cell, a run short of its budget is left out,
and the paired loops difference comes from the run's eval_loops.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.quality import benchmark as qb
from lab.quality import study as quality_study
from scripts import evaluate

main = quality_study.main


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


def test_seeds_averaged_short_runs_left_out(tmp_path, capsys):
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


def test_bad_cell_spec_is_one_line():
    with pytest.raises(SystemExit, match="expected SCALE/CORPUS:BUDGET"):
        main(["--cell", "debug:1e13"])


def test_every_benchmark_row_is_a_valid_config(monkeypatch):
    """Each row of quality_benchmark.RUNS parses and validates as the trainer would read it, at both study
    flavors (a row naming an option the model no longer has, or one that needs a loop count a flavor does
    not train, would fail only hours into a study)."""
    from lab.overrides import trainer_flags
    from spider_titan.config.manager import parse_args
    from tests.utils import REPO

    monkeypatch.chdir(REPO)
    runs = qb.RUNS
    assert len({r.name for r in runs}) == len(runs)
    for run in runs:
        for flavor in ("debug", "small"):
            cfg = parse_args(trainer_flags({"job.config_file": run.config, "model.flavor": flavor, **run.overrides}))
            assert cfg.model.name in ("spider", "dense") and cfg.model.flavor == flavor, run.name


def test_a_row_that_trains_the_default_is_not_run_again(monkeypatch, tmp_path):
    """A row whose overrides resolve to what another requested row trains (fixed segments at `small`, which
    ships them; learned ones at debug) is reported from that row, not trained twice; rows that differ in the
    model or the rest of the job are run."""
    from tests.utils import REPO

    monkeypatch.chdir(REPO)
    ran = []

    def fake_run_one(run, args, out=None, deadline=None):
        ran.append(run.name)
        fake_run(Path(args.out), run.name, flops=args.flops, bpb={"spider": 1.5}.get(run.name, 1.6))
        return qb.load_result(run, Path(args.out) / run.name)

    monkeypatch.setattr(qb, "run_one", fake_run_one)
    monkeypatch.setattr(qb, "plot", lambda *a, **k: None)
    rows = "spider,spider_fixed_segments,spider_learned_segments,spider_stage_lr"
    for flavor, twin in (("small", "spider_fixed_segments"), ("debug", "spider_learned_segments")):
        ran.clear()
        out = tmp_path / flavor
        qb.main(["--flavor", flavor, "--runs", rows, "--out", str(out)])
        assert twin not in ran and sorted(ran) == sorted(set(rows.split(",")) - {twin}), ran
        got = {r["name"]: r for r in json.loads((out / "quality.json").read_text())}
        assert list(got) == rows.split(",") and got[twin]["val_bpb"] == got["spider"]["val_bpb"] == 1.5
        assert all(got[n]["val_bpb"] == 1.6 for n in got if n not in ("spider", twin))


def loops_run(folder, name, *, flops, bpb, options):
    """A finished run with eval_loops rows: the trained depth first, then (loops, diff, se) options."""
    fake_run(folder, name, flops=flops, bpb=bpb)
    rows = [{"n_loops": 2, "diff_bpb": 0.0, "se_bpb": 0.0}]
    rows += [{"n_loops": n, "diff_bpb": d, "se_bpb": se} for n, d, se in options]
    (folder / name / "eval_loops.json").write_text(json.dumps(rows))


def test_loops_study_aims_per_cell(tmp_path):
    """--study loops --report_only: the candidate's difference to the baseline per cell (paired by seed), and
    the best higher test-time depth pooled over seeds, judged against 0.005 bpb with s.e. under a third."""
    study = quality_study.STUDIES["loops"]
    good = [(3, +0.001, 0.0002), (4, -0.006, 0.0005)]  # four loops help by 0.006
    weak = [(3, -0.002, 0.0002), (4, +0.004, 0.0005)]
    for i, (scale, corpus, budget) in enumerate(study.cells):
        for seed in study.seeds:
            d = quality_study.cell_dir(tmp_path, scale, corpus, seed)
            fake_run(d, "spider", flops=budget, bpb=2.0 + seed)
            # cell 0: 0.010 worse (over the allowance); the others 0.002 better
            loops_run(
                d,
                "spider_loops2",
                flops=budget,
                bpb=2.0 + seed + (0.010 if i == 0 else -0.002),
                options=good if i < 3 else weak,
            )
    main(["--study", "loops", "--out", str(tmp_path), "--report_only"])
    md = (tmp_path / "study.md").read_text()
    assert (
        "| debug, built-in | **2.500** (2.000 / 3.000) | **2.510** (2.010 / 3.010) | +0.0100 over 2 seed(s), over by 0.0050 |"
        in md
    )
    assert "| @4 | -0.0060 (0.0004) | yes |" in md  # sqrt(2 * 0.0005^2) / 2 = 0.00035
    assert "| small, prose |" in md and "| @3 | -0.0020 (0.0001) | no (short by 0.0030) |" in md
    assert "(a) mean difference over 4 of 4 cells: +0.0010 bpb, not every cell within 0.005: not met" in md
    assert "(b) met in 3 of 4 cells (3 asked): met" in md
    assert len(json.loads((tmp_path / "study.json").read_text())["runs"]) == 4 * 2 * 2


def test_loops_study_runs_every_cell_and_lists_the_unfinished(tmp_path, monkeypatch):
    """--study runs each (cell, seed, run) once, with the cell's budget, flavor, seed and corpus; a run
    stopped at the deadline is listed, not counted; a run that trains what another of its cell trains
    (fixed segments at `small`, which ships them) is linked to it, not run."""
    from tests.utils import REPO

    monkeypatch.chdir(REPO)  # the rows' job configs are relative to the repository
    prose = tmp_path / "prose"
    (prose / "train").mkdir(parents=True)
    calls = []

    def fake_run_one(run, bench, out, deadline):
        extra = qb.run_overrides(bench)
        calls.append((run.name, bench.flops, bench.data, extra, out.name))
        assert deadline > 0
        if run.name == "spider_loops2" and extra["model.flavor"] == "debug":
            raise qb.OutOfTime("stopped at the deadline")
        fake_run(out, run.name, flops=bench.flops, bpb=2.0 if run.name == "spider" else 2.1)
        return {}

    monkeypatch.setattr(quality_study, "run_one", fake_run_one)
    main(["--study", "loops", "--out", str(tmp_path / "o"), "--prose", str(prose), "--jobs", "2"])
    assert len(calls) == 4 * 2 * 3 - 4 and not any(
        c[0] == "spider_fixed_segments" and c[3]["model.flavor"] == "small" for c in calls
    )
    small_prose = [c for c in calls if c[3]["model.flavor"] == "small" and c[2] is not None]
    assert {c[1] for c in small_prose} == {4e13}
    assert all(c[3]["training.dataset_path"] == prose.resolve() for c in small_prose)
    assert {c[4] for c in calls} == {
        f"{s}_{c}_s{k}" for s in ("debug", "small") for c in ("builtin", "prose") for k in (0, 1)
    }
    report = json.loads((tmp_path / "o" / "study.json").read_text())
    assert sorted(report["unfinished"]) == sorted(
        f"debug/{c} seed {k} spider_loops2: out of time" for c in ("built-in", "prose") for k in (0, 1)
    )
    assert len(report["runs"]) == 4 * 2 * 3 - 4
    linked = [r for r in report["runs"] if r["name"] == "spider_fixed_segments" and r["scale"] == "small"]
    assert len(linked) == 4 and all(r["val_bpb"] == 2.0 for r in linked)
    assert (quality_study.cell_dir(tmp_path / "o", "small", "prose", 1) / "spider_fixed_segments").is_symlink()


def test_study_needs_its_prose_corpus(tmp_path):
    with pytest.raises(SystemExit, match="give --prose DIR"):
        main(["--study", "loops", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="not a bytes folder"):
        main(["--study", "loops", "--out", str(tmp_path), "--prose", str(tmp_path)])


def test_eval_loops_commands():
    """'trained' and 'max' name the model's loop counts; the command pairs each count with the first."""
    from types import SimpleNamespace

    args = SimpleNamespace(n_loops=3, max_loops=4)
    assert evaluate.parse_loops("trained,max", args) == [3, 4]
    assert evaluate.parse_loops("2,trained,2", args) == [2, 3]
    with pytest.raises(SystemExit, match="at least two different"):
        evaluate.parse_loops("trained,3", args)
    with pytest.raises(SystemExit, match="integers, 'trained' or 'max'"):
        evaluate.parse_loops("trained,deep", args)
    runs = {r.name: r for r in qb.RUNS}
    plain = qb.eval_loops_cmd(runs["spider"], Path("d"), "trained,max", "x")
    assert plain[1:] == ["scripts/evaluate.py", "--model", str(Path("d") / "export"), "--n_loops", "trained,max"] + [
        "--json",
        str(Path("d") / "eval_loops.json"),
        "--data",
        str(Path("x").resolve()),
    ]


def test_spider_set_and_dense_set_reach_their_own_runs_only(monkeypatch):
    """--spider_set's overrides follow a Spider run's own (so they win over them) and leave the dense runs
    alone (a model field Spider has would fail the dense config); --dense_set the other way round."""
    from spider_titan.config.manager import parse_args
    from tests.utils import REPO

    monkeypatch.chdir(REPO)
    runs = {r.name: r for r in qb.RUNS}
    args = qb.parse_args(
        ["--flavor", "small", "--spider_set", "model.n_experts=16", "--spider_set", "model.top_k=4"]
        + ["--dense_set", "model.n_layers=3"]
    )
    spider = qb.run_overrides(args, runs["spider_one_engram"])
    dense = qb.run_overrides(args, runs["dense"])
    assert list(spider.items())[-2:] == [("model.n_experts", "16"), ("model.top_k", "4")]
    assert "model.n_experts" not in dense
    assert list(dense.items())[-1] == ("model.n_layers", "3") and "model.n_layers" not in spider
    cmd = qb.train_cmd(runs["spider_one_engram"], Path("d"), 10, spider, val_freq=None)
    assert cmd[1:3] == ["-m", "spider_titan.train"]
    cfg = parse_args(cmd[3:])
    assert cfg.model.overrides == {"n_experts": 16, "top_k": 4, "engram_layers": [1]}
    assert cfg.model.flavor == "small" and cfg.training.steps == 10 and cfg.validation.enable is False
    assert qb.run_overrides(qb.parse_args([]), runs["spider"]) == qb.run_overrides(qb.parse_args([]))


def test_trainer_overrides_are_written_one_way():
    """lab.overrides: a mapping in, the trainer's ``--section.key value`` out (booleans, numbers, lists and
    paths as its command line reads them), and ``--set section.key=value`` read back into a mapping."""
    from lab.overrides import parse_sets, trainer_flags
    from spider_titan.config.manager import parse_args

    flags = trainer_flags(
        {"training.compile": False, "training.seq_len": 64, "model.engram_layers": [0, 1], "job.dump_folder": Path("x")}
    )
    assert flags == [
        "--training.compile", "false", "--training.seq_len", "64", "--model.engram_layers", "[0, 1]",
        "--job.dump_folder", "x",
    ]  # fmt: skip
    cfg = parse_args(flags)
    assert (
        cfg.training.compile is False and cfg.training.seq_len == 64 and cfg.model.overrides["engram_layers"] == [0, 1]
    )
    assert parse_sets(["training.seq_len=64", "model.n_loops=2", "training.seq_len=128"]) == {
        "training.seq_len": "128",
        "model.n_loops": "2",
    }
    for bad in ("training.seq_len", "seq_len=64", "--training.seq_len=64", "=1"):
        with pytest.raises(ValueError, match="expected section.key=value"):
            parse_sets([bad])
    with pytest.raises(ValueError, match="expected section.key"):
        trainer_flags({"seq_len": 64})
