"""The plan as text: the table, the micro-batch and checkpointing lines, the verdict."""

from __future__ import annotations

from spider_titan.job_config import JobConfig
from spider_titan.plan.estimate import GIB, PER_ROW, Plan
from spider_titan.plan.search import (
    ALLOCATOR_MARGIN,
    CONTEXT_GIB,
    budget_that_fits,
    fits_with_room,
    largest_micro_batch,
    without_checkpointing,
)

# what helps when a component does not fit
KNOBS = {
    "parameters": "more ranks (data_parallel_shard_degree) or fewer HSDP replicas (data_parallel_replicate_degree)",
    "gradients": "more ranks (data_parallel_shard_degree)",
    "optimizer state": 'more ranks (data_parallel_shard_degree), or optimizer.name = "Muon" (one state per matrix)',
    "accumulated gradients": "gradient_accumulation_steps = 1 with a larger local_batch_size, "
    'or training.mixed_precision_reduce = "bfloat16"',
    "gathered units": "parallelism.fsdp_keep_core_gathered_fraction = 0 (reshard the core after forward)",
    "reduce-scatter staging": 'training.mixed_precision_reduce = "bfloat16"',
    "compute weights": 'training.mixed_precision_mode = "autocast" with cast_weights_once = false '
    "(each use casts its weight again), or FSDP",
    "activations": "a smaller training.local_batch_size (more gradient_accumulation_steps)",
    "backward transients": "a smaller training.local_batch_size (more gradient_accumulation_steps)",
}

# stronger activation checkpointing, after each mode
STRONGER_AC = {"none": "recurrent", "selective": "recurrent", "recurrent": "full"}


def format_plan(plan: Plan, cfg: JobConfig) -> str:
    t = cfg.training

    def gib(nbytes: float) -> str:
        return f"{nbytes / GIB:8.2f} GiB"

    lines = [
        f"plan: {cfg.model.name}/{cfg.model.flavor} on {plan.ngpu} GPUs ({plan.describe})",
        (
            f"  micro-batch {t.local_batch_size} x {t.seq_len}, accumulation {t.gradient_accumulation_steps}, "
            f"AC {cfg.activation_checkpoint.mode}, params {t.mixed_precision_param}, reduce {t.mixed_precision_reduce}"
        ),
        "",
        "memory per rank",
    ]
    for name, nbytes in plan.memory.items():
        detail = ""
        if name == "parameters":
            detail = "  (" + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in plan.param_bytes_by_dtype.items()) + ")"
        if name == "activations":
            detail = f"  ({nbytes / (t.local_batch_size * t.seq_len) / 1024:.0f} KiB per input byte)"
        lines.append(f"  {name:<24}{gib(nbytes)}{detail}")
    lines.append(f"  {'total':<24}{gib(plan.total_bytes)}  (before CUDA context / NCCL buffers, ~1-3 GiB)")
    lines.append("")
    lines.append("communication per step (this rank)")
    if not plan.comm:
        lines.append("  none")
    for kind, tags in plan.comm.items():
        top = sorted(tags.items(), key=lambda kv: -kv[1])[:3]
        lines.append(
            f"  {kind:<24}{gib(sum(tags.values()))}  (largest: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in top) + ")"
        )
    lines.append("")
    lines.append(
        f"compute  {plan.flops_per_step_per_rank / 1e12:.1f} TFLOP per rank per step; at MFU "
        f"{plan.mfu:.0%} of {plan.peak_flops / 1e12:.0f} TFLOP/s: {plan.step_time_s:.2f} s/step, "
        f"{plan.tokens_per_s:,.0f} tokens/s ({plan.tokens_per_s / plan.ngpu:,.0f} per GPU)"
    )
    lines.append("")
    lines.append(micro_batch_line(plan, cfg))
    checkpointing = checkpointing_line(plan, cfg)
    if checkpointing:
        lines.append(checkpointing)
    for note in plan.notes:
        lines.append(f"note: {note}")
    lines.append(verdict(plan))
    return "\n".join(lines)


def micro_batch_line(plan: Plan, cfg: JobConfig) -> str:
    """What :func:`largest_micro_batch` picks, as the flags that ask for it."""
    t = cfg.training
    spare = f"with {ALLOCATOR_MARGIN:.0%} and {CONTEXT_GIB:.0f} GiB to spare"
    pick = largest_micro_batch(plan, cfg)
    if pick is None:
        return f"micro-batch  none of {t.local_batch_size * t.gradient_accumulation_steps} rows per step fits {spare}"
    local, accum, nbytes = pick
    size = f"{local} x {t.seq_len}, accumulation {accum} ({nbytes / GIB:.1f} GiB planned)"
    if (local, accum) == (t.local_batch_size, t.gradient_accumulation_steps):
        return f"micro-batch  the config's, {size}, is the largest that fits {spare}"
    return (
        f"micro-batch  the largest that fits {spare}: {size}; the same bytes per step, fewer launches per step: "
        f"--training.local_batch_size {local} --training.gradient_accumulation_steps {accum}"
    )


CHECKPOINTING_NOT_NEEDED = "checkpointing  not needed at that micro-batch"  # lab/bench/gpu.py reads it


MEMORY_BUDGET_FITS = "memory budget  fits at that micro-batch"  # lab/bench/gpu.py reads it


def checkpointing_line(plan: Plan, cfg: JobConfig) -> str | None:
    """What :func:`without_checkpointing` finds, as one line (None when checkpointing is off), and
    when it is needed, the line of :func:`budget_that_fits` after it."""
    off = without_checkpointing(plan, cfg)
    if off is None:
        return None
    nbytes, saved = off
    if not fits_with_room(plan, nbytes):
        line = f"checkpointing  needed at that micro-batch: without it {nbytes / GIB:.1f} GiB planned"
        fit = budget_that_fits(plan, cfg)
        if fit is not None:
            budget, nbytes, extra = fit
            ours = plan.activation.flops / plan.without_ac.flops - 1
            line += (
                f"\n{MEMORY_BUDGET_FITS}: compiled blocks saving {budget:g} of their activations, "
                f"{nbytes / GIB:.1f} GiB planned; its recompute adds {extra:.0%} to the matmul and attention FLOPs "
                f"of the unchecked step, the config's checkpointing {ours:.0%}: "
                f"--activation_checkpoint.mode memory_budget --activation_checkpoint.memory_budget {budget:g}"
            )
        return line
    return (
        f"{CHECKPOINTING_NOT_NEEDED}: without it {nbytes / GIB:.1f} GiB planned, which fits; the step skips "
        f"the recompute, {saved:.0%} of its matmul and attention FLOPs: --activation_checkpoint.mode none"
    )


def verdict(plan: Plan) -> str:
    """ "fits in X GiB of Y", or the first component with which the running total passes the
    budget and the knob that helps most there."""
    budget = plan.gpu_memory_bytes
    running = 0
    for name, nbytes in plan.memory.items():
        running += nbytes
        if running > budget:
            knob = KNOBS[name]
            if name in PER_ROW and plan.ac_mode == "memory_budget":
                knob += ", or a lower activation_checkpoint.memory_budget"
            elif name in PER_ROW and plan.ac_mode in STRONGER_AC:
                knob += f', or activation_checkpoint.mode = "{STRONGER_AC[plan.ac_mode]}"'
            return (
                f"DOES NOT FIT: {running / GIB:.1f} GiB of {budget / GIB:.0f} GiB reached at {name} "
                f"({nbytes / GIB:.2f} GiB); try {knob}"
            )
    return f"fits in {running / GIB:.1f} GiB of {budget / GIB:.0f} GiB (before CUDA / NCCL overhead)"
