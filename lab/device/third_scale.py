"""The prepared call for a lent GPU (issue 74): Spider against dense at the third scale, and the 1B harness rows.

    make gpu                                              # on the GPU machine: OUT=$OUT, the defaults below
    python -m lab.device.third_scale --out $OUT           # the same
    python -m lab.device.third_scale --out DIR --dry_run  # tiny shapes on a CPU, a minute (lab/tests)

One command, six parts, each with its own time budget (``--*_s``; the whole call at most ``--total_s``, 470 s
by default, inside the issue's 8 minutes), so one slow part cannot eat the call:

1. **setup**: wheels carried in ``.whl/`` (torchao for the fp8 rows) installed to a folder of their own;
   without them the fp8 rows are skipped with the harness's reason.
2. **data**: ``scripts/prepare_data.py`` turns the carried corpus (``--corpus``: ``train.jsonl.xz`` and
   ``held_out.jsonl.xz`` from ``python -m lab.corpus.device_corpus``) into shards: the training mix with a 1 %
   val split, and the held-out source (manual pages, which no run trains on) whose val split is the second
   val set.
3. **probe**: every run (``VARIANTS`` x ``--seeds``) side by side on the one GPU for ``--probe_steps`` steps:
   each one's FLOPs per second and start-up time as they run together.
4. **train**: the same runs side by side to one training-FLOPs budget, the largest that the slowest run reaches
   inside ``--train_s`` by the probe (at most ``--target_x`` times `small`'s 4e13, and the table says when it is
   under the issue's floor of 100x): Spider ``medium`` with its 1B choices (learned boundaries, 6 loops,
   Engrams, static shapes, one CUDA graph per step), the same with fixed 4-byte segments and one loop, and
   dense ``medium``. Each trains with ``--training.flops_budget``, so all spend the same compute.
5. **eval**: every export read on both val sets on the same windows (at most ``--eval_windows`` each), each
   pair's bpb difference with its paired standard error over the windows, per seed and pooled over the seeds
   (the per-window differences averaged over seeds; the seeds' spread beside it).
6. **harness**: the 1B rows left open (``python -m lab.bench.gpu``: dense_1b, the shipped one-GPU config's
   setup, fp8) in the time left, at most ``--harness_s``.

Writes ``third_scale.md`` (one table per part) and ``third_scale.json`` under ``--out``, with the harness's own
``gpu_1b.md`` / ``gpu_1b.json`` and ``logs.tar.gz`` (every run's log tail); the run folders (exports) stay
in ``--work``. The decision the numbers feed is written before the run:
lab/log/2026-12-01-third-scale-decision-rule.md, applied by ``verdict`` in the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPIDER_CONFIG = "train_configs/debug_model.toml"
DENSE_CONFIG = "train_configs/debug_dense.toml"
SMALL_BUDGET = 4e13  # `small`'s training FLOPs per run in the quality study (docs/benchmarks.md)
FLOOR_X = 100  # the issue's floor: at least 100x `small`'s budget


@dataclass(frozen=True)
class Variant:
    name: str
    config: str
    overrides: tuple[str, ...]
    what: str


VARIANTS = (
    Variant("spider", SPIDER_CONFIG, (), "Spider medium, the 1B choices: learned boundaries, 6 loops, Engrams"),
    Variant(
        "spider_fixed_1loop",
        SPIDER_CONFIG,
        ("--model.boundary_predictor", "fixed", "--model.chunk_convention", "mean", "--model.n_loops", "1"),
        "Spider medium, fixed 4-byte segments (mean chunks), one loop",
    ),
    Variant("dense", DENSE_CONFIG, (), "dense medium"),
)
# The pairs the decision rule reads: (a, b) is bpb(a) - bpb(b), negative when a reads better.
PAIRS = (("spider", "dense"), ("spider_fixed_1loop", "dense"), ("spider", "spider_fixed_1loop"))
# On CUDA, the one-GPU 1B config's shapes for Spider (train_configs/spider_1b_1gpu.toml): static slots and packed
# positions, the Triton MoE, both balancers, one CUDA graph per step; every run compiled.
GPU_SPIDER = (
    "--moe.backend",
    "triton",
    "--moe.load_balance",
    "both",
    "--model.segment_capacity",
    "1.5",
    "--model.packed_capacity",
    "1.35",
    "--training.compile",
    "true",
)
GRAPH = ("--training.cuda_graph", "true")
GPU_DENSE = ("--training.compile", "true")
HARNESS_ROWS = "dense_1b,spider_1b_planned,spider_1b_fp8"


@dataclass
class Clock:
    """The call's deadline and each part's: a part gets its budget or what is left, whichever is less."""

    total_s: float
    start: float = field(default_factory=time.time)

    def left(self) -> float:
        return self.start + self.total_s - time.time()

    def part(self, budget_s: float) -> float:
        """The deadline (a ``time.time()``) of a part of ``budget_s`` seconds starting now."""
        return time.time() + max(0.0, min(budget_s, self.left()))


def log_tail(path: Path, lines: int = 6) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])[-600:]
    except OSError:
        return ""


def run_parallel(jobs: dict[str, list[str]], logs: Path, deadline: float, threads: int) -> dict[str, dict]:
    """Start every command at once (output in ``logs/<name>.log``) and wait until each ends or ``deadline``;
    the ones still running then are stopped. Per job: rc (None: stopped), wall seconds, the log's tail."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    procs, t0, out = {}, time.time(), {}
    for name, cmd in jobs.items():
        f = (logs / f"{name}.log").open("w")
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env), f)
    while procs:
        for name, (proc, f) in list(procs.items()):
            rc = proc.poll()
            if rc is None and time.time() < deadline:
                continue
            if rc is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            f.close()
            out[name] = {"rc": rc, "wall_s": round(time.time() - t0, 1), "log": log_tail(logs / f"{name}.log")}
            del procs[name]
        time.sleep(0.5)
    return out


