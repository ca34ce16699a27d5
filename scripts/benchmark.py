"""Run named benchmark scenarios and print JSON; with two scenarios, also their ratio.

    python scripts/benchmark.py dense_debug spider_debug --steps 20 --warmup 3
    python scripts/benchmark.py dense_debug --set training.seq_len=1024 --markdown docs/benchmarks.md

A *training* scenario is a config plus overrides, run in this process for ``--warmup`` steps
(not timed) and then ``--steps`` timed steps: tokens/s, step time median/min/max, peak memory.
Other scenarios (one MoE layer, activation memory, checkpoint I/O) are functions registered in
SCENARIOS. Scenarios given together run in this one process, one after the other, so a ratio
compares like with like on the same machine. ``--markdown FILE`` appends the command, the machine
and the results to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# name -> (config file, overrides)
TRAIN_SCENARIOS: dict[str, tuple[str, list[str]]] = {
    "dense_debug": ("train_configs/debug_dense.toml", []),
    "spider_debug": ("train_configs/debug_model.toml", []),
}

# name -> function(args) -> dict of results
SCENARIOS: dict[str, Callable[[argparse.Namespace], dict]] = {}


def scenario(name: str):
    def register(fn):
        SCENARIOS[name] = fn
        return fn

    return register


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), torch {torch.__version__}"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def run_training(config: str, overrides: list[str], args: argparse.Namespace) -> dict:
    """Build a Trainer in-process, run warm-up steps, then time ``args.steps`` train steps."""
    from spider_titan.config.manager import parse_args
    from spider_titan.metrics.logger import memory_gib
    from spider_titan.train import Trainer

    argv = ["--job.config_file", config, "--job.dump_folder", args.dump_folder, "--metrics.enable_tensorboard", "false",
            "--metrics.enable_jsonl", "false", "--validation.enable", "false", "--checkpoint.enable", "false",
            "--training.steps", str(args.warmup + args.steps)]
    argv += overrides
    for item in args.set or []:
        key, _, value = item.partition("=")
        argv += [f"--{key}", value]
    cfg = parse_args(argv)
    trainer = Trainer(cfg)
    try:
        run = trainer.run
        for _ in range(args.warmup):
            trainer.train_step(trainer.next_micro_batches())
        if run.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            batches = trainer.next_micro_batches()
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            metrics = trainer.train_step(batches)
            float(metrics["ce_sum"])  # wait for the step
            times.append(time.perf_counter() - t0)
        t = cfg.training
        tokens = t.local_batch_size * t.gradient_accumulation_steps * t.seq_len * run.parallel_dims.dp_degree
        median = statistics.median(times)
        return {
            "device": str(run.device),
            "params_m": round(sum(p.numel() for p in run.model.parameters()) / 1e6, 3),
            "tokens_per_step": tokens,
            "tokens_per_s": round(tokens / median, 1),
            "step_time_s": {"median": round(median, 4), "min": round(min(times), 4), "max": round(max(times), 4)},
            "peak_memory_gib": round(memory_gib(run.device), 3),
        }
    finally:
        trainer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+", help=f"one or two of: {sorted(TRAIN_SCENARIOS) + sorted(SCENARIOS)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (training scenarios)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--set", action="append", help="override for training scenarios, e.g. training.seq_len=1024")
    parser.add_argument("--dump_folder", default="./outputs/benchmark")
    parser.add_argument("--markdown", help="append the results to this markdown file")
    args = parser.parse_args()

    unknown = [s for s in args.scenarios if s not in TRAIN_SCENARIOS and s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {sorted(TRAIN_SCENARIOS) + sorted(SCENARIOS)}")
    results = {}
    for name in args.scenarios:
        if name in TRAIN_SCENARIOS:
            results[name] = run_training(*TRAIN_SCENARIOS[name], args)
        else:
            results[name] = SCENARIOS[name](args)
    report = {"machine": machine(), "results": results}
    if len(args.scenarios) == 2:
        a, b = (results[n] for n in args.scenarios)
        if "tokens_per_s" in a and "tokens_per_s" in b:
            report["ratio_tokens_per_s"] = {f"{args.scenarios[0]}/{args.scenarios[1]}": round(a["tokens_per_s"] / b["tokens_per_s"], 3)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(f"\n### `{' '.join(['python scripts/benchmark.py'] + sys.argv[1:])}`\n\n")
            f.write(f"Machine: {report['machine']}. Date: {time.strftime('%Y-%m-%d')}.\n\n```json\n{text}\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
