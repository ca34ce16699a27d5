"""The search over a step's shape: the largest micro-batch that fits, whether it needs activation
checkpointing, and the largest compiled memory budget that fits when it does."""

from __future__ import annotations

from spider_titan.job_config import JobConfig
from spider_titan.plan.estimate import GIB, PER_ROW, Plan

# What a micro-batch must leave free beside the plan: the caching allocator's fragmentation, a share
# of the planned bytes, and the CUDA context and NCCL buffers (the upper end of "~1-3 GiB").
ALLOCATOR_MARGIN = 0.15
CONTEXT_GIB = 3.0


def micro_batch_choices(plan: Plan, cfg: JobConfig) -> list[tuple[int, int, int]]:
    """(local_batch_size, gradient_accumulation_steps, planned bytes per rank) of every split of this
    rank's rows per step into micro-batches of equal rows (the same bytes per step). The activations
    scale with a micro-batch's rows; FSDP keeps the accumulated gradient only with more than one."""
    t = cfg.training
    rows = t.local_batch_size * t.gradient_accumulation_steps
    per_row = sum(plan.memory[k] for k in PER_ROW) / t.local_batch_size
    return [(n, rows // n, split_bytes(plan, n, rows // n, per_row)) for n in range(1, rows + 1) if rows % n == 0]


def split_bytes(plan: Plan, local: int, accum: int, per_row: float) -> int:
    """Bytes per rank planned for micro-batches of ``local`` rows, ``accum`` per step, holding ``per_row``
    bytes per row (activations and backward transients); the rest of the plan as it is."""
    fixed = plan.total_bytes - sum(plan.memory[k] for k in PER_ROW) - plan.memory.get("accumulated gradients", 0)
    return round(fixed + local * per_row + (plan.accumulated_grad_bytes if accum > 1 else 0))


def fits_with_room(plan: Plan, nbytes: float) -> bool:
    """``nbytes`` planned per rank fit with ``ALLOCATOR_MARGIN`` and ``CONTEXT_GIB`` to spare."""
    return nbytes * (1 + ALLOCATOR_MARGIN) <= plan.gpu_memory_bytes - CONTEXT_GIB * GIB


def largest_micro_batch(plan: Plan, cfg: JobConfig) -> tuple[int, int, int] | None:
    """The split of :func:`micro_batch_choices` with the most rows per micro-batch that fits with
    ``ALLOCATOR_MARGIN`` and ``CONTEXT_GIB`` to spare, or None. A step that is not one CUDA graph waits
    on its host, whose launches per micro-batch do not grow with its rows
    (tests/integration/test_launches_per_batch.py), and the grouped expert GEMMs get more rows."""
    fits = [c for c in micro_batch_choices(plan, cfg) if fits_with_room(plan, c[2])]
    return max(fits) if fits else None


def without_checkpointing(plan: Plan, cfg: JobConfig) -> tuple[int, float] | None:
    """(bytes planned per rank, share of the step's matmul and attention FLOPs saved) for the micro-batch
    :func:`largest_micro_batch` picks, with activation checkpointing off; None when it is off already
    or nothing fits. Checkpointing recomputes what it dropped, so it pays only where memory needs it."""
    pick = largest_micro_batch(plan, cfg)
    if plan.without_ac is None or pick is None:
        return None
    local, accum, _ = pick
    nbytes = split_bytes(plan, local, accum, plan.without_ac.peak / cfg.training.local_batch_size)
    return nbytes, 1 - plan.without_ac.flops / plan.activation.flops


# the compiled memory budgets the plan tries, largest first (:func:`budget_that_fits`)
BUDGETS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)


def budget_that_fits(plan: Plan, cfg: JobConfig) -> tuple[float, int, float] | None:
    """(budget, bytes planned per rank, its recompute as a share of the unchecked step's matmul and
    attention FLOPs) of the largest of ``BUDGETS`` under which the micro-batch :func:`largest_micro_batch`
    picks fits with room, found by bisection (the saved bytes grow with the budget); None when the plan
    was not asked to search, checkpointing is not needed, or no budget fits."""
    off = without_checkpointing(plan, cfg)
    if plan.measure_at_budget is None or off is None or fits_with_room(plan, off[0]):
        return None
    local, accum, _ = largest_micro_batch(plan, cfg)

    def planned(budget: float) -> tuple[int, int]:
        measured = plan.measure_at_budget(budget)
        return split_bytes(plan, local, accum, measured.peak / cfg.training.local_batch_size), measured.flops

    best = None
    low, high = 0, len(BUDGETS) - 1  # BUDGETS[high] is the smallest budget
    while low <= high:
        mid = (low + high) // 2
        nbytes, flops = planned(BUDGETS[mid])
        if fits_with_room(plan, nbytes):
            best, high = (BUDGETS[mid], nbytes, flops / plan.without_ac.flops - 1), mid - 1
        else:
            low = mid + 1
    return best