def read_metrics(dump: Path) -> list[dict]:
    path = dump / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_cmd(v: Variant, dump: Path, args, seed: int, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "spider_titan.train", "--job.config_file", v.config, *v.overrides]
    cmd += ["--job.dump_folder", str(dump), "--model.flavor", args.flavor, "--training.seed", str(seed)]
    cmd += ["--training.dataset", "bytes", "--training.dataset_path", str(args.data_train)]
    cmd += ["--training.seq_len", str(args.seq), "--training.local_batch_size", str(args.batch)]
    cmd += ["--optimizer.lr", str(args.lr), "--lr_scheduler.warmup_steps", str(args.warmup_steps)]
    cmd += ["--validation.enable", "false", "--calibration.enable", "false", "--metrics.enable_tensorboard", "false"]
    if args.cuda:
        cmd += list(GPU_DENSE if v.config == DENSE_CONFIG else GPU_SPIDER)
        if v.config == SPIDER_CONFIG and args.graph:
            cmd += list(GRAPH)
    return cmd + extra


def run_names(args) -> dict[str, tuple[Variant, int]]:
    return {f"{v.name}_s{seed}": (v, seed) for seed in range(args.seeds) for v in VARIANTS}


# ---- parts


def setup(args, report: dict) -> None:
    """Install the carried wheels (``.whl/*.whl``) to a folder of their own, on PYTHONPATH for every child."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    site = Path(args.work) / "site"
    paths = [str(ROOT)]
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        cmd += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, args.setup_s))
        report["setup"] = {"wheels": [w.name for w in wheels], "rc": done.returncode, "err": done.stderr[-400:]}
        if done.returncode == 0:
            paths.append(str(site))
            sys.path.insert(0, str(site))
    else:
        report["setup"] = {"wheels": [], "note": "no .whl/ carried: fp8 rows need torchao"}
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    import torch

    report["machine"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torchao": importlib.util.find_spec("torchao") is not None,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        or "unknown",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def prepare(args, clock: Clock, report: dict) -> bool:
    """Shards of the two corpora, side by side; False when either failed (the quality parts then skip)."""
    corpus = Path(args.corpus)
    data = Path(args.work) / "data"
    shutil.rmtree(data, ignore_errors=True)
    jobs = {}
    for name, fraction in (("train", args.val_fraction), ("held_out", args.held_out_val_fraction)):
        src = corpus / f"{name}.jsonl.xz"
        jobs[f"prepare_{name}"] = [sys.executable, "scripts/prepare_data.py", "--input", str(src)]
        jobs[f"prepare_{name}"] += ["--out", str(data / name), "--val_fraction", str(fraction), "--workers", "8"]
    done = run_parallel(jobs, Path(args.work) / "logs", clock.part(args.data_s), threads=1)
    report["data"] = {k: {"rc": r["rc"], "wall_s": r["wall_s"]} for k, r in done.items()}
    ok = all(r["rc"] == 0 for r in done.values())
    if ok:
        for name in ("train", "held_out"):
            meta = json.loads((data / name / "metadata.json").read_text())
            report["data"][name] = {s: meta["splits"][s]["tokens"] for s in meta["splits"]}
    else:
        report["data"]["failed"] = {k: r["log"] for k, r in done.items() if r["rc"] != 0}
    args.data_train, args.data_held_out = data / "train", data / "held_out"
    return ok


def probe(args, clock: Clock, report: dict) -> dict[str, dict]:
    """Every run for ``--probe_steps`` steps side by side: FLOPs per step and per second over the second half,
    and the seconds before that rate (start-up and compile)."""
    work = Path(args.work) / "probe"
    jobs = {}
    for name, (v, seed) in run_names(args).items():
        extra = ["--training.steps", str(args.probe_steps), "--metrics.log_freq", "1"]
        extra += ["--checkpoint.export_at_end", "false"]
        jobs[name] = train_cmd(v, work / name, args, seed, extra)
    done = run_parallel(jobs, work / "logs", clock.part(args.probe_s), args.threads)
    rates = {}
    for name, r in done.items():
        rows = [m for m in read_metrics(work / name) if "train_flops" in m and "loss" in m]
        half = [m for m in rows if m["step"] > args.probe_steps // 2]
        if len(half) < 2:  # a run stopped at the deadline after its steps (closing, say) still has its rate
            why = "stopped at the probe's deadline" if r["rc"] is None else f"exit status {r['rc']}"
            rates[name] = {"failed": f"{why}: {r['log']}", "rc": r["rc"]}
            continue
        a, b = half[0], half[-1]
        per_step = (b["train_flops"] - a["train_flops"]) / (b["step"] - a["step"])
        s_per_step = (b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"])
        startup = r["wall_s"] - s_per_step * rows[-1]["step"]
        rates[name] = {
            "flops_per_step": per_step,
            "s_per_step": s_per_step,
            "flops_per_s": per_step / max(s_per_step, 1e-9),
            "startup_s": round(max(startup, 0.0), 1),
            "bytes_per_segment": b.get("bytes_per_segment"),
        }
    report["probe"] = rates
    return rates


def choose_budget(args, rates: dict[str, dict]) -> tuple[float, str]:
    """The largest common FLOPs budget the slowest run reaches inside ``--train_s`` (start-up and the export
    counted, a 15 % margin), at most ``--target_x`` x small's; and what limited it."""
    target = args.target_x * SMALL_BUDGET
    fits = {}
    for name, r in rates.items():
        if "flops_per_s" in r:
            fits[name] = 0.85 * r["flops_per_s"] * max(0.0, args.train_s - r["startup_s"] - args.export_s)
    if not fits:
        return 0.0, "no run finished its probe"
    slowest = min(fits, key=fits.get)
    if fits[slowest] >= target:
        return target, f"--target_x {args.target_x:g}"
    return fits[slowest], f"{slowest}'s rate in {args.train_s:g} s"


