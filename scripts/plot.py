"""Draw the curves of one or more runs into a PNG: loss, val bpb, throughput and the model's own figures.

    python scripts/plot.py outputs/debug_model outputs/debug_dense --out compare.png
    python scripts/plot.py outputs/big_run --x tokens

Each RUN_DIR is a ``job.dump_folder``; its ``metrics.jsonl`` (one JSON object per logged step or
validation: ``step`` plus scalars) is read; a row cut short by a run stopped mid-write is skipped
with a warning, and any other line that is not such a row stops the script with one line naming it.
One panel is drawn per group of keys in :data:`PANELS` that at least one run logged (loss, bits per
byte, throughput, learning rate, grad norm, and the model's bytes/segment, loops, FLOPs/byte, expert
load, auxiliary losses), each with the validation twins ``val_<key>`` dashed. With one run each
series has its colour; with several, each run has its colour and is labelled by its folder's name.
Keys no panel claims are listed on the console. ``--x`` picks the x axis: ``step``, ``tokens``
(``tokens_seen``), ``flops`` (``train_flops``, cumulative) or ``time`` (``elapsed_s``); rows that lack
the key (validation rows) take it from the training rows by interpolating over steps. Needs
matplotlib (``pip install -e '.[plot]'``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from spider_titan.cli import ArgumentParser, check_output_file, replace_file

METRICS_NAME = "metrics.jsonl"
# --x choice -> (metrics key, axis label)
X_AXES = {
    "step": ("step", "step"),
    "tokens": ("tokens_seen", "tokens seen"),
    "flops": ("train_flops", "training FLOPs"),
    "time": ("elapsed_s", "elapsed (s)"),
}


# (title, which training keys it draws, y log-scale), in page order. A panel also draws the
# validation twin ``val_<key>`` of each key it claims (dashed); a key goes to the first panel claiming it.
PANELS = (
    ("loss", lambda k: k == "loss" or k.startswith("loss_loops"), False),
    ("bits per byte", lambda k: k == "bpb" or k.startswith("bpb_loops"), False),
    ("throughput (tokens/s)", lambda k: k == "tokens_per_s", False),
    ("learning rate", lambda k: k == "lr", False),
    ("grad norm", lambda k: k == "grad_norm", True),
    ("bytes / segment", lambda k: k == "bytes_per_segment", False),
    ("loops", lambda k: k in ("mean_loops", "loops_run"), False),
    ("FLOPs / byte", lambda k: k == "flops_per_byte", False),
    ("expert load", lambda k: k.startswith("expert_load") or (k.startswith("moe_") and "loss" not in k), False),
    ("aux losses", lambda k: k.endswith("_loss"), False),
)


class PlotError(Exception):
    """A user mistake, reported as one line and exit status 2."""


# How the trainer's JsonlLogger begins every row: a line that begins so but does not parse is a row cut short.
ROW_START = '{"step": '
_RUN_HINT = f"pass a run's dump folder (the trainer writes <job.dump_folder>/{METRICS_NAME})"


def metrics_file(run: str | Path) -> Path:
    """The metrics file of ``run``: ``run/metrics.jsonl`` (``metrics_rank0.jsonl`` when ranks logged apart),
    or ``run`` itself when it names a ``.jsonl`` file."""
    run = Path(run)
    if run.is_file() and run.suffix == ".jsonl":
        return run
    if not run.exists():
        raise PlotError(f"run folder {run} does not exist; {_RUN_HINT}")
    if not run.is_dir():
        raise PlotError(f"{run} is a file, not a run folder or a .jsonl metrics file; {_RUN_HINT}")
    for name in (METRICS_NAME, "metrics_rank0.jsonl"):
        if (run / name).is_file():
            return run / name
    raise PlotError(f"no {METRICS_NAME} in {run} (a run with metrics.enable_jsonl = false writes none); {_RUN_HINT}")


def row_problem(value: object) -> str:
    """What keeps a parsed line from being a metrics row (a JSON object with a numeric ``step``); "" if nothing."""
    if not isinstance(value, dict):
        return f"a JSON {type(value).__name__}, not an object"
    step = value.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        return 'no numeric "step"'
    return ""


def _cut_short(line: str) -> bool:
    """Whether ``line``, which does not parse, is a row cut short: it begins like a row and holds no whole
    JSON value at its start (a whole object followed by more text was not cut: something wrote after it)."""
    if not line.startswith(ROW_START):
        return False
    try:
        json.JSONDecoder().raw_decode(line)
    except json.JSONDecodeError:
        return True
    return False


def _resumed_row(line: str) -> dict | None:
    """The row a resumed run appended to a cut one on the same line (``{"step": 3, "lo{"step": 4, ...}``)."""
    i = line.find(ROW_START, 1)
    while i > 0:
        try:
            value = json.loads(line[i:])
        except json.JSONDecodeError:
            value = None
        if value is not None and not row_problem(value):
            return value
        i = line.find(ROW_START, i + 1)
    return None


def _bad_line(path: Path, lineno: int, problem: str) -> PlotError:
    return PlotError(
        f'{path} line {lineno}: {problem}; every line must be one JSON object with a numeric "step", '
        "as the trainer writes them: fix or delete that line"
    )


def read_metrics(run: str | Path, warnings: list[str] | None = None) -> list[dict]:
    """The rows of a run's metrics file, in order.

    Blank lines are skipped. A row cut short (a line that begins like the trainer's rows but does not
    parse: the run stopped while writing it, or is still writing) is skipped, wherever it is, since a
    resumed run appends after it, and one warning line names them all (printed on stderr, or appended
    to ``warnings`` to be printed later); a row such a run appended to the cut line itself is kept. Any other line that is not a metrics row, an unreadable
    file and a file without rows raise a PlotError naming the file (and the line).
    """
    path = metrics_file(run)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PlotError(f"cannot read {path} ({e.strerror}); check its permissions") from e
    rows, cut = [], []
    for lineno, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise _bad_line(path, lineno, "not UTF-8 text") from None
        if not line:
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            if not _cut_short(line):
                raise _bad_line(path, lineno, f"not JSON ({e.msg} at column {e.colno})") from None
            cut.append(lineno)
            resumed = _resumed_row(line)
            if resumed:
                rows.append(resumed)
            continue
        problem = row_problem(value)
        if problem:
            raise _bad_line(path, lineno, problem)
        rows.append(value)
    if not rows:
        only = f" (line {cut[0]} is a row cut short)" if cut else ""
        raise PlotError(f"{path} holds no logged step yet{only}; plot it once the run has logged one")
    if cut:
        where = f"the row cut short on line {cut[0]}" if len(cut) == 1 else f"the rows cut short on lines {cut}"
        warning = f"plot: warning: {path}: skipped {where} (the run stopped while writing it)"
        if warnings is None:
            print(warning, file=sys.stderr)
        else:
            warnings.append(warning)
    return rows


def numeric_keys(rows: list[dict]) -> set[str]:
    """Every key holding a number in some row (``step`` excluded)."""
    return {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))}


