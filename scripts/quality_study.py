"""The quality study over scales, corpora and seeds: quality_benchmark.py outputs in, one table of val
bpb per run and cell (scale x corpus), the paired more-loops difference, telemetry ranges and a plot of
val bpb against the training budget per corpus out.

    python scripts/quality_study.py \\
        --cell "debug/built-in:1e13:0=outputs/q/debug_builtin_s0;1=outputs/q/debug_builtin_s1" \\
        --cell "small/built-in:4e13:0=outputs/q/small_builtin_s0" \\
        --md study.md --json study.json --plot docs/images/quality_scales.png

A cell is ``SCALE/CORPUS:BUDGET:SEED=DIR[+DIR...][;SEED=DIR...]``: each DIR is a ``--out`` folder of
quality_benchmark.py (several folders of one seed are merged). A run counts only if its last validation
came at the budget or later (a run stopped early is left out and named on stderr), so every figure is
at equal training FLOPs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean

from quality_benchmark import RUNS, load_result, summarise

ORDER = [r.name for r in RUNS]
MAIN = ("dense", "spider", "spider_fixed_segments", "spider_fixed_stage_lr", "spider_stage_lr")


@dataclass
class Cell:
    scale: str
    corpus: str
    budget: float
    # run name -> seed -> summary (quality_benchmark.summarise)
    runs: dict[str, dict[int, dict]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.scale}, {self.corpus}"


def parse_cell(spec: str) -> tuple[str, str, float, dict[int, list[Path]]]:
    try:
        where, budget, seeds = spec.split(":", 2)
        scale, corpus = where.split("/", 1)
        dirs = {}
        for part in seeds.split(";"):
            seed, paths = part.split("=", 1)
            dirs[int(seed)] = [Path(p) for p in paths.split("+")]
        return scale, corpus, float(budget), dirs
    except ValueError:
        raise SystemExit(f"--cell {spec!r}: expected SCALE/CORPUS:BUDGET:SEED=DIR[+DIR][;SEED=DIR]") from None


def load_cell(spec: str) -> Cell:
    scale, corpus, budget, dirs = parse_cell(spec)
    cell = Cell(scale, corpus, budget)
    by_name = {r.name: r for r in RUNS}
    for seed, folders in dirs.items():
        for folder in folders:
            for dump in sorted(p for p in folder.iterdir() if p.is_dir() and p.name in by_name):
                result = load_result(by_name[dump.name], dump)
                if not result["metrics"]:
                    continue
                s = summarise(result)
                if not s["flops"] >= budget or math.isnan(s["val_bpb"]):
                    print(
                        f"{cell.label}, seed {seed}: {dump.name} stopped at {s['flops']:.2e} FLOPs: left out",
                        file=sys.stderr,
                    )
                    continue
                cell.runs.setdefault(dump.name, {})[seed] = s
    return cell


def bpb_cell(by_seed: dict[int, dict] | None) -> str:
    if not by_seed:
        return "–"
    vals = [by_seed[k]["val_bpb"] for k in sorted(by_seed)]
    if len(vals) == 1:
        return f"{vals[0]:.3f}"
    return f"**{fmean(vals):.3f}** ({' / '.join(f'{v:.3f}' for v in vals)})"


def paired_cell(by_seed: dict[int, dict] | None) -> str:
    pairs = [by_seed[k]["loops_paired"] for k in sorted(by_seed or {}) if by_seed[k]["loops_paired"]]
    return " / ".join(f"{d:+.4f} ({se:.4f})" for _, _, d, se in pairs) or "–"


def tables(cells: list[Cell]) -> str:
    names = [n for n in ORDER if any(n in c.runs for c in cells)]
    head = ["run"] + [f"{c.label} ({c.budget:.0e} FLOPs)" for c in cells]
    sep = "|" + "---|" * len(head)
    out = ["Val bpb (whole val split; mean over seeds, per seed in brackets):", "", "| " + " | ".join(head) + " |", sep]
    out += ["| " + " | ".join([n] + [bpb_cell(c.runs.get(n)) for c in cells]) + " |" for n in names]
    out += ["", "Eval at 2x the trained loops minus at the trained loops, bpb (standard error), per seed:", ""]
    out += ["| " + " | ".join(head) + " |", sep]
    out += ["| " + " | ".join([n] + [paired_cell(c.runs.get(n)) for c in cells]) + " |" for n in names if n != "dense"]
    telemetry = []
    for c in cells:
        spider = [s for n, by_seed in c.runs.items() if n != "dense" for s in by_seed.values()]
        segmented = [s for s in spider if s["eval_bps"] is not None]  # runs that logged bytes/segment
        if not segmented:
            continue
        rng = lambda key: f"{min(s[key] for s in segmented):.2f}-{max(s[key] for s in segmented):.2f}"
        load = min(s["load_min"] for s in spider if s["load_min"] is not None)
        telemetry.append(
            f"- {c.label}: bytes/segment train {rng('train_bps')}, eval {rng('eval_bps')}; "
            f"smallest expert load {load:.3f} of routed slots (uniform {1 / 8:.3f})"
        )
    out += ["", "Telemetry over every Spider run of the cell (last logged step; eval at the last validation):", ""]
    return "\n".join(out + telemetry)


def plot(cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = list(dict.fromkeys(c.corpus for c in cells))
    fig, axes = plt.subplots(1, len(corpora), figsize=(6 * len(corpora), 4.5), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        mine = sorted((c for c in cells if c.corpus == corpus), key=lambda c: c.budget)
        for name in MAIN:
            pts = [(c.budget, [s["val_bpb"] for s in c.runs[name].values()]) for c in mine if name in c.runs]
            if not pts:
                continue
            x = [b for b, _ in pts]
            (line,) = ax.plot(x, [fmean(v) for _, v in pts], marker="o", lw=2.2 if name in ("spider", "dense") else 1.2)
            line.set_label(name)
            for b, vals in pts:
                ax.scatter([b] * len(vals), vals, s=10, color=line.get_color(), alpha=0.5)
        ax.set_xscale("log")
        ax.set_xticks([c.budget for c in mine], [f"{c.scale}\n{c.budget:.0e}" for c in mine])
        ax.minorticks_off()
        ax.set_xlabel("flavor and training FLOPs")
        ax.set_ylabel("val bits per byte")
        ax.set_title(corpus)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Spider vs dense at equal training FLOPs, two scales (dots: seeds, line: mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", action="append", required=True, help="SCALE/CORPUS:BUDGET:SEED=DIR[+DIR][;SEED=DIR]")
    p.add_argument("--md", default=None, help="write the tables here")
    p.add_argument("--json", default=None, help="write every counted run's summary here")
    p.add_argument("--plot", default=None, help="write the picture here")
    args = p.parse_args(argv)
    cells = [load_cell(spec) for spec in args.cell]
    md = tables(cells)
    print(md)
    if args.md:
        Path(args.md).write_text(md + "\n")
    if args.json:
        dump = [
            {"scale": c.scale, "corpus": c.corpus, "budget": c.budget, "seed": seed, **s}
            for c in cells
            for by_seed in c.runs.values()
            for seed, s in by_seed.items()
        ]
        Path(args.json).write_text(json.dumps(dump, indent=1) + "\n")
    if args.plot:
        plot(cells, Path(args.plot))


if __name__ == "__main__":
    main()