def train(args, clock: Clock, budget: float, rates: dict[str, dict], report: dict) -> dict[str, dict]:
    work = Path(args.work) / "runs"
    jobs = {}
    for name, (v, seed) in run_names(args).items():
        if "flops_per_step" not in rates.get(name, {}):
            continue
        cap = max(2, math.ceil(1.5 * budget / rates[name]["flops_per_step"]))
        extra = ["--training.flops_budget", f"{budget:.6g}", "--training.steps", str(cap)]
        extra += ["--metrics.log_freq", "1", "--checkpoint.export_at_end", "true"]
        jobs[name] = train_cmd(v, work / name, args, seed, extra)
    done = run_parallel(jobs, work / "logs", clock.part(args.train_s), args.threads)
    runs = {}
    for name, r in done.items():
        rows = [m for m in read_metrics(work / name) if "train_flops" in m and "loss" in m]
        last = rows[-1] if rows else {}
        runs[name] = {
            "rc": r["rc"],
            "wall_s": r["wall_s"],
            "steps": last.get("step"),
            "train_flops": last.get("train_flops"),
            "loss": last.get("loss"),
            "bytes_per_segment": last.get("bytes_per_segment"),
            "export": (work / name / "export").is_dir() and r["rc"] == 0,
        }
        if r["rc"] != 0:
            why = "stopped at the train part's deadline" if r["rc"] is None else f"exit status {r['rc']}"
            runs[name]["log"] = f"{why}: {r['log']}"
    report["train"] = runs
    return runs