def plot_panels(keys: set[str]) -> list[tuple[str, list[str], bool]]:
    """``(title, sorted keys, log y)`` of every panel with at least one of ``keys``, in page order."""
    panels, taken = [], set()
    for title, claims, log_y in PANELS:
        mine = sorted(k for k in keys - taken if claims(k.removeprefix("val_")))
        taken.update(mine)
        if mine:
            panels.append((title, mine, log_y))
    return panels


def panel_names(keys: set[str]) -> list[str]:
    """The titles of the panels drawn for a run that logged ``keys``."""
    return [title for title, _, _ in plot_panels(keys)]


def x_values(rows: list[dict], x_key: str, run: str) -> list[float]:
    """The x of every row: its own ``x_key``, else interpolated over steps from the rows that have it."""
    if x_key == "step":
        return [float(r["step"]) for r in rows]
    known = sorted({r["step"]: float(r[x_key]) for r in rows if isinstance(r.get(x_key), (int, float))}.items())
    if not known:
        raise PlotError(f"--x needs {x_key!r} in {run}'s {METRICS_NAME}, which has none (older run?); use --x step")
    import numpy as np

    steps, xs = zip(*known)
    return [
        float(r[x_key]) if isinstance(r.get(x_key), (int, float)) else float(np.interp(r["step"], steps, xs))
        for r in rows
    ]


def run_labels(runs: list[str]) -> list[str]:
    """Each run's folder name, or its path as given where two names collide."""
    names = [Path(r).resolve().name if Path(r).is_dir() else Path(r).resolve().parent.name for r in runs]
    return [n if names.count(n) == 1 else str(r) for n, r in zip(names, runs)]


