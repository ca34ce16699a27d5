"""scripts/plot.py: metrics.jsonl of a few runs in, one PNG out, with a panel per group of logged keys."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plot.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plot():
    spec = importlib.util.spec_from_file_location("plot_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "lo'  # ends in a cut-off line
    (folder / "metrics.jsonl").write_text(text)
    return folder


def _spider_rows() -> list[dict]:
    rows = []
    for step in range(1, 41):
        rows.append(
            {
                "step": step,
                "loss": 5.0 / step,
                "bpb": 7.0 / step,
                "tokens_per_s": 1000.0 + step,
                "lr": 1e-3,
                "grad_norm": 1.0 / step,
                "bytes_per_segment": 4.0,
                "mean_loops": 1.5,
                "expert_load_min": 0.1,
                "expert_load_max": 0.3,
                "moe_aux_loss": 1.0,
                "tokens_seen": 512 * step,
                "memory_gib": 0.5,
            }
        )
        if step % 10 == 0:
            rows.append(
                {
                    "step": step,
                    "val_loss": 4.0 / step,
                    "val_bpb": 6.0 / step,
                    "val_bpb_loops1": 6.5 / step,
                    "val_bytes_per_segment": 4.5,
                }
            )
    return rows


def _dense_rows() -> list[dict]:
    return [{"step": s, "loss": 4.0 / s, "tokens_per_s": 2000.0, "tokens_seen": 1024 * s} for s in range(1, 41)]


def test_draws_a_png_with_a_panel_per_key_group(plot, tmp_path, capsys):
    spider = _write_run(tmp_path / "spider", _spider_rows())
    dense = _write_run(tmp_path / "dense", _dense_rows())
    out = tmp_path / "pics" / "cmp.png"
    plot.main([str(spider), str(dense), "--out", str(out), "--x", "tokens"])
    data = out.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)
    assert "memory_gib" in capsys.readouterr().out  # keys without a panel are named

    assert plot.panel_names(plot.numeric_keys(plot.read_metrics(spider))) == [
        "loss",
        "bits per byte",
        "throughput (tokens/s)",
        "learning rate",
        "grad norm",
        "bytes / segment",
        "loops",
        "expert load",
        "aux losses",
    ]
    assert plot.panel_names(plot.numeric_keys(plot.read_metrics(dense))) == ["loss", "throughput (tokens/s)"]
    panels = dict((title, keys) for title, keys, _ in plot.plot_panels(plot.numeric_keys(_spider_rows())))
    assert panels["bits per byte"] == ["bpb", "val_bpb", "val_bpb_loops1"]
    assert panels["loss"] == ["loss", "val_loss"]
    assert panels["bytes / segment"] == ["bytes_per_segment", "val_bytes_per_segment"]  # val twins join
    assert panels["expert load"] == ["expert_load_max", "expert_load_min"]
    assert panels["aux losses"] == ["moe_aux_loss"]


def test_validation_rows_take_x_from_the_training_rows(plot):
    rows = [{"step": 1, "tokens_seen": 100}, {"step": 3, "tokens_seen": 300}, {"step": 2, "val_bpb": 1.0}]
    assert plot.x_values(rows, "tokens_seen", "run") == [100.0, 300.0, 200.0]


def test_default_out_is_in_the_first_run(plot, tmp_path):
    run = _write_run(tmp_path / "run", _dense_rows())
    plot.main([str(run)])
    assert (run / "metrics.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("case", ["missing-metrics", "x-key-absent"])
def test_user_errors_are_one_line_and_exit_2(plot, tmp_path, capsys, case):
    run = tmp_path / "run"
    if case == "missing-metrics":
        run.mkdir()
        argv, fragment = [str(run)], f"no metrics.jsonl in {run}"
    else:
        _write_run(run, _dense_rows())
        argv, fragment = [str(run), "--x", "flops"], "'train_flops'"
    with pytest.raises(SystemExit) as info:
        plot.main([*argv, "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("plot: error: ") and err.count("\n") == 1 and fragment in err
    assert not (tmp_path / "x.png").exists()