def window_losses(path: Path, sets: dict[str, list], device) -> dict[str, tuple]:
    """Per-window summed cross-entropy (nats) and label counts of the export ``path`` over each set of batches
    (the model loaded once; bf16 autocast on CUDA, as it trained)."""
    import torch

    from spider_titan.generation import load_model
    from spider_titan.protocol import window_cross_entropy

    model, _ = load_model(path, device=device)
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )
    out = {}
    with torch.no_grad(), amp:
        for name, batches in sets.items():
            ce, count = [], []
            for inputs, labels in batches:
                c, n = window_cross_entropy(model(inputs.to(device)).logits, labels.to(device))
                ce.append(c.cpu())
                count.append(n.cpu())
            out[name] = (torch.cat(ce), torch.cat(count))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def pooled_pairs(losses: dict[str, tuple], seeds: int) -> dict[str, dict]:
    """Each of ``PAIRS`` on one val set: the paired difference per seed, and pooled over the seeds (the
    per-window differences averaged over the seeds, its paired s.e. over the windows), with half the seeds'
    spread and the total s.e. sqrt(s.e.^2 + half-spread^2) the decision rule reads."""
    import torch

    from spider_titan.protocol import paired_difference

    pairs = {}
    for a, b in PAIRS:
        per_seed, diffs, count = {}, [], None
        for seed in range(seeds):
            ka, kb = f"{a}_s{seed}", f"{b}_s{seed}"
            if ka in losses and kb in losses:
                count = losses[ka][1]
                d, se = paired_difference(losses[ka][0], losses[kb][0], count)
                per_seed[seed] = {"diff": d, "se": se}
                diffs.append(losses[ka][0] - losses[kb][0])
        if not diffs:
            continue
        mean = torch.stack(diffs).mean(0)
        d, se = paired_difference(mean, torch.zeros_like(mean), count)
        values = [v["diff"] for v in per_seed.values()]
        spread = (max(values) - min(values)) / 2 if len(values) > 1 else None
        total = se if spread is None else math.sqrt(se**2 + spread**2)
        pairs[f"{a} - {b}"] = {"diff": d, "se": se, "seed_half_spread": spread, "se_total": total, "per_seed": per_seed}
    return pairs


