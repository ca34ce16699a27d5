"""Learning-rate schedules: linear warmup, then a decay chosen by ``lr_scheduler.decay_type``.

Each decay is a function ``(progress in [0, 1], cfg) -> multiplier``, registered by name in
``registry.py``; the builder looks the chosen one up once and hands it to
:func:`build_lr_scheduler`, which wraps warmup + decay in a ``LambdaLR`` (a Stateful, so it
checkpoints with the run).

A run with a FLOPs budget (``training.flops_budget``, :class:`FlopsBudget`) decays over the steps the
budget affords at the FLOPs per step spent so far, instead of over a step count fixed in advance:
the same schedule when every step costs the same, and one that ends with the budget when the cost
per step drifts (Spider's learned segmentation).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from spider_titan.job_config import LRScheduler

Decay = Callable[[float, LRScheduler], float]


def linear_decay(progress: float, cfg: LRScheduler) -> float:
    return 1.0 - (1.0 - cfg.min_lr_factor) * progress


def cosine_decay(progress: float, cfg: LRScheduler) -> float:
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def wsd_decay(progress: float, cfg: LRScheduler) -> float:
    """Warmup-stable-decay: flat at the peak, then linear to the floor over the last decay_ratio."""
    start = 1.0 - cfg.decay_ratio
    if progress <= start or cfg.decay_ratio == 0:
        return 1.0
    return 1.0 - (1.0 - cfg.min_lr_factor) * (progress - start) / cfg.decay_ratio


class FlopsBudget:
    """A run that ends when its training FLOPs reach ``budget``. The train loop sets ``spent`` (every
    rank's FLOPs so far) after each step, before the scheduler steps; the schedule then decays over
    :meth:`projected_steps`, the steps the budget affords at the average cost per step so far."""

    def __init__(self, budget: float):
        self.budget = budget
        self.spent = 0.0

    def reached(self) -> bool:
        return self.spent >= self.budget

    def projected_steps(self, step: int) -> float:
        """Steps the whole budget buys at the FLOPs per step of the first ``step`` steps (inf before any)."""
        return step * self.budget / self.spent if self.spent > 0 else math.inf


def lr_multiplier(
    step: int, cfg: LRScheduler, total_steps: int, decay: Decay, budget: FlopsBudget | None = None
) -> float:
    """LR multiplier for optimizer step ``step`` (0-based). ``total_steps`` is the run's length, or with
    ``budget`` the most steps it may take (warmup is in steps either way)."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    if step < warmup:
        return cfg.warmup_start_factor + (1.0 - cfg.warmup_start_factor) * (step + 1) / warmup
    total = total_steps if budget is None else budget.projected_steps(step)
    decay_steps = max(total - warmup, 1)
    progress = min(max((step - warmup) / decay_steps, 0.0), 1.0)
    return decay(progress, cfg)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: LRScheduler,
    total_steps: int,
    decay: Decay,
    budget: FlopsBudget | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg, total_steps, decay, budget)
    )
