"""The prepared GPU call of issue 74 (lab/device/third_scale.py): its dry run end to end on a CPU, the pooling of
paired differences over seeds, the budget it picks and the decision rule it applies."""

from __future__ import annotations

import json
import lzma
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab.device import third_scale as ts

ROOT = Path(__file__).resolve().parents[2]
# the harness's part with one of its rows, skipped without CUDA: the call starts the harness by its own command
# and carries its rows into the report; the rows that run on a CPU run in lab/tests/test_gpu_harness.py's own
# dry run (with dense_1b here as well, the same row ran twice in the suite: 30 s, 2026-12-02)
HARNESS_ROWS = "spider_1b_fp8"


def tiny_corpus(folder: Path) -> Path:
    """Two xz jsonl files of real text (standard-library modules): the training mix and a held-out source."""
    import email
    import json as json_module

    folder.mkdir(parents=True, exist_ok=True)
    files = sorted(Path(email.__file__).parent.glob("*.py")) + sorted(Path(json_module.__file__).parent.glob("*.py"))
    train = "".join(json.dumps({"text": p.read_text()[:6000]}) + "\n" for p in files)
    held = "".join(json.dumps({"text": p.read_text()[:3000].upper()}) + "\n" for p in files[:14])
    (folder / "train.jsonl.xz").write_bytes(lzma.compress(train.encode()))
    (folder / "held_out.jsonl.xz").write_bytes(lzma.compress(held.encode()))
    return folder


