"""The train loop's accounting: what a run has done (:class:`TrainState`, checkpointed), a step's
metrics as logged numbers (:func:`reduce_metrics`), and the rates around them (:class:`Progress`:
training FLOPs, tokens/s, TFLOP/s, MFU, smoothed step time, ETA)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from spider_titan.distributed import all_reduce_sum
from spider_titan.job_config import Training
from spider_titan.metrics.logger import Throughput, memory_gib, peak_flops
from spider_titan.optim.lr_schedulers import FlopsBudget
from spider_titan.protocol import FLOPS_PER_BYTE

LN2 = math.log(2.0)

# A step's metrics hold the model's own figures (``ModelOutput.aux``) under this prefix.
AUX = "aux."

T = TypeVar("T")


class TrainState:
    """Step counter, tokens seen and training FLOPs spent: a Stateful, checkpointed with the run."""

    def __init__(self):
        self.step = 0
        self.tokens_seen = 0
        self.flops = 0.0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "flops": self.flops}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.flops = float(state.get("flops", 0.0))


def reduce_metrics(metrics: dict[str, torch.Tensor], world_size: int) -> dict[str, float]:
    """Global means of a step's metrics (``Trainer.train_step``'s, one all-reduce), as floats: loss and
    bpb per label token, the gradient norm, and each aux figure averaged over ranks."""
    keys = sorted(k for k in metrics if k.startswith(AUX))
    local = torch.stack([metrics["ce_sum"]] + [metrics[k].reshape(()) for k in keys]).double()
    total = all_reduce_sum(local).tolist()
    lm_loss = total[0] / float(metrics["label_tokens"])
    out = {"loss": lm_loss, "bpb": lm_loss / LN2, "grad_norm": float(metrics["grad_norm"])}
    out.update({k[len(AUX) :]: total[i + 1] / world_size for i, k in enumerate(keys)})
    return out


class Progress:
    """Counts the run's tokens and FLOPs into ``state`` and turns them into the rates logged at log
    steps and validations.

    FLOPs per byte are the model's own figure for the step actually run when it reports one (aux
    :data:`FLOPS_PER_BYTE`), else ``flops_per_byte`` (the spec's formula). They are summed on the device
    every step and brought to the host only by :meth:`fold_flops`, which the loop calls where it syncs
    anyway. Rates cover the interval since the last log or validation (:meth:`new_interval`);
    ``val_freq`` is None for a run without validation; ``val_tokens`` (``Validator.pass_tokens``, 0
    when unknown) estimates the first validation's duration for the ETA. With a FLOPs ``budget`` the
    run's length (for the ETA and the logged total) is the steps the budget affords at the FLOPs per
    step so far.
    """

    def __init__(
        self,
        state: TrainState,
        training: Training,
        *,
        device: torch.device,
        dp_degree: int,
        world_size: int,
        total_steps: int,
        flops_per_byte: float,
        val_freq: int | None,
        budget: FlopsBudget | None = None,
        val_tokens: int = 0,
    ):
        self.state = state
        self.budget = budget
        self.device = device
        self.world_size = world_size
        self.total_steps = total_steps
        self.val_freq = val_freq
        self.val_tokens = val_tokens
        self.formula_flops = flops_per_byte
        self.local_tokens_per_step = training.local_batch_size * training.gradient_accumulation_steps * training.seq_len
        self.tokens_per_step = self.local_tokens_per_step * dp_degree
        self.throughput = Throughput(device)
        self.start()

    def start(self) -> None:
        """The loop begins (again): the clock, the rates and the FLOPs not yet folded start from zero."""
        self.pending_flops = torch.zeros((), dtype=torch.float64, device=self.device)
        self.peak = peak_flops(self.device)
        self.t_start = time.perf_counter()
        self.step_time: float | None = None  # smoothed seconds per training step (validation excluded)
        self.val_time: float | None = None  # seconds the last validation took
        self.interval_flops = 0.0
        self.throughput.reset()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def add_step(self, metrics: dict[str, torch.Tensor]) -> None:
        """One optimizer step done (``metrics``: its unreduced metrics): its tokens and FLOPs."""
        fpb = metrics.get(AUX + FLOPS_PER_BYTE)
        self.pending_flops += (fpb.double() if fpb is not None else self.formula_flops) * self.local_tokens_per_step
        self.state.tokens_seen += self.tokens_per_step
        self.throughput.add(self.tokens_per_step)

    def fold_flops(self) -> None:
        """Add the FLOPs of the steps since the last fold (all ranks: one all-reduce, one sync) to the
        train state and the interval."""
        flops = all_reduce_sum(self.pending_flops).item()
        self.pending_flops.zero_()
        self.state.flops += flops
        self.interval_flops += flops

    def planned_steps(self, step: int) -> int:
        """The run's length as it stands after ``step``: ``total_steps``, or with a FLOPs budget the
        steps it affords at the FLOPs per step so far (at most ``total_steps``)."""
        if self.budget is None or self.budget.spent <= 0:
            return self.total_steps
        if self.budget.reached():
            return step
        return min(self.total_steps, max(step + 1, math.ceil(self.budget.projected_steps(step))))

    def validations_left(self, step: int, *, own: bool) -> int:
        """The validations after ``step`` (every ``val_freq`` steps, and the last step), and ``step``'s
        own when it is still to come (``own``: a log step's line comes before its validation)."""
        if self.val_freq is None:
            return 0
        planned, f = self.planned_steps(step), self.val_freq
        later = planned // f - step // f + (planned > step and planned % f != 0)
        return later + (own and (step % f == 0 or step >= planned))

    def val_seconds(self) -> float:
        """A validation's expected duration: the last one's; before the first, its forward positions
        (``val_tokens``) at a third of a training step's time per position (a forward is about a
        third of a forward and backward); 0 while neither is known."""
        if self.val_time is not None:
            return self.val_time
        if self.step_time is None:
            return 0.0
        return self.step_time * self.val_tokens / self.local_tokens_per_step / 3

    def eta(self, step: int, *, val_pending: bool = False) -> float:
        """Seconds left after ``step``: the remaining steps at the smoothed step time, and the remaining
        validations (``step``'s own too when ``val_pending``) at :meth:`val_seconds` each: the line
        of the last step, logged before its validation, counts that validation."""
        remaining = self.planned_steps(step) - step
        vals = self.validations_left(step, own=val_pending)
        return remaining * (self.step_time or 0.0) + vals * self.val_seconds()

    def step_scalars(self, step: int, *, lr: float) -> dict[str, float]:
        """The numbers logged beside a log step's metrics (one device sync for the clock): elapsed time,
        ETA, learning rate, tokens/s, tokens and FLOPs so far, TFLOP/s and MFU per rank, peak memory."""
        tps, sps = self.throughput.rates()
        self.step_time = sps if self.step_time is None else 0.7 * self.step_time + 0.3 * sps
        flops_per_byte = self.interval_flops / max(self.throughput.tokens, 1)
        scalars = dict(
            total_steps=self.planned_steps(step),
            elapsed_s=self.elapsed(),
            eta_s=self.eta(step, val_pending=True),
            lr=lr,
            tokens_per_s=tps,
            tokens_seen=self.state.tokens_seen,
            train_flops=self.state.flops,
            tflops=flops_per_byte * tps / self.world_size / 1e12,
            memory_gib=memory_gib(self.device),
        )
        if self.peak:
            scalars["mfu"] = flops_per_byte * tps / self.world_size / self.peak
        return scalars

    def timed_validation(self, validate: Callable[[], T]) -> T:
        """``validate()``, its duration kept for the ETA."""
        t0 = time.perf_counter()
        result = validate()
        self.val_time = time.perf_counter() - t0
        return result

    def val_scalars(self, step: int) -> dict[str, float]:
        """The numbers logged beside a validation's results."""
        return dict(
            tokens_seen=self.state.tokens_seen,
            train_flops=self.state.flops,
            elapsed_s=self.elapsed(),
            total_steps=self.planned_steps(step),
            eta_s=self.eta(step),
        )

    def new_interval(self) -> None:
        """Rates start again (after a log or a validation: their time is not training time)."""
        self.throughput.reset()
        self.interval_flops = 0.0