def evaluate(args, clock: Clock, runs: dict[str, dict], report: dict) -> dict:
    """Every export on both val sets on the same windows (at most ``--eval_windows`` each); each pair's paired
    difference per seed and pooled over the seeds."""
    import torch

    from spider_titan import registry
    from spider_titan.data.loader import ByteDataLoader
    from spider_titan.training.validation import whole_split_batches

    deadline = clock.part(args.eval_s)
    device = torch.device("cuda" if args.cuda else "cpu")
    sets = {}
    for val_name, path in (("train_val", args.data_train), ("held_out_val", args.data_held_out)):
        dataset = registry.get("dataset", "bytes")(str(path), split="val", seed=0)
        loader = ByteDataLoader(
            dataset, seq_len=args.seq, local_batch_size=args.eval_batch, dp_rank=0, dp_world_size=1, seed=0
        )
        sets[val_name] = []
        for batch in whole_split_batches(loader):
            if len(sets[val_name]) * args.eval_batch >= args.eval_windows:
                break
            sets[val_name].append(batch)
    losses: dict[str, dict] = {name: {} for name in sets}
    not_read = []
    for name in report["runs"]:
        if not runs.get(name, {}).get("export"):
            continue
        if time.time() > deadline:
            not_read.append(f"{name}: the eval part's {args.eval_s:g} s were spent")
            continue
        for val_name, got in window_losses(Path(args.work) / "runs" / name / "export", sets, device).items():
            losses[val_name][name] = got
    out: dict = {"not_read": not_read}
    for val_name, batches in sets.items():
        bpb = {k: float(ce.sum() / n.sum()) / math.log(2) for k, (ce, n) in losses[val_name].items()}
        windows = sum(int(b[0].shape[0]) for b in batches)
        out[val_name] = {"windows": windows, "bpb": bpb, "pairs": pooled_pairs(losses[val_name], args.seeds)}
    report["eval"] = out
    return out


def harness(args, clock: Clock, report: dict) -> None:
    """The 1B rows in the time left (at most ``--harness_s``), by the harness's own command and budget."""
    left = min(args.harness_s, clock.left() - args.report_s)
    if left < 30:
        report["harness"] = {"skipped": f"{max(left, 0):.0f} s left of the call (--total_s {args.total_s:g})"}
        return
    cmd = [sys.executable, "-m", "lab.bench.gpu"]
    out = Path(args.out)
    cmd += ["--out", str(Path(args.work) / "harness"), "--rows", args.harness_rows, "--total_s", f"{left - 10:.0f}"]
    cmd += args.harness_args.split()
    done = run_parallel({"harness": cmd}, Path(args.work) / "logs", time.time() + left, threads=args.harness_threads)
    report["harness"] = {"command": " ".join(cmd[1:]), **done["harness"]}
    for name in ("gpu_1b.md", "gpu_1b.json"):
        src = Path(args.work) / "harness" / name
        if src.exists():
            shutil.copy(src, out / name)
    path = Path(args.work) / "harness" / "gpu_1b.json"
    if path.exists():
        rows = json.loads(path.read_text()).get("rows", {})
        report["harness"]["rows"] = {
            name: {k: row.get(k) for k in ("bytes_per_s", "mfu", "tflops", "compile_s", "peak_memory_gib", "skipped")}
            for name, row in rows.items()
        }


# ---- the decision rule (lab/log/2026-12-01-third-scale-decision-rule.md)

MARGIN = 0.01  # bpb: a difference smaller than this changes no config, however precise
TARGET = 0.02  # bpb: the issue's target lead of Spider over dense on held-out text


def counts(pair: dict | None, sign: int) -> bool:
    """Whether a pooled difference counts in direction ``sign`` (-1: a reads better, +1: worse): beyond
    ``MARGIN`` and beyond two of its total standard errors (windows and the seeds' spread)."""
    return pair is not None and sign * pair["diff"] >= MARGIN and sign * pair["diff"] > 2 * pair["se_total"]


