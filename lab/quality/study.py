"""The quality study over scales, corpora and seeds: lab.quality.benchmark outputs in, one table of val
bpb per run and cell (scale x corpus), the paired more-loops difference, telemetry ranges and a plot of
val bpb against the training budget per corpus out.

    python -m lab.quality.study \\
        --cell "debug/built-in:1e13:0=outputs/q/debug_builtin_s0;1=outputs/q/debug_builtin_s1" \\
        --cell "small/built-in:4e13:0=outputs/q/small_builtin_s0" \\
        --md study.md --json study.json --plot docs/images/quality_scales.png

A cell is ``SCALE/CORPUS:BUDGET:SEED=DIR[+DIR...][;SEED=DIR...]``: each DIR is a ``--out`` folder of
lab.quality.benchmark (several folders of one seed are merged). A run counts only if its last validation
came at the budget or later (a run stopped early is left out and named on stderr), so every figure is
at equal training FLOPs.

``--study loops`` runs a whole study instead, in one command with a deadline: two core loops against the
shipped one, debug and small, built-in corpus and prose, two seeds:

    python -m lab.quality.study --study loops --prose data/prose --out outputs/loops_study --minutes 8

Its runs go side by side (``--jobs``; on a GPU they share it), each stopped at the deadline (left out and
listed); it writes ``study.md`` (the tables, and the aims: the candidate within 0.005 bpb of the baseline in
every cell and better on the mean; eval at a higher test-time depth better than at the trained depth by
0.005 bpb) and ``study.json`` under ``--out``. ``--report_only`` rebuilds them from the runs already there.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import fmean

from lab.cli import check_output_file, check_positive, parser, refuse, write_whole
from lab.quality.benchmark import RUNS, OutOfTime, load_result, run_one, same_runs, summarise
from lab.quality.benchmark import parse_args as bench_parse_args

PROG = "python -m lab.quality.study"

ORDER = [r.name for r in RUNS]
MAIN = (
    "dense",
    "spider",
    "spider_fixed_segments",
    "spider_learned_segments",
    "spider_fixed_stage_lr",
    "spider_stage_lr",
)


@dataclass
class Cell:
    scale: str
    corpus: str
    budget: float
    # run name -> seed -> summary (lab.quality.benchmark.summarise)
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
        raise refuse(PROG, f"--cell {spec!r}: expected SCALE/CORPUS:BUDGET:SEED=DIR[+DIR][;SEED=DIR]") from None


def load_cell(spec: str) -> Cell:
    return read_cell(*parse_cell(spec))


def read_cell(scale: str, corpus: str, budget: float, dirs: dict[int, list[Path]]) -> Cell:
    """The runs of one cell found in ``dirs`` (seed -> lab.quality.benchmark output folders)."""
    cell = Cell(scale, corpus, budget)
    by_name = {r.name: r for r in RUNS}
    for seed, folders in dirs.items():
        for folder in folders:
            if not folder.is_dir():
                continue
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
    out += ["", "Eval at max_loops minus at the trained loops, bpb (standard error), per seed:", ""]
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
        line = (
            f"- {c.label}: bytes/segment train {rng('train_bps')}, eval {rng('eval_bps')}; "
            f"smallest expert load {load:.3f} of routed slots (uniform {1 / 8:.3f})"
        )
        telemetry.append(line)
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
    write_whole(path, lambda partial: fig.savefig(partial, dpi=120, format=Path(path).suffix[1:]))
    plt.close(fig)


@dataclass(frozen=True)
class Study:
    """A study that ``--study`` runs whole: its cells (scale, corpus, FLOPs budget), seeds and runs, and
    the candidate it judges against the baseline."""

    cells: tuple[tuple[str, str, float], ...]
    seeds: tuple[int, ...]
    runs: tuple[str, ...]
    baseline: str
    candidate: str
    margin: float = 0.005  # bpb: the candidate's allowance per cell, and the test-time depth gain asked


STUDIES = {
    "loops": Study(
        cells=(
            ("debug", "built-in", 1e13),
            ("small", "built-in", 4e13),
            ("debug", "prose", 1e13),
            ("small", "prose", 4e13),
        ),
        seeds=(0, 1),
        runs=("spider", "spider_fixed_segments", "spider_loops2"),
        baseline="spider",
        candidate="spider_loops2",
    ),
}


def cell_dir(out: Path, scale: str, corpus: str, seed: int) -> Path:
    """Where a study keeps one cell's runs of one seed (a lab.quality.benchmark ``--out`` folder)."""
    return out / f"{scale}_{corpus.replace('-', '')}_s{seed}"


