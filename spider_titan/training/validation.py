"""The validation pass: loss and bits per byte on the validation split, the same batches every time,
once per distinct eval variant of the model (e.g. Spider at 1, 2, 4 loops; the default is its
trained-loops pass, run once). ``validation.steps = -1``: the whole split, its last partial batch
and the windows' tail included. A pass that runs longer than ``PROGRESS_EVERY_S`` logs where it
stands (:class:`PassProgress`)."""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from torch import nn

from spider_titan.data.loader import ByteDataLoader
from spider_titan.distributed import all_reduce_sum
from spider_titan.job_config import Validation
from spider_titan.metrics.logger import format_duration
from spider_titan.parallel.fsdp import eval_pass
from spider_titan.protocol import ModelSpec
from spider_titan.training.health import NoLabelsError
from spider_titan.training.progress import LN2
from spider_titan.training.signals import StopSignal
from spider_titan.vocab import IGNORE_INDEX, PAD_ID, VOCAB_SIZE

logger = logging.getLogger("spider_titan")

# Seconds between a pass's progress lines. A whole-split pass over the built-in corpus's val split
# took 26 to 53 s on a shared 2-core CPU (debug model, 3 variants x 97 batches) with nothing on the
# console; a pass shorter than this (make train's 4 batches per variant, the tests) logs no line.
PROGRESS_EVERY_S = 10.0


