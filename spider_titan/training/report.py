"""What a run tells its user beside the step lines: where it writes what and the shape of the job
(:func:`log_start_block`, once at start), what it produced and the commands that use it
(:func:`log_end_block`, once at the end), and the command that runs it again (:func:`launch_command`,
quoted in the messages that say how to resume)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from spider_titan.components.builder import Run
from spider_titan.job_config import JobConfig
from spider_titan.metrics.logger import format_duration, shell_command
from spider_titan.training.progress import TrainState

logger = logging.getLogger("spider_titan")

# This checkout's scripts/ (plot.py, generate.py): the end block names them as a shell finds them.
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def launch_command(argv: list[str]) -> str:
    """The command that runs this program again with ``argv``, with this interpreter (the venv's):
    the torchrun launch on more than one rank (on one node; on several, with their rendezvous flags)."""
    python = Path(sys.executable)
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world <= 1:
        return shell_command(python, "-m", "spider_titan.train", *argv)
    launch = ["-m", "torch.distributed.run", f"--nproc_per_node={local}"]
    launch += ["--standalone"] if world == local else [f"--nnodes={world // max(local, 1)}"]
    command = shell_command(python, *launch, "-m", "spider_titan.train", *argv)
    return command if world == local else command + " (on every node, with its rendezvous flags)"


def log_start_block(cfg: JobConfig, run: Run, dump_folder: Path) -> None:
    """Where this run writes what, and the shape of the job, once at start."""
    t, ck, d = cfg.training, cfg.checkpoint, dump_folder
    files = [("config.toml", f"the resolved config (rerun: --job.config_file {d / 'config.toml'})")]
    if cfg.metrics.enable_jsonl:
        files.append(("metrics.jsonl", "one JSON line per logged step and validation (scripts/plot.py draws it)"))
    if cfg.metrics.enable_tensorboard:
        tb = cfg.metrics.save_tb_folder
        files.append((f"{tb}/", f"TensorBoard (tensorboard --logdir {d / tb})"))
    if ck.enable:
        files.append(
            (
                f"{ck.folder}/",
                f"DCP checkpoints every {ck.interval} steps and at the end; rerunning the same command resumes",
            )
        )
    if ck.export_at_end:
        files.append(("export/", "safetensors export at the end (scripts/generate.py --model ...)"))
    width = max(len(name) for name, _ in files) + 2
    lines = [f"run folder {d}/"] + [f"  {name:<{width}}{what}" for name, what in files]
    length = (
        f"{run.total_steps} steps"
        if run.flops_budget is None
        else f"to {run.flops_budget.budget:.4g} FLOPs (at most {run.total_steps} steps)"
    )
    dp = run.parallel_dims.dp_degree
    lines.append(
        f"training {length}: global batch {t.local_batch_size * t.gradient_accumulation_steps * dp}"
        f" x {t.seq_len} bytes ({t.local_batch_size} per rank x {t.gradient_accumulation_steps} accumulation x "
        f"{dp} ranks) on {run.device}"
    )
    for line in lines:
        logger.info(line)


def log_end_block(
    cfg: JobConfig,
    state: TrainState,
    dump_folder: Path,
    *,
    elapsed: float,
    best_val: tuple[float, int] | None,
    final_save: Path | None,
    resume_point: Path | None,
) -> None:
    """What the run produced and how to use it, once at the end: ``elapsed`` seconds of training,
    the best validation ``(bpb, step)``, the checkpoint that holds the final weights (``final_save``:
    the last step's save, model only by default) and the newest full checkpoint a run can resume from,
    when there are any."""
    logger.info(
        "done: %d steps, %d bytes, %.3g training FLOPs in %s",
        state.step,
        state.tokens_seen,
        state.flops,
        format_duration(elapsed),
    )
    if best_val is not None:
        logger.info("best val bpb %.4f at step %d", *best_val)
    # Commands that work as printed: this interpreter (the venv's) and this checkout's scripts.
    python = Path(sys.executable)
    if cfg.metrics.enable_jsonl:
        logger.info(
            "metrics: %s (plot: %s)",
            dump_folder / "metrics.jsonl",
            shell_command(python, SCRIPTS / "plot.py", dump_folder),
        )
    ck = cfg.checkpoint
    if final_save is not None:
        kind = f"model only, {ck.export_dtype}" if ck.last_save_model_only else "full: also the resume point"
        logger.info("final weights: %s (%s)", final_save, kind)
    if resume_point is not None and resume_point != final_save:
        logger.info("last full checkpoint (the resume point): %s", resume_point)
    if final_save is None and not ck.export_at_end:
        logger.info("final weights: not saved (checkpoint.enable = false and checkpoint.export_at_end = false)")
    if cfg.checkpoint.export_at_end:
        export = dump_folder / "export"
        logger.info("export: %s", export)
        logger.info(
            "sample from it: %s",
            shell_command(
                python, SCRIPTS / "generate.py", "--model", export, "--prompt", "def ", "--max_new_bytes", "200"
            ),
        )