def picture_path(out: str | Path) -> Path:
    """The file ``--out`` names: ``.png`` appended when it has no suffix (as matplotlib does); a folder is refused."""
    out = Path(out)
    if out.is_dir():
        raise PlotError(f"--out {out} is a folder; name the picture file in it, e.g. --out {out / 'metrics.png'}")
    return out if out.suffix else out.with_name(out.name + ".png")


def draw(runs: list[str], out: str | Path, *, x: str = "step") -> list[str]:
    """Draw ``runs`` into the picture ``out`` (PNG, or another format by its suffix); returns the panel titles."""
    x_key, x_label = X_AXES[x]
    out = Path(out)
    try:
        import matplotlib
    except ImportError as e:
        raise PlotError("drawing needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)") from e
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise PlotError(
            f"--out {out}: {out.suffix} is not a picture format matplotlib writes; "
            f"use .png (or .{', .'.join(sorted(formats))})"
        )
    try:  # before any metrics are read (a picture format is never a metrics file: no input to compare with)
        check_output_file(out, "--out")
    except ValueError as e:
        raise PlotError(str(e)) from None
    warnings: list[str] = []  # printed once the picture is written: a failed run prints its error alone
    data = [read_metrics(r, warnings) for r in runs]
    xs = [x_values(rows, x_key, r) for rows, r in zip(data, runs)]
    keys = set().union(*(numeric_keys(rows) for rows in data)) - {key for key, _ in X_AXES.values()}
    panels = plot_panels(keys)
    if not panels:
        raise PlotError(f"nothing to draw: {', '.join(runs)} logged none of the plotted keys (loss, val_bpb, ...)")
    unclaimed = sorted(keys - {k for _, ks, _ in panels for k in ks})
    if unclaimed:
        print(f"plot: not drawn (no panel): {', '.join(unclaimed)}")
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False, layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-", "--", ":", "-.")
    labels = run_labels(runs)
    for ax, (title, panel_keys, log_y) in zip(axes.flat, panels):
        bases = list(dict.fromkeys(k.removeprefix("val_") for k in panel_keys))
        for i, (rows, run_x, label) in enumerate(zip(data, xs, labels)):
            for j, key in enumerate(panel_keys):
                points = [(px, r[key]) for px, r in zip(run_x, rows) if isinstance(r.get(key), (int, float))]
                if not points:
                    continue
                px, py = zip(*points)
                if len(runs) == 1:  # one colour per series, shared by a key and its val_ twin (dashed)
                    k = bases.index(key.removeprefix("val_"))
                    name, color, style = key, colors[k % len(colors)], "--" if key.startswith("val_") else "-"
                else:  # one colour per run, one line style per series
                    name = label if len(panel_keys) == 1 else f"{label}: {key}"
                    color, style = colors[i % len(colors)], styles[j % len(styles)]
                ax.plot(
                    px,
                    py,
                    style,
                    color=color,
                    label=name,
                    marker="o" if len(points) <= 12 else None,
                    markersize=3,
                    linewidth=1.4,
                )
        ax.set_title(title)
        ax.set_xlabel(x_label)
        if log_y:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        if len(runs) > 1 or len(panel_keys) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(", ".join(labels) if len(labels) <= 4 else f"{len(labels)} runs")
    try:  # under a temporary name, renamed once whole: a failed write leaves a previous picture as it was
        replace_file(out, lambda tmp: fig.savefig(tmp, dpi=110, format=out.suffix[1:].lower()))
    except OSError as e:
        raise PlotError(f"cannot write {out} ({e.strerror}); choose an --out you can write to") from e
    finally:
        plt.close(fig)
    for warning in warnings:
        print(warning, file=sys.stderr)
    return [title for title, _, _ in panels]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, documented by ``--help``."""
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run dump folders (or metrics.jsonl files)")
    p.add_argument(
        "--x",
        choices=tuple(X_AXES),
        default="step",
        help="x axis: step, tokens (tokens_seen), flops (train_flops) or time (elapsed_s) (default step)",
    )
    p.add_argument(
        "--out",
        metavar="FILE.png",
        help="the picture to write, .png unless another suffix says (default: <first RUN_DIR>/metrics.png)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Draw the runs; a user error prints ``plot: error: ...`` and exits with status 2."""
    args = parse_args(argv)
    try:
        out = picture_path(args.out or metrics_file(args.runs[0]).parent / "metrics.png")
        titles = draw(args.runs, out, x=args.x)
    except PlotError as e:
        print(f"plot: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"plot: wrote {out} ({len(titles)} panels: {', '.join(titles)})")


if __name__ == "__main__":
    main()