def verdict(report: dict) -> dict:
    """The rule's outcome from the pooled held-out figures (the training mix's val set as the check)."""
    ev = report.get("eval", {})
    held, mix = ev.get("held_out_val", {}).get("pairs", {}), ev.get("train_val", {}).get("pairs", {})
    budget_x = report.get("budget", {}).get("x_small", 0.0)
    sf, sd = held.get("spider - spider_fixed_1loop"), held.get("spider - dense")
    fd = held.get("spider_fixed_1loop - dense")
    if sf is None or sd is None or fd is None:
        return {"outcome": "no answer", "why": "a pair is missing on the held-out val set (see train and eval)"}
    if budget_x < FLOOR_X:
        return {"outcome": "inconclusive", "why": f"budget {budget_x:.0f}x small's, under the issue's {FLOOR_X}x"}
    disagree = lambda key, sign: counts(mix.get(key), -sign)  # noqa: E731 (the mix's val set says the opposite)
    if counts(sf, +1) and not disagree("spider - spider_fixed_1loop", +1):
        return {
            "outcome": "change",
            "why": f"the 1B choices trail fixed segments and one loop by {sf['diff']:+.4f} ({sf['se_total']:.4f})",
            "action": "1B configs: fixed segments with mean chunks and one loop; a follow-up separates the two",
        }
    if sd["diff"] <= -TARGET and counts(sd, -1) and not counts(sf, +1):
        return {
            "outcome": "keep",
            "why": f"Spider with the 1B choices leads dense by {-sd['diff']:.4f} ({sd['se_total']:.4f}) on held-out text",
        }
    if counts(sd, +1) and counts(fd, +1):
        return {
            "outcome": "keep, dense leads",
            "why": f"dense leads both Spiders (by {sd['diff']:.4f} and {fd['diff']:.4f}); no config change, the "
            "finding is recorded",
        }
    return {"outcome": "keep (no difference counts)", "why": "no pooled difference passes the margin and 2 s.e."}


# ---- the report