@pytest.mark.slow
def test_dry_run_writes_the_table_and_json_with_every_row(tmp_path):
    """The whole call at tiny shapes on a CPU (one seed): shards, probe, training to one budget, both val sets,
    the 1B harness rows, the verdict; every run, pair and harness row in the JSON and the table."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "-m", "lab.device.third_scale", "--dry_run", "--seeds", "1", "--out", str(out)]
    cmd += ["--work", str(work), "--corpus", str(tiny_corpus(tmp_path / "corpus")), "--val_fraction", "0.2"]
    # budgets far above what the parts take on an idle 2-core machine (about two minutes in all), so that a
    # loaded machine slows the test and does not cut a part; the FLOPs budget is then the dry run's target
    cmd += ["--held_out_val_fraction", "0.3", "--total_s", "3000", "--probe_s", "800", "--train_s", "800"]
    cmd += ["--eval_s", "600", "--harness_s", "700"]
    cmd += ["--harness_rows", HARNESS_ROWS]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "third_scale.json").read_text())
    md = (out / "third_scale.md").read_text()
    runs = [f"{v.name}_s0" for v in ts.VARIANTS]
    assert report["runs"] == runs
    budget = report["budget"]
    assert math.isclose(budget["flops"], 1.5e-4 * ts.SMALL_BUDGET) and budget["limited_by"] == "--target_x 0.00015"
    for name in runs:
        assert report["probe"][name]["flops_per_s"] > 0, report["probe"][name]
        trained = report["train"][name]
        assert trained["export"] and trained["train_flops"] >= report["budget"]["flops"], trained
        assert f"| {name} |" in md
    for val in ("train_val", "held_out_val"):
        entry = report["eval"][val]
        assert set(entry["bpb"]) == set(runs) and all(0 < b < 9 for b in entry["bpb"].values()), entry
        assert set(entry["pairs"]) == {f"{a} - {b}" for a, b in ts.PAIRS}
        for key, pair in entry["pairs"].items():
            a, b = key.split(" - ")
            assert math.isclose(pair["diff"], entry["bpb"][f"{a}_s0"] - entry["bpb"][f"{b}_s0"], abs_tol=1e-9)
            assert pair["se"] > 0 and pair["se_total"] == pair["se"] and f"| {key} |" in md
    assert report["verdict"]["outcome"] == "inconclusive"  # the dry run's budget is far under 100x small's
    rows = report["harness"]["rows"]
    assert set(rows) == set(HARNESS_ROWS.split(",")) and set(rows) < set(ts.HARNESS_ROWS.split(","))
    assert "skipped" in rows["spider_1b_fp8"] and "command" in report["harness"]
    for name in rows:
        assert f"| {name} |" in md
    assert (out / "gpu_1b.json").exists() and (out / "logs.tar.gz").stat().st_size > 0


def test_a_missing_corpus_is_one_line(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lab.device.third_scale",
            "--dry_run",
            "--corpus",
            str(tmp_path),
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "lab.corpus.device_corpus" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def _losses(shift: dict[str, float], seeds: int, windows: int = 400) -> dict[str, tuple]:
    """Per-window losses where run ``v_s<seed>`` reads ``shift[v] + seed_jitter`` bits per byte above a base."""
    g = torch.Generator().manual_seed(0)
    count = torch.full((windows,), 64.0, dtype=torch.float64)
    base = (2.0 + 0.3 * torch.rand(windows, generator=g, dtype=torch.float64)) * count * math.log(2)
    out = {}
    for seed in range(seeds):
        for v, s in shift.items():
            noise = 0.002 * torch.randn(windows, generator=g, dtype=torch.float64)
            jitter = 0.004 * seed if v == "spider" else 0.0
            out[f"{v}_s{seed}"] = (base + (s + jitter + noise) * count * math.log(2), count)
    return out


def test_pooled_pairs_average_the_seeds_and_count_their_spread():
    shift = {"spider": 0.03, "spider_fixed_1loop": 0.0, "dense": 0.01}
    pairs = ts.pooled_pairs(_losses(shift, seeds=2), seeds=2)
    sf = pairs["spider - spider_fixed_1loop"]
    assert [round(sf["per_seed"][s]["diff"], 3) for s in (0, 1)] == [0.03, 0.034]
    assert math.isclose(sf["diff"], (sf["per_seed"][0]["diff"] + sf["per_seed"][1]["diff"]) / 2, rel_tol=1e-9)
    assert math.isclose(sf["seed_half_spread"], 0.002, abs_tol=3e-4)
    assert math.isclose(sf["se_total"], math.hypot(sf["se"], sf["seed_half_spread"]), rel_tol=1e-9)
    assert 0 < sf["se"] < 0.001
    assert math.isclose(pairs["spider_fixed_1loop - dense"]["diff"], -0.01, abs_tol=5e-4)


@pytest.mark.parametrize(
    ("shift", "x_small", "outcome"),
    [
        ({"spider": 0.03, "spider_fixed_1loop": 0.0, "dense": 0.01}, 150, "change"),
        ({"spider": -0.03, "spider_fixed_1loop": 0.0, "dense": 0.0}, 150, "keep"),
        ({"spider": 0.025, "spider_fixed_1loop": 0.02, "dense": 0.0}, 150, "keep, dense leads"),
        ({"spider": 0.004, "spider_fixed_1loop": 0.0, "dense": 0.003}, 150, "keep (no difference counts)"),
        ({"spider": 0.03, "spider_fixed_1loop": 0.0, "dense": 0.01}, 60, "inconclusive"),
    ],
)
def test_verdict_follows_the_written_rule(shift, x_small, outcome):
    pairs = ts.pooled_pairs(_losses(shift, seeds=2), seeds=2)
    report = {"budget": {"x_small": x_small}, "eval": {"held_out_val": {"pairs": pairs}, "train_val": {"pairs": pairs}}}
    assert ts.verdict(report)["outcome"] == outcome


def test_verdict_without_a_pair_says_no_answer():
    assert ts.verdict({"budget": {"x_small": 200}, "eval": {}})["outcome"] == "no answer"


def test_budget_is_what_the_slowest_run_reaches_capped_at_the_target():
    args = ts.parse_args(["--out", "x"])
    rates = {
        "a": {"flops_per_s": 1e14, "startup_s": 40.0, "flops_per_step": 1e12},
        "b": {"flops_per_s": 5e13, "startup_s": 30.0, "flops_per_step": 1e12},
        "c": {"failed": "exit status 1: ..."},
    }
    budget, why = ts.choose_budget(args, rates)
    assert math.isclose(budget, 0.85 * 5e13 * (args.train_s - 30.0 - args.export_s)) and why.startswith("b's rate")
    fast = {"a": {"flops_per_s": 1e17, "startup_s": 10.0}}
    assert ts.choose_budget(args, fast) == (250 * ts.SMALL_BUDGET, "--target_x 250")
    assert ts.choose_budget(args, {"c": rates["c"]})[0] == 0.0
