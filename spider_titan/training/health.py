"""Step health at no host sync per step: every step folds "loss or gradient norm non-finite" and
"no label tokens in the global batch" into device-side flags (:class:`StepHealth`), which the loop
reads at log steps, before every checkpoint and at the end. The first bad step stops the run with
one line naming it and the last good checkpoint (``training.skip_nonfinite_steps`` skips up to N
non-finite updates in a row instead, at the price of one sync per step)."""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger("spider_titan")


class NonFiniteError(FloatingPointError):
    """A step's loss or gradient norm was not finite (or the model state is): the run stops."""


class NoLabelsError(ValueError):
    """A batch or split with no label tokens: there is nothing to learn from it."""


def resume_hint(latest_good: tuple[int, Path] | None, *, saving: bool, command: str) -> str:
    """'last good checkpoint ...; resume with ...' for the one-line stop messages; ``latest_good`` is the
    checkpointer's (step, path) to resume from, ``saving`` whether checkpointing is enabled."""
    if latest_good is None:
        where = "no checkpoint was saved" if saving else "checkpoint.enable is false, nothing was saved"
        return f"{where}; lower optimizer.lr or set training.skip_nonfinite_steps and start again"
    step, path = latest_good
    return (
        f"last good checkpoint {path}; resume from it with: {command} --checkpoint.load_step {step} "
        "(lower optimizer.lr or set training.skip_nonfinite_steps first)"
    )


class StepHealth:
    """Device-side record of bad steps, read on the host only when asked (:meth:`read`, :meth:`check`).

    first_bad:   first step whose loss or gradient norm was non-finite (NONE: none yet)
    bad_loss, bad_norm: that step's loss (per label token, this rank's) and gradient norm
    first_empty: first step whose global batch held no label token (NONE: none yet)

    The stop messages name ``data`` (the training data's description) and say how to resume from
    ``latest_good()`` (the checkpointer's newest good checkpoint) with ``command``.
    """

    NONE = 2**62

    def __init__(
        self,
        device: torch.device,
        *,
        data: str,
        skip_limit: int,
        latest_good: Callable[[], tuple[int, Path] | None],
        saving: bool,
        command: str,
    ):
        self.first_bad = torch.full((), self.NONE, dtype=torch.int64, device=device)
        self.first_empty = torch.full((), self.NONE, dtype=torch.int64, device=device)
        self.bad_loss = torch.zeros((), device=device)
        self.bad_norm = torch.zeros((), device=device)
        self.data = data
        self.skip_limit = skip_limit  # training.skip_nonfinite_steps
        self.skipped_in_a_row = 0  # non-finite updates skipped since the last good step
        self.latest_good = latest_good
        self.saving = saving
        self.command = command

    def record(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, label_tokens: torch.Tensor
    ) -> torch.Tensor:
        """Fold step ``step`` in. Returns "the gradient norm is non-finite": the same on every rank
        (the norm is all-reduced), so every rank takes the same skip decision on it."""
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        first = bad & (self.first_bad == self.NONE)
        self.first_bad = torch.where(first, step, self.first_bad)
        self.bad_loss = torch.where(first, loss.float(), self.bad_loss)
        self.bad_norm = torch.where(first, grad_norm.float(), self.bad_norm)
        self.first_empty = torch.where((label_tokens == 0) & (self.first_empty == self.NONE), step, self.first_empty)
        return ~torch.isfinite(grad_norm)

    def skip_update(self, step: int, bad: torch.Tensor) -> bool:
        """Whether to drop step ``step``'s update (``bad``: :meth:`record`'s answer). Only with
        ``training.skip_nonfinite_steps`` > 0, where reading ``bad`` is the one sync per step the option
        costs; past that many non-finite steps in a row the run stops (:meth:`check`)."""
        if self.skip_limit == 0 or not bool(bad):
            self.skipped_in_a_row = 0
            return False
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row > self.skip_limit:
            self.check(
                step,
                why=f"{self.skipped_in_a_row} non-finite steps in a row, "
                f"training.skip_nonfinite_steps = {self.skip_limit}",
            )
        logger.warning(
            "step %d: non-finite loss or gradient norm; update skipped (%d of at most %d in a row)",
            step,
            self.skipped_in_a_row,
            self.skip_limit,
        )
        self.first_bad.fill_(self.NONE)  # forget the skipped step
        return True

    def read(self) -> tuple[int, int, float, float]:
        """(first_bad, first_empty, bad_loss, bad_norm), -1 for none: one sync, and one min
        all-reduce so every rank sees the earliest bad step of any rank."""
        steps = torch.stack([self.first_bad, self.first_empty])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(steps, op=dist.ReduceOp.MIN)
        first_bad, first_empty = (-1 if v == self.NONE else int(v) for v in steps.tolist())
        loss, norm = torch.stack([self.bad_loss, self.bad_norm]).tolist()
        return first_bad, first_empty, loss, norm

    def check(self, step: int, *, why: str = "") -> None:
        """Read the flags (:meth:`read`); raise for a non-finite or empty step so far, ``step`` being
        the one trained last."""
        first_bad, first_empty, bad_loss, bad_norm = self.read()
        if first_empty >= 0:
            raise NoLabelsError(
                f"step {first_empty}: the global batch holds no label tokens (every target is PAD) in "
                f"{self.data}; the data has nothing to learn there"
            )
        if first_bad >= 0:
            what = "loss" if not math.isfinite(bad_loss) else "gradient norm"
            hint = resume_hint(self.latest_good(), saving=self.saving, command=self.command)
            raise NonFiniteError(
                f"step {first_bad}: non-finite {what} (loss {bad_loss:.4g}, grad norm {bad_norm:.4g}"
                f"{'; ' + why if why else ''}; detected at step {step}); {hint}"
            )


class DropWatch:
    """Warns when a static segment capacity (``model.segment_capacity`` / ``packed_capacity``) drops more
    than ``LIMIT`` of the segments: the median of the logged steps' ``aux.segments_dropped`` over the last
    ``WINDOW`` log steps (so one dense batch does not warn), once, and again each time that median
    doubles. A dropped segment's bytes read no core output."""

    LIMIT = 0.01
    WINDOW = 5

    def __init__(self, capacities: str):
        self.capacities, self.recent, self.warned = capacities, deque(maxlen=self.WINDOW), 0.0

    def log_step(self, step: int, dropped: float | None) -> bool:
        """Take a log step's dropped share (None: no capacity); True when it warned."""
        if dropped is None:
            return False
        self.recent.append(dropped)
        median = statistics.median(self.recent)
        if len(self.recent) < self.WINDOW or median <= max(self.LIMIT, 2 * self.warned):
            return False
        self.warned = median
        logger.warning(
            "step %d: %s dropped a median %.1f %% of the segments at the last %d logged steps (their bytes read no "
            "core output); raise it (python -m lab.analysis.segment_capacity measures what a trained model needs)",
            step,
            self.capacities,
            100 * median,
            len(self.recent),
        )
        return True
