"""``training.flops_budget``: a run that ends when its training FLOPs reach the budget, its learning
rate decaying over the steps the budget affords at the FLOPs per step spent so far.

The schedule is checked against the step schedule it must equal when every step costs the same, and
on a drifting cost against the property that makes it a budget (progress reaches 1 exactly at the
step that spends it). The trainer is checked on Spider, whose FLOPs per step move with its learned
segmentation: the run stops at the first step past the budget, every logged learning rate is the
schedule's at that step's logged FLOPs, and a run cut by a checkpoint resumes to the same losses and
the same last step as one that was not.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from spider_titan.job_config import LRScheduler
from spider_titan.optim.lr_schedulers import FlopsBudget, cosine_decay, lr_multiplier
from tests.utils import check_ok, read_metrics, run_train, tiny_run, train_losses

CFG = LRScheduler(warmup_steps=5, min_lr_factor=0.1)


def test_constant_cost_gives_the_step_schedule():
    """Every step costs 3 FLOPs and the budget buys 40 steps: the same multiplier as a 40-step run."""
    budget = FlopsBudget(120.0)
    for step in range(1, 41):
        budget.spent = 3.0 * step
        want = lr_multiplier(step, CFG, 40, cosine_decay)
        assert lr_multiplier(step, CFG, 1000, cosine_decay, budget) == pytest.approx(want, abs=1e-12), step


def test_drifting_cost_ends_the_decay_with_the_budget():
    """Steps get dearer as the run goes (a segmentation that shortens): the decay is unfinished at
    every step before the budget is spent and finished at the step that spends it, unlike the step
    schedule planned from the first steps' cost, which would end 25 % early."""
    budget, cap = FlopsBudget(1000.0), 500
    spent, step, progress = 0.0, 0, []
    while not budget.reached():
        step += 1
        spent += 10.0 + 0.2 * step  # 10.2, 10.4, ...
        budget.spent = spent
        progress.append(lr_multiplier(step, CFG, cap, cosine_decay, budget))
    assert progress[-1] == pytest.approx(CFG.min_lr_factor)
    assert all(m > CFG.min_lr_factor + 1e-6 for m in progress[CFG.warmup_steps : -1])
    assert progress[CFG.warmup_steps :] == sorted(progress[CFG.warmup_steps :], reverse=True)
    planned = math.ceil(budget.budget / 10.2)  # what a probe of the first step would have planned
    assert step < planned  # the step plan would have overspent: 76 dearer steps vs 98 planned ones


SPIDER = tiny_run(
    training__deterministic=True,
    lr_scheduler__warmup_steps=2,
    training__steps=40,  # the cap: far above what the budget buys
)
BUDGET = 6e9
SPIDER_LR = LRScheduler(warmup_steps=2, min_lr_factor=0.1)  # the debug config's schedule with the warmup above
CKPT = ["--checkpoint.enable", "true", "--checkpoint.last_save_model_only", "false"]


def train_rows(dump: Path) -> list[dict]:
    return [r for r in read_metrics(dump) if "loss" in r]


@pytest.mark.slow
def test_spider_trains_to_its_budget_and_resumes_exactly(tmp_path):
    budget = ["--training.flops_budget", str(BUDGET)]
    check_ok(run_train([*SPIDER, *budget, "--job.dump_folder", str(tmp_path / "straight")]))
    rows = train_rows(tmp_path / "straight")
    flops = [r["train_flops"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert 6 <= len(rows) < 40, len(rows)  # stopped by the budget, not by the cap
    assert flops[-1] >= BUDGET > flops[-2]  # the first step that reaches the budget is the last
    assert len({round(b - a) for a, b in zip([0.0] + flops, flops)}) > 1  # the cost per step did drift

    # Each logged rate is the one the next step uses: the schedule at this step's FLOPs.
    base = rows[0]["lr"] / lr_multiplier(1, SPIDER_LR, 40, cosine_decay)
    for r in rows:
        b = FlopsBudget(BUDGET)
        b.spent = r["train_flops"]
        want = base * lr_multiplier(r["step"], SPIDER_LR, 40, cosine_decay, b)
        assert r["lr"] == pytest.approx(want, rel=1e-9), r["step"]
    assert rows[-1]["lr"] == pytest.approx(0.1 * base, rel=1e-9)  # decayed to the floor with the budget

    # Cut at step 3 with a checkpoint, resumed: the same losses and the same last step.
    resumed = tmp_path / "resumed"
    check_ok(run_train([*SPIDER, *budget, *CKPT, "--training.steps", "3", "--job.dump_folder", str(resumed)]))
    check_ok(run_train([*SPIDER, *budget, *CKPT, "--job.dump_folder", str(resumed)]))
    ref, got = train_losses(tmp_path / "straight"), train_losses(resumed)
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-6), step