class Validator:
    """Runs the validation pass over ``loader`` from where it stands now: every pass replays the
    loader from that position, so every pass sees the same batches. ``validation.steps = -1`` reads
    the whole split instead (``whole_split_batches``)."""

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

    def variant_groups(self) -> list[tuple[dict, list[str]]]:
        """The eval variants grouped by equal forward kwargs, in order: a group runs once and is
        reported under each of its suffixes (Spider's default pass is its trained-loops pass)."""
        eval_variants = self.spec.training.eval_variants
        variants = eval_variants(self.model_args) if eval_variants is not None else [("", {})]
        groups: list[tuple[dict, list[str]]] = []
        for suffix, kwargs in variants:
            same = next((g for g in groups if g[0] == kwargs), None)
            if same is None:
                groups.append((kwargs, [suffix]))
            else:
                same[1].append(suffix)
        return groups

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The pass's batches: ``validation.steps`` batches replayed from the loader's start
        position, or with -1 every window of the split once (``whole_split_batches``)."""
        if self.cfg.steps < 0:
            return whole_split_batches(self.loader)
        self.loader.load_state_dict(self.start)
        return itertools.islice(iter(self.loader), max(self.cfg.steps, 1))

    def batches_per_pass(self) -> int:
        """The forward batches of one validation: the batches of :meth:`batches` for every variant group."""
        per_group = whole_split_batch_count(self.loader) if self.cfg.steps < 0 else max(self.cfg.steps, 1)
        return per_group * len(self.variant_groups())

    def pass_tokens(self) -> int:
        """The positions one validation runs forward on this rank (padding rows included), for an
        estimate of its duration before it first runs (``Progress``'s ``val_tokens``)."""
        return self.batches_per_pass() * self.loader.local_batch_size * self.loader.seq_len

    def __call__(self) -> dict[str, float] | None:
        """``val_loss<variant>`` and ``val_bpb<variant>``; the plain variant also reports the model's own
        figures (``val_<aux key>``, means over the batches that hold labels). None when a stop signal
        came: it is checked before every batch (one CPU all-reduce), and a validation cut short is
        not reported."""
        with eval_pass(self.model):
            return self._passes(self.model)

    def _passes(self, model: nn.Module) -> dict[str, float] | None:
        results: dict[str, float] = {}
        progress = PassProgress(self.batches_per_pass())
        for kwargs, suffixes in self.variant_groups():
            ce, n = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
            aux_sums: dict[str, torch.Tensor] = {}
            aux_batches = torch.zeros((), device=self.device)
            batches = 0
            for inputs, labels in self.batches():
                if self.stop.requested():
                    return None
                inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
                with self.autocast():
                    out = model(inputs, **kwargs)
                ce += self.spec.training.loss_sum(out.logits, labels)
                has_labels = (labels != IGNORE_INDEX).sum()
                n += has_labels
                batches += 1
                if "" in suffixes:  # a batch of padding rows only (the end of the split) has no figures
                    keep = has_labels > 0
                    aux_batches += keep
                    for key, value in out.aux.items():
                        value = torch.where(keep, value.detach().float(), 0.0)
                        aux_sums[key] = aux_sums.get(key, 0) + value
                progress.advance()
            keys = sorted(aux_sums)
            stacked = [ce, n.float(), aux_batches] + [aux_sums[k] for k in keys]
            total = all_reduce_sum(torch.stack(stacked).double()).tolist()
            if total[1] == 0:
                raise NoLabelsError(
                    f"validation: {self.loader.dataset.description} holds no label tokens (every target is PAD) in "
                    f"its first {batches} batches; fix the val split or set validation.enable = false"
                )
            loss = total[0] / total[1]
            for suffix in suffixes:
                results[f"val_loss{suffix}"] = loss
                results[f"val_bpb{suffix}"] = loss / LN2
            for j, key in enumerate(keys):
                results[f"val_{key}"] = total[j + 3] / max(total[2], 1.0)
        return results


class PassProgress:
    """``validation: i of N batches | elapsed | eta`` every ``PROGRESS_EVERY_S`` seconds of a pass, so a long
    one (a whole split) is visible; nothing for a shorter pass. Only rank 0's logger prints info lines.
    The clock is the host's: on a GPU it may run a few queued batches ahead of the device."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.t0 = time.perf_counter()
        self.due = self.t0 + PROGRESS_EVERY_S

    def advance(self) -> None:
        """One batch done: a line when ``PROGRESS_EVERY_S`` have passed since the start or the last line
        (and not for the last batch: the results come next)."""
        self.done += 1
        now = time.perf_counter()
        if now < self.due or self.done >= self.total:
            return
        self.due = now + PROGRESS_EVERY_S
        elapsed = now - self.t0
        logger.info(
            "validation: %d of %d batches | elapsed %s | eta %s",
            self.done,
            self.total,
            format_duration(elapsed),
            format_duration(elapsed / self.done * (self.total - self.done)),
        )


def whole_split_rows(loader: ByteDataLoader) -> tuple[int, int]:
    """The split's full windows and the predictions of the tail they leave (0 to seq_len - 1)."""
    n_full = loader.num_windows
    return n_full, loader.dataset.num_tokens - 1 - n_full * loader.seq_len


def whole_split_batch_count(loader: ByteDataLoader) -> int:
    """The batches :func:`whole_split_batches` yields on every rank."""
    n_full, tail = whole_split_rows(loader)
    return math.ceil((n_full + (tail > 0)) / loader.global_batch_size)


def whole_split_batches(loader: ByteDataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every prediction of ``loader``'s split once: its windows in stream order (the sampler's
    windows, stride seq_len), then the tail they leave (fewer than seq_len predictions) as one
    PAD-padded row, the last global batch filled up with PAD rows. PAD labels are ignored, so the
    loss sums over exactly the split's ``num_tokens - 1`` next-token predictions. Every rank yields
    the same number of batches (its own rows of each global batch), as collectives need."""
    ds, T, b = loader.dataset, loader.seq_len, loader.local_batch_size
    n_full, tail = whole_split_rows(loader)
    n_rows = n_full + (tail > 0)
    offset = loader.dp_rank * b
    for first in range(0, n_rows, loader.global_batch_size):
        rows = np.full((b, T + 1), PAD_ID, dtype=np.uint16)
        for j in range(b):
            r = first + offset + j
            if r < n_full:
                rows[j] = ds.window(r * T, T + 1)
            elif r == n_full and tail > 0:
                rows[j, : tail + 1] = ds.window(r * T, tail + 1)
            if int(rows[j].max()) >= VOCAB_SIZE:
                ds.raise_bad_token(r * T, rows[j])
        tokens = torch.from_numpy(rows.astype(np.int64))
        labels = tokens[:, 1:].clone()
        labels[labels == PAD_ID] = IGNORE_INDEX
        yield tokens[:, :-1].contiguous(), labels