def fmt(v, spec: str = ".4f") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(report: dict) -> str:
    m = report.get("machine", {})
    lines = [
        f"# Third scale and 1B harness ({m.get('date', '')}, commit {m.get('commit', '')})",
        "",
        f"Machine: {m.get('cuda') or 'CPU'}, Python {m.get('python')}, torch {m.get('torch')}, "
        f"torchao {'yes' if m.get('torchao') else 'no'}; flavor {report['args']['flavor']}, seq "
        f"{report['args']['seq']} x batch {report['args']['batch']}, seeds {report['args']['seeds']}"
        + (" (dry run)" if report["args"]["dry_run"] else ""),
        "",
    ]
    b = report.get("budget", {})
    lines += [f"Budget: {fmt(b.get('flops'), '.3e')} training FLOPs per run ({fmt(b.get('x_small'), '.0f')}x small's "]
    lines[-1] += f"4e13; limited by {b.get('limited_by', '–')})" + (
        f" — under the issue's {FLOOR_X}x floor" if b.get("x_small", 0) < FLOOR_X else ""
    )
    lines += ["", "| run | probe FLOP/s | start-up s | steps | train FLOPs | wall s | loss | bytes/seg | status |"]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    probe_rows, train_rows = report.get("probe", {}), report.get("train", {})
    for name in report["runs"]:
        p, t = probe_rows.get(name, {}), train_rows.get(name, {})
        status = "ok" if t.get("export") else (t.get("log") or p.get("failed") or "not run")
        lines.append(
            f"| {name} | {fmt(p.get('flops_per_s'), '.3e')} | {fmt(p.get('startup_s'), '.0f')} | {t.get('steps', '–')} "
            f"| {fmt(t.get('train_flops'), '.3e')} | {fmt(t.get('wall_s'), '.0f')} | {fmt(t.get('loss'), '.3f')} "
            f"| {fmt(t.get('bytes_per_segment'), '.2f')} | {str(status)[:160]} |"
        )
    for val_name in ("train_val", "held_out_val"):
        e = report.get("eval", {}).get(val_name)
        if not e:
            lines += ["", f"{val_name}: not read"]
            continue
        lines += ["", f"**{val_name}** ({e['windows']} windows of {report['args']['seq']} bytes): bpb"]
        lines += ["", "| run | bpb |", "|---|---|"] + [f"| {k} | {v:.4f} |" for k, v in e["bpb"].items()]
        lines += ["", "| pair (a - b) | pooled diff | paired s.e. | seeds' half-spread | total s.e. | per seed |"]
        lines += ["|---|---|---|---|---|---|"]
        for key, pr in e["pairs"].items():
            seeds = ", ".join(f"s{k}: {v['diff']:+.4f} ({v['se']:.4f})" for k, v in pr["per_seed"].items())
            lines.append(
                f"| {key} | {pr['diff']:+.4f} | {pr['se']:.4f} | {fmt(pr['seed_half_spread'])} | {pr['se_total']:.4f} "
                f"| {seeds} |"
            )
    for note in report.get("eval", {}).get("not_read", []):
        lines.append(f"- not read: {note}")
    v = report.get("verdict", {})
    lines += ["", f"**Decision rule** (lab/log/2026-12-01-third-scale-decision-rule.md): {v.get('outcome')} — "]
    lines[-1] += v.get("why", "") + (f"; {v['action']}" if "action" in v else "")
    h = report.get("harness", {})
    lines += ["", "**1B harness** " + (f"(`{h['command']}`)" if "command" in h else "")]
    if "rows" in h:
        lines += [
            "",
            "| row | bytes/s | TFLOP/s | MFU | compile s | peak GiB | skipped |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in h["rows"].items():
            lines.append(
                f"| {name} | {fmt(r.get('bytes_per_s'), ',.0f')} | {fmt(r.get('tflops'), '.1f')} | {fmt(r.get('mfu'), '.3f')} "
                f"| {fmt(r.get('compile_s'), '.1f')} | {fmt(r.get('peak_memory_gib'), '.1f')} | {r.get('skipped') or ''} |"
            )
    else:
        lines.append(f"- {h.get('skipped') or h.get('log') or 'no rows'}")
    lines += ["", "Parts (s): " + ", ".join(f"{k} {v:.0f}" for k, v in report.get("part_s", {}).items())]
    return "\n".join(lines) + "\n"


def write_report(args, report: dict) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report["verdict"] = verdict(report)
    (out / "third_scale.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "third_scale.md").write_text(markdown(report))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for log in sorted(Path(args.work).rglob("*.log")):
            data = log.read_bytes()[-20000:]
            info = tarfile.TarInfo(str(log.relative_to(args.work)))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (out / "logs.tar.gz").write_bytes(buf.getvalue())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "outputs/third_scale"), help="the table, JSON, logs")
    p.add_argument("--work", default=None, help="run folders and shards (default: /tmp/third_scale)")
    p.add_argument("--corpus", default="outputs/device_corpus", help="train.jsonl.xz and held_out.jsonl.xz")
    p.add_argument("--dry_run", action="store_true", help="tiny shapes on a CPU: the debug flavor, seconds per part")
    p.add_argument("--flavor", default=None, help="model flavor of every run (medium; dry run: debug)")
    p.add_argument("--seeds", type=int, default=2, help="seeds per variant (2)")
    p.add_argument("--seq", type=int, default=None, help="bytes per row (1024; dry run 64)")
    p.add_argument("--batch", type=int, default=None, help="rows per step (32; dry run 2)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of every run (1e-3)")
    p.add_argument("--warmup_steps", type=int, default=None, help="lr warm-up steps (30; dry run 2)")
    p.add_argument("--target_x", type=float, default=None, help="budget at most this many times small's 4e13 (250)")
    p.add_argument("--graph", type=lambda s: s.lower() == "true", default=True, help="Spider: one CUDA graph (true)")
    p.add_argument("--probe_steps", type=int, default=None, help="steps of the probe (16; dry run 4)")
    p.add_argument("--val_fraction", type=float, default=0.01, help="val share of the training mix (0.01)")
    p.add_argument("--held_out_val_fraction", type=float, default=0.25, help="val share of the held-out (0.25)")
    p.add_argument("--eval_windows", type=int, default=None, help="most windows per val set (1024; dry run 128)")
    p.add_argument("--eval_batch", type=int, default=128, help="windows per eval batch (128)")
    p.add_argument("--threads", type=int, default=2, help="OMP threads per training process (2)")
    p.add_argument("--harness_rows", default=HARNESS_ROWS, help=f"the harness's rows ({HARNESS_ROWS})")
    p.add_argument("--harness_args", default=None, help="more harness flags (GPU: '--budget_s 45 --fp8_budget_s 140')")
    p.add_argument("--harness_threads", type=int, default=8, help="OMP threads of the harness (8)")
    p.add_argument("--total_s", type=float, default=470, help="the whole call (470)")
    for part, default in (("setup", 20), ("data", 35), ("probe", 100), ("train", 150), ("eval", 50)):
        p.add_argument(f"--{part}_s", type=float, default=default, help=f"the {part} part's budget ({default})")
    p.add_argument("--harness_s", type=float, default=200, help="the harness's budget, at most what is left (200)")
    p.add_argument("--export_s", type=float, default=10, help="seconds a run's export takes, in the budget (10)")
    p.add_argument("--report_s", type=float, default=5, help="seconds kept for the report (5)")
    args = p.parse_args(argv)
    # the dry run's budget: ~15 steps of the debug flavor at 2 x 64 bytes (1.5e-4 x small's 4e13)
    tiny = {
        "flavor": "debug",
        "seq": 64,
        "batch": 2,
        "warmup_steps": 2,
        "probe_steps": 4,
        "target_x": 1.5e-4,
        "eval_windows": 128,
    }
    full = {
        "flavor": "medium",
        "seq": 1024,
        "batch": 32,
        "warmup_steps": 30,
        "probe_steps": 16,
        "target_x": 250,
        "eval_windows": 1024,
    }
    for key, value in (tiny if args.dry_run else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.harness_args is None:
        args.harness_args = (
            "--reduced --compile false --batch 1 --seq 64 --warmup 1 --steps 1"
            if args.dry_run
            else "--budget_s 45 --fp8_budget_s 140"
        )
    args.work = args.work or "/tmp/third_scale"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    corpus = Path(args.corpus)
    missing = [n for n in ("train.jsonl.xz", "held_out.jsonl.xz") if not (corpus / n).is_file()]
    if missing:
        print(
            f"third_scale: {corpus} lacks {missing}; build it with python -m lab.corpus.device_corpus --out {corpus}",
            file=sys.stderr,
        )
        return 2
    clock = Clock(args.total_s)
    shutil.rmtree(args.work, ignore_errors=True)
    Path(args.work).mkdir(parents=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report: dict = {"args": vars(args).copy(), "runs": list(run_names(args)), "part_s": {}}

    def timed(part: str, fn, *a):
        t0 = time.time()
        try:
            return fn(*a)
        finally:
            report["part_s"][part] = time.time() - t0
            write_report(args, report)  # what finished survives a later crash or the caller's timeout

    timed("setup", setup, args, report)
    import torch

    args.cuda = torch.cuda.is_available() and not args.dry_run
    report["args"]["cuda"] = args.cuda
    if timed("data", prepare, args, clock, report):
        rates = timed("probe", probe, args, clock, report)
        budget, why = choose_budget(args, rates)
        report["budget"] = {"flops": budget, "x_small": budget / SMALL_BUDGET, "limited_by": why}
        if budget > 0:
            runs = timed("train", train, args, clock, budget, rates, report)
            timed("eval", evaluate, args, clock, runs, report)
    timed("harness", harness, args, clock, report)
    write_report(args, report)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