def run_study(study: Study, args) -> list[str]:
    """Every (cell, seed, run) of ``study`` through lab.quality.benchmark.run_one, ``args.jobs`` at a time, all
    stopped at ``args.minutes`` after the start; the runs left unfinished, as 'cell seed run: why'. A run that
    trains what another run of its cell trains (lab.quality.benchmark.same_runs) is linked to it, not run again."""
    deadline = time.time() + 60 * args.minutes
    by_name = {r.name: r for r in RUNS}

    def bench_args(scale: str, corpus: str, budget: float, seed: int):
        data = args.prose if corpus == "prose" else None
        return bench_parse_args(  # lab.quality.benchmark's own defaults, with the cell's budget and data
            ["--flavor", scale, "--seed", str(seed), "--flops", str(budget), "--threads", str(args.threads)]
            + ["--probe_steps", str(args.probe_steps), "--val_points", str(args.val_points)]
            + ["--eval_loops", "trained,max"]
            + (["--data", data] if data else [])
        )

    benches = {(cell, seed): bench_args(*cell, seed) for cell in study.cells for seed in study.seeds}
    same = {key: same_runs([by_name[n] for n in study.runs], bench) for key, bench in benches.items()}
    tasks = [(c, seed, n) for c in study.cells for seed in study.seeds for n in study.runs if n not in same[c, seed]]
    tasks.sort(key=lambda t: -t[0][2])  # the largest budgets first, so the short runs fill in behind them

    def one(task) -> str | None:
        cell, seed, name = task
        scale, corpus, _ = cell
        out = cell_dir(Path(args.out), scale, corpus, seed)
        out.mkdir(parents=True, exist_ok=True)
        label = f"{scale}/{corpus} seed {seed} {name}"
        try:
            run_one(by_name[name], benches[cell, seed], out=out, deadline=deadline)
        except (OutOfTime, RuntimeError) as e:
            print(f"[{label}] not finished: {e}", flush=True)
            return f"{label}: {'out of time' if isinstance(e, OutOfTime) else 'failed'}"
        return None

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        unfinished = [m for m in pool.map(one, tasks) if m]
    for ((scale, corpus, _), seed), twins in same.items():
        out = cell_dir(Path(args.out), scale, corpus, seed)
        for name, first in twins.items():
            if (out / first).is_dir():
                (out / name).unlink(missing_ok=True)
                (out / name).symlink_to(first, target_is_directory=True)
                print(f"[{scale}/{corpus} seed {seed} {name}] trains what {first} trains: linked to it", flush=True)
    return unfinished


def pooled(values: list[tuple[float, float]]) -> tuple[float, float]:
    """Mean of per-seed paired differences and its standard error (independent seeds)."""
    n = len(values)
    return fmean(d for d, _ in values), math.sqrt(sum(se * se for _, se in values)) / n


def test_time_options(by_seed: dict[int, dict]) -> dict[str, list[tuple[float, float]]]:
    """Per option of a higher test-time depth ('@4', ...): each seed's paired difference to the trained
    depth (the first eval_loops row), with its standard error."""
    options: dict[str, list[tuple[float, float]]] = {}
    for s in by_seed.values():
        rows = s.get("test_time") or []
        for r in rows[1:]:
            options.setdefault(f"@{r['n_loops']}", []).append((r["diff_bpb"], r["se_bpb"]))
    return {k: v for k, v in options.items() if len(v) == len(by_seed)}


