"""The end-of-run calibration (``[calibration]``, ``ModelSpec.calibrate``): after the last training step
the model's eval-time settings are fitted on the batches training would read next, bytes it has not
been trained on. The model decides what to fit (Spider: the gains of the loops past ``n_loops``); this
part scores it on those batches, every rank on its own and the per-window losses gathered, so every
rank sees the same figures and makes the same choice. A stop signal during it puts the model's
buffers back as they were: a calibration is applied whole or not at all."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from spider_titan.data.loader import ByteDataLoader
from spider_titan.distributed import all_gather_cat
from spider_titan.job_config import Calibration
from spider_titan.parallel.fsdp import eval_pass
from spider_titan.protocol import ModelSpec, window_cross_entropy
from spider_titan.training.signals import StopSignal

logger = logging.getLogger("spider_titan")


class _Stopped(Exception):
    """A stop signal came between two scoring passes."""


class Calibrator:
    """Runs ``spec.recurrence.calibrate`` on the batches read ahead of ``train_loader`` (not consumed): ``cfg.steps``
    of them, or ``max_batches`` if fewer (at least one). The trainer passes a tenth of the micro-batches
    the run trained on, so a short run does not spend a noticeable share of its time calibrating."""

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        model_args: Any,
        train_loader: ByteDataLoader,
        cfg: Calibration,
        *,
        device: torch.device,
        autocast: Callable[[], AbstractContextManager],
        stop: StopSignal,
        max_batches: int | None = None,
    ):
        self.model, self.spec, self.model_args, self.loader, self.cfg = model, spec, model_args, train_loader, cfg
        self.device, self.autocast, self.stop = device, autocast, stop
        self.n_batches = cfg.steps if max_batches is None else max(min(cfg.steps, max_batches), 1)

    @property
    def active(self) -> bool:
        return self.cfg.enable and self.spec.recurrence is not None and self.spec.recurrence.calibrate is not None

    def __call__(self) -> dict[str, float] | None:
        """The figures ``spec.recurrence.calibrate`` returns (empty when inactive); None when a stop signal came
        (checked before every scoring pass): the buffers are then restored and nothing is applied."""
        if not self.active:
            return {}
        start = time.perf_counter()
        batches = [(x.to(self.device), y.to(self.device)) for x, y in self.loader.upcoming(self.n_batches)]
        saved = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        passes = 0

        def score(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal passes
            if self.stop.requested():
                raise _Stopped
            ce, count = [], []
            for inputs, labels in batches:
                with self.autocast():
                    logits = self.model(inputs, **kwargs).logits
                c, n = window_cross_entropy(logits, labels)
                ce.append(c)
                count.append(n)
            passes += 1
            both = all_gather_cat(torch.stack([torch.cat(ce), torch.cat(count)], dim=1))  # (R, 2), one copy
            both = both.cpu()
            return both[:, 0], both[:, 1]

        with eval_pass(self.model):
            try:
                figures = self.spec.recurrence.calibrate(self.model, self.model_args, score)
            except _Stopped:
                for name, b in self.model.named_buffers():
                    b.copy_(saved[name])
                return None
        if passes:  # a model with nothing to fit (Spider with ACT) scores nothing
            logger.info(
                "calibration: %d scoring passes over %d batches per rank in %.1f s",
                passes,
                len(batches),
                time.perf_counter() - start,
            )
        return figures
