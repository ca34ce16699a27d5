"""Equal-compute quality benchmark: Spider, its ablations and the dense baseline, each trained to
the same training-FLOPs budget on the same corpus, validated on the whole val split.

    python -m lab.quality.benchmark                      # built-in corpus, 1e13 FLOPs per run
    python -m lab.quality.benchmark --data DIR --flops 3e13 --out outputs/quality
    python -m lab.quality.benchmark --runs spider,dense  # a subset (names: --list)

Every run is ``python -m spider_titan.train`` with the shipped debug configs plus overrides (no
other code path). By default (``--length flops``) each run trains to the budget itself
(``--training.flops_budget``): it stops at the first step whose training FLOPs reach the budget,
and its learning rate decays over the steps the budget affords at the FLOPs per step spent so far,
so every run gets the same compute however its cost per step drifts. The FLOPs are the model's own
count (Spider's ``aux["flops_per_byte"]``: the segments and loops actually run; the dense model's
formula). A short probe run per row still sets the step cap (``--cap`` times its estimate) and the
validation interval. ``--length steps`` plans ``--training.steps`` from the probe instead (over its
second half, ``--margin`` more for Spider: how the tables before 2026-11-27 were made). The table
reports the FLOPs each run really used. A row that trains exactly what another requested row trains
(``spider_fixed_segments`` at `small`, which ships fixed segments) is reported from it, not trained again.

Outputs under ``--out``: one dump folder per run (``metrics.jsonl``), ``quality.md`` (the table)
and ``quality.png`` (val bpb against training FLOPs). ``--plot-to`` also copies the picture
(docs/images/quality.png for the docs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from lab.cli import check_data, check_output_file, check_positive, parser, refuse, write_whole
from lab.overrides import parse_sets, trainer_flags

ROOT = Path(__file__).resolve().parents[2]
SPIDER_CONFIG = "train_configs/debug_model.toml"
DENSE_CONFIG = "train_configs/debug_dense.toml"


@dataclass(frozen=True)
class Run:
    name: str
    config: str
    overrides: dict[str, object]  # trainer overrides (section.key -> value), after the config file's
    what: str


STAGE_LR = {"optimizer.lr_multipliers": '["*=2", "core=1"]'}
# Fixed segments: a boundary every target_bytes_per_segment bytes and the mean convention (a chunk the mean
# of its bytes, byte t reads the chunk before its own), which beats the chunk-start convention there
FIXED = {"model.boundary_predictor": "fixed", "model.chunk_convention": "mean"}
# Learned segments: H-Net's cosine routing and chunk-start convention (debug's and 1B's default; `small` trains
# fixed segments since 2026-11-29)
LEARNED = {"model.boundary_predictor": "cosine", "model.chunk_convention": "first"}
# The depth recipes below train around two core loops (debug's and `small`'s default until 2026-11-29; both
# train one now)
TWO_LOOPS = {"model.n_loops": 2}
# Rows of options that have left the model (the MLP predictor, ACT, the hinge loss, H-Net's path element by
# element, ...) are in lab/log/ with the commit that ran them; v0.1.0 still has the loop-recipe and ratio-band rows.
RUNS = [
    Run("spider", SPIDER_CONFIG, {}, "Spider, the flavor's shipped defaults"),
    Run("dense", DENSE_CONFIG, {}, "dense baseline, the flavor's defaults"),
    Run(
        "spider_fixed_segments",
        SPIDER_CONFIG,
        FIXED,
        "segments of exactly target_bytes_per_segment bytes (no learned boundaries), mean chunks",
    ),
    Run(
        "spider_learned_segments",
        SPIDER_CONFIG,
        LEARNED,
        "boundaries placed by the learned cosine predictor, chunk-start convention (the default but at `small`)",
    ),
    Run(
        "spider_fixed_stage_lr",
        SPIDER_CONFIG,
        FIXED | STAGE_LR,
        "fixed segments with H-Net's per-stage learning rates (byte stages 2x)",
    ),
    Run("spider_stage_lr", SPIDER_CONFIG, STAGE_LR, "shipped defaults with H-Net's per-stage learning rates"),
    Run("spider_no_first", SPIDER_CONFIG, {"model.chunk_convention": "mean"}, "learned segments, mean chunks"),
    Run(
        "spider_full_width_predictor",
        SPIDER_CONFIG,
        {"model.boundary_dim": "0"},
        "the boundary predictor's q/k projections at the model width (H-Net's square routing module)",
    ),
    Run(
        "spider_no_engram",
        SPIDER_CONFIG,
        {"model.engram_layers": "[]"},
        "no Engram memory (small's default since 2026-11-30)",
    ),
    Run(
        "spider_more_engram",
        SPIDER_CONFIG,
        {"model.engram_layers": "[0, 1]", "model.engram_buckets": "8192"},
        "an Engram in both core blocks with 8,192 buckets: small's default from 2026-11-28 to 2026-11-30",
    ),
    Run("spider_one_engram", SPIDER_CONFIG, {"model.engram_layers": "[1]"}, "one Engram, in core block 1"),
    Run("spider_engram_2048", SPIDER_CONFIG, {"model.engram_buckets": "2048"}, "Engram tables of 2,048 buckets"),
    Run("spider_engram_16k", SPIDER_CONFIG, {"model.engram_buckets": "16384"}, "Engram tables of 16,384 buckets"),
    Run(
        "spider_no_ngrams",
        SPIDER_CONFIG,
        {"model.byte_ngram_orders": "[]"},
        "no hashed byte n-gram embeddings (BLT's; small's default since 2026-11-28, debug's since 2026-11-29)",
    ),
    Run(
        "dense_no_ngrams",
        DENSE_CONFIG,
        {"model.byte_ngram_orders": "[]"},
        "the dense baseline without its hashed byte n-gram embeddings",
    ),
    Run(
        "spider_aux_free",
        SPIDER_CONFIG,
        {"moe.load_balance": "aux_free"},
        "experts balanced by DeepSeek-V3's selection bias alone (no balancing loss)",
    ),
    Run(
        "spider_balance_both",
        SPIDER_CONFIG,
        {"moe.load_balance": "both"},
        "the balancing loss and the selection bias together (the 1B configs' setting)",
    ),
    Run(
        "spider_loops1",
        SPIDER_CONFIG,
        {"model.n_loops": "1"},
        "one core loop (no recurrence): debug's and small's default",
    ),
    Run("spider_loops2", SPIDER_CONFIG, TWO_LOOPS, "two core loops: debug's and small's default until 2026-11-29"),
]


def train_cmd(run: Run, dump: Path, steps: int, extra: dict[str, object], *, val_freq: int | None) -> list[str]:
    """``python -m spider_titan.train`` for ``run``: its config and overrides, then ``extra`` (which win)."""
    overrides: dict[str, object] = {
        "job.config_file": run.config,
        "job.dump_folder": dump,
        "training.steps": steps,
        "metrics.enable_tensorboard": False,
        "checkpoint.export_at_end": val_freq is not None,  # the trained model, for evaluations after the run
        **run.overrides,
        **extra,
    }
    if val_freq is None:
        overrides |= {"validation.enable": False, "metrics.log_freq": 1}
    else:
        overrides |= {
            "validation.enable": True,
            "validation.freq": val_freq,
            "validation.steps": -1,
            "metrics.log_freq": max(1, min(25, val_freq)),
        }
    return [sys.executable, "-m", "spider_titan.train", *trainer_flags(overrides)]


def read_metrics(dump: Path) -> list[dict]:
    path = dump / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class OutOfTime(RuntimeError):
    """A run's command was stopped at the deadline (``execute``'s ``deadline``)."""


def execute(cmd: list[str], log: Path, threads: int, deadline: float | None = None) -> None:
    """Run ``cmd`` from the repository root, its output in ``log``; stopped (``OutOfTime``) at ``deadline``
    (a ``time.time()``), when one is given."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    timeout = None if deadline is None else max(1.0, deadline - time.time())
    with log.open("w") as f:
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, check=False, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise OutOfTime(f"{' '.join(cmd[:4])} ... stopped at the deadline; see {log}") from None
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")