def aims(cells: list[Cell], study: Study) -> str:
    """The study's two aims per cell: (a) the candidate no worse than the baseline by ``margin`` in every
    cell and better on the mean; (b) eval at a higher test-time depth better than at the trained depth by
    ``margin``, with the pooled standard error under a third of that, in at least 3 of the 4 cells."""
    m = study.margin
    head = [
        "cell",
        f"{study.baseline}",
        f"{study.candidate}",
        "difference (a)",
        "best higher test-time depth",
        "gain (s.e.) (b)",
        "(b) met",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    diffs, met_b = [], 0
    for c in cells:
        base, cand = c.runs.get(study.baseline, {}), c.runs.get(study.candidate, {})
        seeds = sorted(set(base) & set(cand))
        if not seeds:
            lines.append(f"| {c.label} | {bpb_cell(base)} | {bpb_cell(cand)} | – | – | – | – |")
            continue
        d = fmean(cand[k]["val_bpb"] - base[k]["val_bpb"] for k in seeds)
        diffs.append(d)
        options = {k: pooled(v) for k, v in test_time_options({k: cand[k] for k in seeds}).items()}
        if options:
            best = min(options, key=lambda k: options[k][0])
            gain, se = options[best]
            ok = gain <= -m and se < m / 3
            met_b += ok
            tt = [best, f"{gain:+.4f} ({se:.4f})", "yes" if ok else f"no (short by {m + gain:.4f})"]
        else:
            tt = ["–", "–", "–"]
        flag = "ok" if d <= m else f"over by {d - m:.4f}"
        lines.append(
            f"| {c.label} | {bpb_cell(base)} | {bpb_cell(cand)} | {d:+.4f} over {len(seeds)} seed(s), {flag} | "
            + " | ".join(tt)
            + " |"
        )
    out = [
        f"Aims ({study.candidate} against {study.baseline}, paired by seed; a higher test-time depth is more "
        "loops, against the trained depth on the same val windows):",
        "",
        *lines,
    ]
    if diffs:
        within = all(d <= m for d in diffs) and len(diffs) == len(study.cells)
        ok_a = within and fmean(diffs) < 0
        out += [
            "",
            f"- (a) mean difference over {len(diffs)} of {len(study.cells)} cells: {fmean(diffs):+.4f} bpb, "
            f"{'every cell' if within else 'not every cell'} within {m}: " + ("met" if ok_a else "not met"),
            f"- (b) met in {met_b} of {len(study.cells)} cells (3 asked): " + ("met" if met_b >= 3 else "not met"),
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = parser(PROG, __doc__)
    p.add_argument("--cell", action="append", default=[], help="SCALE/CORPUS:BUDGET:SEED=DIR[+DIR][;SEED=DIR]")
    p.add_argument("--study", choices=sorted(STUDIES), default=None, help="run this whole study (see above)")
    p.add_argument("--out", default="outputs/study", help="--study: the runs' folders, study.md and study.json")
    p.add_argument(
        "--prose", default=None, help="--study: the prose corpus (a bytes folder, python -m lab.corpus.html_to_prose)"
    )
    p.add_argument("--minutes", type=float, default=8.0, help="--study: stop every run this long after the start")
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="--study: runs at a time (default: all, at most 2 per CPU core, on a GPU; 2 on CPU)",
    )
    p.add_argument("--threads", type=int, default=1, help="--study: OMP threads per run")
    p.add_argument("--seeds", default=None, help="--study: these seeds instead of the study's (e.g. 1)")
    p.add_argument(
        "--runs", default=None, help="--study: these runs instead of the study's (lab.quality.benchmark names)"
    )
    p.add_argument(
        "--budget_scale", type=float, default=1.0, help="--study: scale every budget (a quick dry run: 0.005)"
    )
    p.add_argument("--probe_steps", type=int, default=60, help="--study: steps of each run's FLOPs probe")
    p.add_argument("--val_points", type=int, default=4, help="--study: validations per run (whole val split each)")
    p.add_argument("--report_only", action="store_true", help="--study: tables from the runs already under --out")
    p.add_argument("--md", default=None, help="write the tables here")
    p.add_argument("--json", default=None, help="write every counted run's summary here")
    p.add_argument("--plot", default=None, help="write the picture here")
    args = p.parse_args(argv)
    if bool(args.cell) == bool(args.study):
        raise refuse(PROG, "give --cell (tables from existing runs) or --study (run a whole study), one of them")
    check_positive(PROG, minutes=args.minutes, jobs=args.jobs, threads=args.threads, budget_scale=args.budget_scale)
    check_positive(PROG, val_points=args.val_points)
    if args.probe_steps < 2:
        raise refuse(PROG, f"--probe_steps {args.probe_steps}: give at least 2 (the second half is measured)")
    if args.seeds is not None and not all(k.strip().isdigit() for k in args.seeds.split(",")):
        raise refuse(PROG, f"--seeds {args.seeds}: give whole numbers, comma-separated, e.g. 0,1")
    for flag in ("md", "json", "plot"):
        check_output_file(PROG, f"--{flag}", getattr(args, flag))
    for spec in args.cell:
        for folders in parse_cell(spec)[3].values():
            missing = [str(f) for f in folders if not f.is_dir()]
            if missing:
                raise refuse(
                    PROG, f"--cell {spec!r}: no folder {', '.join(missing)}; give lab.quality.benchmark --out folders"
                )
    study = STUDIES.get(args.study)
    unfinished: list[str] = []
    if study is not None:
        study = replace(
            study,
            cells=tuple((scale, corpus, budget * args.budget_scale) for scale, corpus, budget in study.cells),
            seeds=tuple(int(k) for k in args.seeds.split(",")) if args.seeds else study.seeds,
            runs=tuple(args.runs.split(",")) if args.runs else study.runs,
        )
        unknown = set(study.runs) - {r.name for r in RUNS}
        if unknown:
            raise refuse(PROG, f"--runs: unknown {sorted(unknown)} (python -m lab.quality.benchmark --list)")
        if args.prose is None and any(c[1] == "prose" for c in study.cells) and not args.report_only:
            raise refuse(
                PROG, f"--study {args.study} has prose cells: give --prose DIR (python -m lab.corpus.html_to_prose)"
            )
        if args.prose is not None and not (Path(args.prose) / "train").is_dir():
            raise refuse(PROG, f"--prose {args.prose}: not a bytes folder (no train/ inside)")
        if args.jobs is None:  # on a GPU every run at once (their processes share it), else one per core
            import torch

            n_runs = len(study.cells) * len(study.seeds) * len(study.runs)
            args.jobs = min(n_runs, 2 * (os.cpu_count() or 1)) if torch.cuda.is_available() else 2
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise refuse(PROG, f"--out {args.out}: is a file; give a folder")
        out.mkdir(parents=True, exist_ok=True)
        args.md = args.md or str(out / "study.md")
        args.json = args.json or str(out / "study.json")
        if not args.report_only:
            started = time.time()
            unfinished = run_study(study, args)
            print(f"study: {time.time() - started:.0f} s, {len(unfinished)} run(s) not finished", flush=True)
        cells = [
            read_cell(scale, corpus, budget, {seed: [cell_dir(out, scale, corpus, seed)] for seed in study.seeds})
            for scale, corpus, budget in study.cells
        ]
    else:
        cells = [load_cell(spec) for spec in args.cell]
    md = tables(cells)
    if study is not None:
        md += "\n\n" + aims(cells, study)
        if unfinished:
            md += "\n\nNot finished (left out):\n\n" + "\n".join(f"- {u}" for u in unfinished)
    print(md)
    if args.md:
        write_whole(args.md, md + "\n")
    if args.json:
        dump = [
            {"scale": c.scale, "corpus": c.corpus, "budget": c.budget, "seed": seed, **s}
            for c in cells
            for by_seed in c.runs.values()
            for seed, s in by_seed.items()
        ]
        write_whole(args.json, json.dumps({"runs": dump, "unfinished": unfinished} if study else dump, indent=1) + "\n")
    if args.plot:
        plot(cells, Path(args.plot))


if __name__ == "__main__":
    main()
