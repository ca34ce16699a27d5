"""The validation pass: loss and bits per byte on the validation split, the same batches every time,
once per eval variant of the model (e.g. Spider at 1, 2, 4 loops)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from spider_titan.config.job_config import Validation
from spider_titan.data.loader import ByteDataLoader
from spider_titan.distributed import all_reduce_sum
from spider_titan.protocol import ModelSpec
from spider_titan.training.health import NoLabelsError
from spider_titan.training.progress import LN2
from spider_titan.training.signals import StopSignal
from spider_titan.vocab import IGNORE_INDEX


class Validator:
    """Runs the validation pass over ``loader`` from where it stands now: every pass replays the
    loader from that position, so every pass sees the same batches."""

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        model_args: Any,
        loader: ByteDataLoader,
        cfg: Validation,
        *,
        device: torch.device,
        autocast: Callable[[], AbstractContextManager],
        stop: StopSignal,
        world_size: int,
    ):
        self.model, self.spec, self.model_args, self.loader, self.cfg = model, spec, model_args, loader, cfg
        self.device, self.autocast, self.stop, self.world_size = device, autocast, stop, world_size
        self.start = loader.state_dict()

    @torch.no_grad()
    def __call__(self) -> dict[str, float] | None:
        """``val_loss<variant>`` and ``val_bpb<variant>``; the plain variant also reports the model's own
        figures (``val_<aux key>``). None when a stop signal came: it is checked before every batch
        (one CPU all-reduce), and a validation cut short is not reported."""
        model, loader = self.model, self.loader
        variants = self.spec.eval_variants(self.model_args) if self.spec.eval_variants is not None else [("", {})]
        steps = self.cfg.steps if self.cfg.steps >= 0 else loader.num_windows // loader.global_batch_size
        model.eval()
        results: dict[str, float] = {}
        for suffix, kwargs in variants:
            ce, n = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
            aux_sums: dict[str, torch.Tensor] = {}
            batches = 0
            loader.load_state_dict(self.start)
            for i, (inputs, labels) in enumerate(loader):
                if i >= max(steps, 1):
                    break
                if self.stop.requested():
                    model.train()
                    return None
                inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
                with self.autocast():
                    out = model(inputs, **kwargs)
                ce += self.spec.loss_sum(out.logits, labels)
                n += (labels != IGNORE_INDEX).sum()
                batches += 1
                if not suffix:
                    for key, value in out.aux.items():
                        aux_sums[key] = aux_sums.get(key, 0) + value.detach().float()
            keys = sorted(aux_sums)
            total = all_reduce_sum(torch.stack([ce, n.float()] + [aux_sums[k] for k in keys]).double()).tolist()
            if total[1] == 0:
                raise NoLabelsError(
                    f"validation: {loader.dataset.description} holds no label tokens (every target is PAD) in "
                    f"its first {batches} batches; fix the val split or set validation.enable = false"
                )
            loss = total[0] / total[1]
            results[f"val_loss{suffix}"] = loss
            results[f"val_bpb{suffix}"] = loss / LN2
            for j, key in enumerate(keys):
                results[f"val_{key}"] = total[j + 2] / (batches * self.world_size)
        model.train()
        return results