def flops_per_step(
    run: Run, out: Path, extra: dict[str, object], probe_steps: int, threads: int, deadline: float | None = None
) -> float:
    """Training FLOPs of one step: measured by a probe for Spider, the formula for dense."""
    dump = out / f"probe_{run.name}"
    shutil.rmtree(dump, ignore_errors=True)
    cmd = train_cmd(run, dump, probe_steps, extra, val_freq=None)
    execute(cmd, out / f"probe_{run.name}.log", threads, deadline)
    rows = [r for r in read_metrics(dump) if "train_flops" in r and "loss" in r]
    if not rows:
        raise RuntimeError(f"{dump}/metrics.jsonl has no train_flops: does spider_titan.train log them?")
    # The second half of the probe only: the segmentation settles in the first steps (a fresh
    # cosine predictor cuts more often than the target), and those steps under-represent the run.
    first = next(r for r in rows if r["step"] >= probe_steps // 2)
    last = rows[-1]
    if last["step"] == first["step"]:
        return last["train_flops"] / last["step"]
    return (last["train_flops"] - first["train_flops"]) / (last["step"] - first["step"])


def eval_loops_cmd(run: Run, dump: Path, loops: str, data: str | None) -> list[str]:
    """scripts/evaluate.py on a run's export at ``loops``, each count paired with the first."""
    cmd = [sys.executable, "scripts/evaluate.py", "--model", str(dump / "export"), "--n_loops", loops]
    cmd += ["--json", str(dump / "eval_loops.json")]
    return cmd + (["--data", str(Path(data).resolve())] if data else [])


def run_one(run: Run, args, out: Path | None = None, deadline: float | None = None) -> dict:
    """Probe, train to the budget and evaluate ``run`` (dumps under ``out``, default ``args.out``); every
    command is stopped at ``deadline`` (``OutOfTime``)."""
    out = Path(args.out) if out is None else out
    extra = run_overrides(args, run)
    budget = args.flops if run.name in ("spider", "dense") else args.ablation_flops or args.flops
    per_step = flops_per_step(run, out, extra, args.probe_steps, args.threads, deadline)
    if args.length == "flops":  # the run spends the budget itself; the probe sets its cap and validations
        estimate = max(1, math.ceil(budget / per_step))
        steps = math.ceil(args.cap * estimate)
        length = {"training.flops_budget": f"{budget:.6g}"}
        plan = f"~{estimate} steps to {budget:.3g} FLOPs (at most {steps})"
    else:  # a margin for Spider: its FLOPs per step drift with the segmentation, and the budget is a floor
        margin = args.margin if run.config == SPIDER_CONFIG else 1.0
        steps = estimate = max(1, math.ceil(margin * budget / per_step))
        length, plan = {}, f"{steps} steps"
    # The last step always validates; one point means no other (a validation just before the end of a
    # budget run, at a step the estimate put last, would be wasted and uncalibrated).
    val_freq = steps if args.val_points == 1 else max(1, math.ceil(estimate / args.val_points))
    dump = out / run.name
    shutil.rmtree(dump, ignore_errors=True)
    t0 = time.time()
    print(f"[{run.name}] {per_step:.3e} FLOPs/step -> {plan}, validation every {val_freq}", flush=True)
    cmd = train_cmd(run, dump, steps, extra | length, val_freq=val_freq)
    execute(cmd, out / f"{run.name}.log", args.threads, deadline)
    if args.eval_loops and run.config == SPIDER_CONFIG:
        # Paired eval at several depths on the same val windows: each difference's standard error.
        cmd = eval_loops_cmd(run, dump, args.eval_loops, args.data)
        execute(cmd, out / f"{run.name}.eval_loops.log", args.threads, deadline)
    print(f"[{run.name}] done in {time.time() - t0:.0f} s", flush=True)
    return load_result(run, dump, steps if args.length == "steps" else None)


def load_result(run: Run, dump: Path, steps: int | None = None) -> dict:
    """What a run left in ``dump``: its metrics, its paired loops figure, and ``steps`` (the last logged
    step when None), as ``summarise`` takes them."""
    metrics = read_metrics(dump)
    if steps is None:
        steps = max((m["step"] for m in metrics), default=0)
    return {"run": run, "steps": steps, "metrics": metrics, "test_time": read_eval_loops(dump)}


def read_eval_loops(dump: Path) -> list[dict]:
    """The rows of the run's eval_loops.json (one per loop count; the first is the reference), or none."""
    path = dump / "eval_loops.json"
    return json.loads(path.read_text()) if path.exists() else []


def more_loops(rows: list[dict]) -> tuple[int, int, float, float] | None:
    """(reference loops, most loops, bpb difference, its standard error) from eval_loops rows."""
    if len(rows) < 2:
        return None
    last = max(rows, key=lambda r: r["n_loops"])
    return rows[0]["n_loops"], last["n_loops"], last["diff_bpb"], last["se_bpb"]


def summarise(result: dict) -> dict:
    rows = result["metrics"]
    train = [r for r in rows if "loss" in r and "val_bpb" not in r]
    val = [r for r in rows if "val_bpb" in r]
    last_t, last_v = (train[-1] if train else {}), (val[-1] if val else {})
    return {
        "name": result["run"].name,
        "what": result["run"].what,
        "steps": result["steps"],
        "flops": last_v.get("train_flops", last_t.get("train_flops", float("nan"))),
        "wall_s": last_v.get("elapsed_s", last_t.get("elapsed_s", float("nan"))),
        "val_bpb": last_v.get("val_bpb", float("nan")),
        "val_bpb_loops": {
            int(k[len("val_bpb_loops") :]): v for k, v in last_v.items() if k.startswith("val_bpb_loops")
        },
        "train_bps": last_t.get("bytes_per_segment"),
        "eval_bps": last_v.get("val_bytes_per_segment"),
        "train_loops": last_t.get("mean_loops"),
        "eval_loops": last_v.get("val_mean_loops"),
        "load_min": last_t.get("expert_load_min"),
        "load_max": last_t.get("expert_load_max"),
        "loops_paired": more_loops(result.get("test_time") or []),
        "test_time": result.get("test_time") or [],
        "curve": [(r["train_flops"], r["val_bpb"]) for r in val if "train_flops" in r],
        "bps_curve": [(r["step"], r.get("val_bytes_per_segment")) for r in val],
    }


def fmt(v, spec: str = ".3f") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def paired_cell(paired) -> str:
    """'@4 - @2: +0.0003 (0.0002)' from read_eval_loops, or a dash."""
    if paired is None:
        return "–"
    a, b, diff, se = paired
    return f"@{b} - @{a}: {diff:+.4f} ({se:.4f})"


def table(summaries: list[dict]) -> str:
    loops = sorted({n for s in summaries for n in s["val_bpb_loops"]})
    head = (
        ["run", "steps", "train FLOPs", "wall s", "val bpb"]
        + [f"bpb @{n} loops" for n in loops]
        + ["paired (s.e.)", "bytes/seg train", "bytes/seg eval", "mean loops train", "mean loops eval"]
        + ["expert load min/max", "what"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        load = "–" if s["load_min"] is None else f"{s['load_min']:.3f} / {s['load_max']:.3f}"
        cells = (
            [s["name"], str(s["steps"]), fmt(s["flops"], ".3e"), fmt(s["wall_s"], ".0f"), fmt(s["val_bpb"])]
            + [fmt(s["val_bpb_loops"].get(n)) for n in loops]
            + [paired_cell(s["loops_paired"])]
            + [
                fmt(s["train_bps"], ".2f"),
                fmt(s["eval_bps"], ".2f"),
                fmt(s["train_loops"], ".2f"),
                fmt(s["eval_loops"], ".2f"),
                load,
                s["what"],
            ]
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summaries: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in summaries:
        if not s["curve"]:
            continue
        x, y = zip(*s["curve"])
        main = s["name"] in ("spider", "dense")
        ax.plot(x, y, marker="o", lw=2.2 if main else 1.0, ls="-" if main else "--", label=s["name"])
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs (measured)")
    ax.set_ylabel("val bits per byte (whole val split)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_whole(path, lambda partial: fig.savefig(partial, dpi=120, format=Path(path).suffix[1:]))
    plt.close(fig)


def run_overrides(args, run: Run | None = None) -> dict[str, object]:
    """The trainer overrides every run of one invocation shares: corpus, flavor and seed, then
    ``--spider_set`` for a Spider ``run`` or ``--dense_set`` for a dense one."""
    data = {"training.dataset": "bytes", "training.dataset_path": Path(args.data).resolve()} if args.data else {}
    own = {SPIDER_CONFIG: args.spider_set, DENSE_CONFIG: args.dense_set}.get(run.config, {}) if run else {}
    return data | {"model.flavor": args.flavor, "training.seed": args.seed} | own


def trained_as(run: Run, args):
    """What ``run`` trains in this invocation: its model's arguments (flavor and overrides resolved) and the
    rest of its job config, so that two rows that differ only in how they spell it compare equal."""
    from spider_titan.config.manager import parse_args
    from spider_titan.config.validate import model_args_and_problems

    cfg = parse_args(trainer_flags({"job.config_file": run.config, **run.overrides, **run_overrides(args, run)}))
    model_args, _ = model_args_and_problems(cfg)
    return model_args, replace(cfg, model=replace(cfg.model, overrides={}))


def same_runs(runs: list[Run], args) -> dict[str, str]:
    """Each run that trains exactly what an earlier one of ``runs`` trains (e.g. ``spider_fixed_segments``
    at a flavor that ships fixed segments), mapped to that earlier run's name."""
    seen: list[tuple[object, str]] = []
    same = {}
    for run in runs:
        key = trained_as(run, args)
        first = next((name for k, name in seen if k == key), None)
        if first is None:
            seen.append((key, run.name))
        else:
            same[run.name] = first
    return same


PROG = "python -m lab.quality.benchmark"


def arg_parser() -> argparse.ArgumentParser:
    """The command line (documented by ``--help``); :func:`parse_args` reads and checks it."""
    p = parser(PROG, __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flops", type=float, default=1e13, help="training FLOPs budget of spider and dense")
    p.add_argument("--ablation_flops", type=float, default=None, help="budget of the ablations (default: --flops)")
    p.add_argument("--flavor", default="debug", help="model flavor of every run (debug; small: ~4x its FLOPs per byte)")
    p.add_argument("--seed", type=int, default=0, help="training seed of every run (--training.seed)")
    p.add_argument("--data", default=None, help="a bytes folder (--training.dataset bytes); default: built-in corpus")
    p.add_argument("--out", default="outputs/quality", help="folder for run dumps, table and picture")
    p.add_argument("--runs", default=",".join(r.name for r in RUNS), help="comma-separated run names (--list)")
    p.add_argument("--val_points", type=int, default=4, help="validations per run (whole val split each)")
    p.add_argument("--probe_steps", type=int, default=60, help="steps of the FLOPs probe (the second half is measured)")
    p.add_argument(
        "--length",
        choices=("flops", "steps"),
        default="flops",
        help="flops: every run trains to the budget itself (--training.flops_budget); steps: --training.steps "
        "planned from the probe (the tables before 2026-11-27)",
    )
    p.add_argument(
        "--cap",
        type=float,
        default=1.5,
        help="--length flops: a run may take at most this many times the probe's step estimate",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=1.10,
        help="--length steps: Spider runs plan this many times the probed steps (measured: a 60-step probe "
        "overestimated the debug run's FLOPs per step by ~7 %%)",
    )
    p.add_argument(
        "--eval_loops",
        default="trained,max",
        help="after each Spider run, scripts/evaluate.py at these loop counts ('trained', 'max' or numbers; "
        "the paired difference to the first, with its standard error); empty: skip",
    )
    p.add_argument(
        "--spider_set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a trainer override (repeatable) added to every Spider run after its own, e.g. "
        "--spider_set model.n_experts=16 --spider_set model.top_k=4 (the dense runs do not get them)",
    )
    p.add_argument(
        "--dense_set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="the same for every dense run (the Spider runs do not get them)",
    )
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per run")
    p.add_argument("--plot_to", default=None, help="also copy the picture here (e.g. docs/images/quality.png)")
    p.add_argument("--list", action="store_true", help="list the runs and exit")
    p.add_argument("--report_only", action="store_true", help="rebuild table and picture from existing dumps")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before any run starts: a mistake is one line and exit status 1 or 2."""
    from spider_titan import registry

    args = arg_parser().parse_args(argv)
    check_positive(PROG, flops=args.flops, ablation_flops=args.ablation_flops, cap=args.cap, margin=args.margin)
    check_positive(PROG, val_points=args.val_points, jobs=args.jobs, threads=args.threads)
    if args.probe_steps < 2:
        raise refuse(PROG, f"--probe_steps {args.probe_steps}: give at least 2 (the second half is measured)")
    flavors = sorted(set(registry.get("model", "spider").flavors) & set(registry.get("model", "dense").flavors))
    if args.flavor not in flavors:
        raise refuse(PROG, f"--flavor {args.flavor}: not a flavor of both models; choose from {', '.join(flavors)}")
    check_data(PROG, "--data", args.data)
    by_name = {r.name for r in RUNS}
    unknown = [n for n in args.runs.split(",") if n not in by_name]
    if unknown:
        raise refuse(PROG, f"--runs: unknown {unknown}; choose from {PROG} --list")
    for count in (c for c in args.eval_loops.split(",") if c):
        if count not in ("trained", "max") and not (count.isdigit() and int(count) > 0):
            raise refuse(PROG, f"--eval_loops {args.eval_loops}: counts are positive integers, 'trained' or 'max'")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise refuse(PROG, f"--out {args.out}: is a file; give a folder")
    check_output_file(PROG, "--plot_to", args.plot_to)
    try:
        args.spider_set = parse_sets(args.spider_set, "--spider_set")
        args.dense_set = parse_sets(args.dense_set, "--dense_set")
    except ValueError as e:
        raise refuse(PROG, str(e)) from None
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.list:
        for r in RUNS:
            print(f"{r.name:34} {r.what}  {' '.join(trainer_flags(r.overrides))}")
        return
    by_name = {r.name: r for r in RUNS}
    runs = [by_name[n] for n in args.runs.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    same = same_runs(runs, args)
    for name, first in same.items():
        print(f"[{name}] trains what {first} trains at --flavor {args.flavor}: reported from it, not run again")
    own = [r for r in runs if r.name not in same]

    if args.report_only:
        done = {r.name: res for r in own if (res := load_result(r, out / r.name))["metrics"]}
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            done = {r.name: res for r, res in zip(own, pool.map(lambda r: run_one(r, args), own))}
    for run in runs:
        if same.get(run.name) in done:
            done[run.name] = {**done[same[run.name]], "run": replace(run, what=f"{run.what} (= {same[run.name]})")}
    results = [done[r.name] for r in runs if r.name in done]
    summaries = [summarise(r) for r in results]
    md = table(summaries)
    for kind, extra in (("Spider", args.spider_set), ("Dense", args.dense_set)):
        if extra:
            md = f"{kind} runs with `{' '.join(trainer_flags(extra))}`.\n\n{md}"
    write_whole(out / "quality.md", md + "\n")
    write_whole(out / "quality.json", json.dumps(summaries, indent=1))
    corpus = Path(args.data).name if args.data else "built-in corpus"
    plot(summaries, out / "quality.png", f"Spider vs dense at equal training FLOPs ({args.flavor}, {corpus})")
    if args.plot_to:
        write_whole(args.plot_to, (out / "quality.png").read_bytes())
    print(md)


if __name__ == "__main__":
    main()
