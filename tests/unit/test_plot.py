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


USER_ERRORS = {
    # case -> fragment of the one-line error
    "missing-metrics": "no metrics.jsonl in {run}",
    "x-key-absent": "'train_flops'",
    "missing-folder": "run folder {run} does not exist",
    "run-is-a-file": "{run} is a file, not a run folder",
    "empty-metrics": "{run}/metrics.jsonl holds no logged step yet",
    "only-a-cut-row": "{run}/metrics.jsonl holds no logged step yet (line 1 is a row cut short)",
    "unreadable-metrics": "cannot read {run}/metrics.jsonl (Permission denied)",
    "out-is-a-folder": "--out {tmp}/pics is a folder",
    "out-not-a-picture": "--out {tmp}/x.txt: .txt is not a picture format",
    "out-under-a-file": "--out {tmp}/notes/x.png: {tmp}/notes is a file, not a folder",
    "out-under-a-file-deeper": "--out {tmp}/notes/new/x.png: {tmp}/notes is a file, not a folder",
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_errors_are_one_line_and_exit_2(plot, tmp_path, capsys, monkeypatch, case):
    run, out = tmp_path / "run", tmp_path / "x.png"
    argv = [str(run)]
    if case == "missing-metrics":
        run.mkdir()
    elif case == "run-is-a-file":
        run.write_text("not a run")
    elif case in ("empty-metrics", "only-a-cut-row"):
        run.mkdir()
        (run / "metrics.jsonl").write_text("" if case == "empty-metrics" else '{"step": 1, "lo')
    elif case != "missing-folder":
        _write_run(run, _dense_rows())
    if case == "x-key-absent":
        argv += ["--x", "flops"]
    elif case == "unreadable-metrics":  # chmod does not stop root: make the read fail as it would
        real = Path.read_bytes

        def read_bytes(path):
            if path.name == "metrics.jsonl":
                raise PermissionError(13, "Permission denied", str(path))
            return real(path)

        monkeypatch.setattr(Path, "read_bytes", read_bytes)
    elif case == "out-is-a-folder":
        out = tmp_path / "pics"
        out.mkdir()
    elif case == "out-not-a-picture":
        out = tmp_path / "x.txt"
    elif case == "out-under-a-file":
        (tmp_path / "notes").write_text("a file")
        out = tmp_path / "notes" / "x.png"
    elif case == "out-under-a-file-deeper":  # refused before the metrics are read, not after the drawing
        (tmp_path / "notes").write_text("a file")
        out = tmp_path / "notes" / "new" / "x.png"
    with pytest.raises(SystemExit) as info:
        plot.main([*argv, "--out", str(out)])
    err = capsys.readouterr().err
    fragment = USER_ERRORS[case].format(run=run, tmp=tmp_path)
    assert info.value.code == 2 and err.startswith("plot: error: ") and err.count("\n") == 1, err
    assert fragment in err, err
    assert not out.is_file() and not list(tmp_path.rglob("*.png"))


ROWS = [{"step": s, "loss": 4.0 / s} for s in range(1, 6)]


def _lines(rows: list[dict]) -> list[str]:
    return [json.dumps(r) for r in rows]


@pytest.mark.parametrize(
    "case, text, steps, cut_lines",
    [
        # a run killed while writing its last row (or still writing)
        ("last", "\n".join(_lines(ROWS)) + '\n{"step": 6, "lo', [1, 2, 3, 4, 5], "line 6"),
        # a run killed mid-row, then resumed: its rows follow the cut one on a new line...
        (
            "middle",
            "\n".join([*_lines(ROWS[:2]), '{"step": 3, "lo', *_lines(ROWS[2:])]) + "\n",
            [1, 2, 3, 4, 5],
            "line 3",
        ),
        # ...or on the same line, the resumed row appended right after the cut one
        (
            "resumed-on-the-same-line",
            "\n".join([*_lines(ROWS[:2]), '{"step": 3, "lo' + _lines(ROWS[2:3])[0], *_lines(ROWS[3:])]) + "\n",
            [1, 2, 3, 4, 5],
            "line 3",
        ),
        (
            "two",
            '{"step": 1, "lo\n' + "\n".join(_lines(ROWS)) + '\n{"step": 6, "loss": 0.',
            [1, 2, 3, 4, 5],
            "lines [1, 7]",
        ),
    ],
)
def test_a_row_cut_short_is_skipped_with_one_warning_and_the_plot_is_drawn(
    plot, tmp_path, capsys, case, text, steps, cut_lines
):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(text)
    plot.main([str(run)])
    captured = capsys.readouterr()
    assert captured.err == (
        f"plot: warning: {run / 'metrics.jsonl'}: skipped the row{'s' if case == 'two' else ''} cut short on "
        f"{cut_lines} (the run stopped while writing it)\n"
    )
    assert (run / "metrics.png").read_bytes().startswith(PNG_MAGIC)
    assert f"plot: wrote {run / 'metrics.png'}" in captured.out
    assert [r["step"] for r in plot.read_metrics(run)] == steps


@pytest.mark.parametrize(
    "bad, where, problem",
    [
        (b"not json", "middle", "not JSON (Expecting value at column 1)"),
        (b"not json", "last", "not JSON (Expecting value at column 1)"),
        (b'{"step": 3, "loss": 1.0} trailing', "middle", "not JSON (Extra data at column 26)"),
        (b"[1, 2]", "middle", "a JSON list, not an object"),
        (b'{"loss": 1.0}', "middle", 'no numeric "step"'),
        (b'{"step": "3", "loss": 1.0}', "last", 'no numeric "step"'),
        (b'{"step": 3, "loss": 1.0}\xff\xfe', "middle", "not UTF-8 text"),
    ],
)
def test_a_broken_line_is_one_line_naming_the_file_and_line(plot, tmp_path, capsys, bad, where, problem):
    run = tmp_path / "run"
    run.mkdir()
    good = [line.encode() for line in _lines(ROWS)]
    lines = [*good[:2], bad, *good[2:]] if where == "middle" else [*good, bad]
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines) + (b"\n" if where == "middle" else b""))
    with pytest.raises(SystemExit) as info:
        plot.main([str(run)])
    err = capsys.readouterr().err
    lineno = 3 if where == "middle" else len(lines)
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"plot: error: {run / 'metrics.jsonl'} line {lineno}: {problem}; "), err
    assert "fix or delete that line" in err
    assert not (run / "metrics.png").exists()


