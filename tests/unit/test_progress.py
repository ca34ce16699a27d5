"""The ETA of training/progress.py: the validations still to come, the one of the logged step included,
at the last one's duration, or before the first at an estimate from the step time."""

from __future__ import annotations

import pytest
import torch

from spider_titan.job_config import Training
from spider_titan.optim.lr_schedulers import FlopsBudget
from spider_titan.training.progress import Progress, TrainState


def progress(total_steps: int, val_freq: int | None, *, val_tokens: int = 0, budget=None) -> Progress:
    return Progress(
        TrainState(),
        Training(seq_len=64, local_batch_size=4, gradient_accumulation_steps=2),
        device=torch.device("cpu"),
        dp_degree=1,
        world_size=1,
        total_steps=total_steps,
        flops_per_byte=1.0,
        val_freq=val_freq,
        budget=budget,
        val_tokens=val_tokens,
    )


@pytest.mark.parametrize("total", [1, 7, 20, 21])
@pytest.mark.parametrize("freq", [1, 3, 5, 20, 50])
def test_validations_left_counts_the_steps_that_validate(total, freq):
    """Against the train loop's rule, step by step: a step validates when it is a multiple of
    ``val_freq`` or the last; its own validation (steps 1 on: a logged step) counts only while still to come."""
    p = progress(total, freq)
    for step in range(0, total + 1):
        later = sum(1 for s in range(step + 1, total + 1) if s % freq == 0 or s == total)
        assert p.validations_left(step, own=False) == later
        if step > 0:
            assert p.validations_left(step, own=True) == later + (step % freq == 0 or step == total)
    assert progress(total, None).validations_left(0, own=True) == 0


def test_the_last_steps_line_counts_its_validation_estimated_before_the_first():
    """A run whose only validation is at its last step: the step line before it said ``eta 0s``
    and a 32 s whole-split pass followed (issue 36). Now the line counts that validation: before it
    has run, its positions at a third of a training step's time per position; after it, its
    measured duration; the validation's own line (after it) has nothing left."""
    p = progress(20, 20, val_tokens=12 * 4 * 64)  # 12 batches: the positions of 6 steps (4 x 64 x 2 each)
    p.step_time = 0.5
    assert p.val_seconds() == pytest.approx(0.5 * 6 / 3)
    assert p.eta(20, val_pending=True) == pytest.approx(1.0)
    assert p.eta(20) == 0.0
    assert p.eta(10, val_pending=True) == pytest.approx(10 * 0.5 + 1.0)  # step 10 does not validate
    p.timed_validation(lambda: None)
    assert p.val_time is not None and p.val_seconds() == p.val_time
    unknown = progress(20, 20)  # no estimate given (val_tokens 0), no step time yet: 0, as before
    assert unknown.eta(20, val_pending=True) == 0.0


def test_a_reached_flops_budget_ends_the_run_at_this_step_and_its_validation():
    budget = FlopsBudget(100.0)
    p = progress(1000, 50, val_tokens=3 * 4 * 64 * 2, budget=budget)  # the positions of 3 steps
    p.step_time = 1.0
    budget.spent = 100.0
    assert p.planned_steps(7) == 7
    assert p.validations_left(7, own=True) == 1
    assert p.eta(7, val_pending=True) == pytest.approx(1.0)
