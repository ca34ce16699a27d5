"""Learning-rate schedules: linear warmup, then a decay chosen by ``lr_scheduler.decay_type``.

Each decay is a function ``(progress in [0, 1], cfg) -> multiplier``, registered by name in
``components/registry.py``; the builder looks the chosen one up once and hands it to
:func:`build_lr_scheduler`, which wraps warmup + decay in a ``LambdaLR`` (a Stateful, so it
checkpoints with the run).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from spider_titan.config.job_config import LRScheduler

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


def lr_multiplier(step: int, cfg: LRScheduler, total_steps: int, decay: Decay) -> float:
    """LR multiplier for optimizer step ``step`` (0-based)."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    if step < warmup:
        return cfg.warmup_start_factor + (1.0 - cfg.warmup_start_factor) * (step + 1) / warmup
    decay_steps = max(total_steps - warmup, 1)
    progress = min(max((step - warmup) / decay_steps, 0.0), 1.0)
    return decay(progress, cfg)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int, decay: Decay
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps, decay))