def test_out_names_the_file_written(plot, tmp_path, capsys):
    run = _write_run(tmp_path / "run", _dense_rows())
    plot.main([str(run / "metrics.jsonl")])  # a metrics file: the picture goes beside it
    assert (run / "metrics.png").read_bytes().startswith(PNG_MAGIC)
    plot.main([str(run), "--out", str(tmp_path / "cmp")])  # no suffix: matplotlib writes cmp.png
    assert (tmp_path / "cmp.png").read_bytes().startswith(PNG_MAGIC)
    assert f"plot: wrote {tmp_path / 'cmp.png'} (" in capsys.readouterr().out


def test_a_failed_write_leaves_the_previous_picture_and_no_partial_file(plot, tmp_path, monkeypatch):
    """The picture is written under a temporary name and renamed once whole: a write that fails part-way
    (a full disk) leaves the previous picture byte for byte, and no temporary file."""
    import errno
    import os

    import matplotlib.figure

    run = _write_run(tmp_path / "run", _dense_rows())
    out = tmp_path / "x.png"
    plot.main([str(run), "--out", str(out)])
    before = out.read_bytes()

    def half_then_full(self, fname, **kwargs):
        Path(fname).write_bytes(before[: len(before) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_then_full)
    with pytest.raises(SystemExit) as info:
        plot.main([str(run), "--out", str(out)])
    assert info.value.code == 2
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["run", "x.png"]
