"""Activations measured on fake tensors: one micro-batch's forward, loss and backward at the config's
real width, batch and sequence, under its activation checkpointing and compiled blocks, no memory and
no compute (the package docstring lists the assumptions)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from spider_titan.job_config import JobConfig
from spider_titan.plan.compiled import compile_like_trainer
from spider_titan.plan.recorder import _LiveStorages
from spider_titan.plan.sharded import planning_config


def _efficient_attention(
    q, k, v, *, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, **_
) -> torch.Tensor:
    """The GPU's fused attention as the plan sees it: memory-efficient attention's own op. Its autograd
    saves q, k, v, the output and an fp32 logsumexp per query, never the T x T scores; it runs on fake
    tensors through its meta kernel, and a compiled block's partitioner sees one opaque op. Grouped
    keys and values (``enable_gqa``, the dense model) are repeated to the query heads first, as that
    kernel needs them (an upper bound where a GPU kernel reads the groups in place)."""
    if enable_gqa and k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, is_causal=is_causal, scale=scale
    )[0]


@contextmanager
def _gpu_attention() -> Iterator[None]:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _efficient_attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


@dataclass
class ActivationMeasure:
    bytes: int  # alive at the end of forward and loss: what backward reads
    segments: int | None  # the assumed segment count S (None: the model read none)
    notes: list[str] = field(default_factory=list)
    peak: int = 0  # the most alive at once over forward, loss and (when run) backward
    cast_bytes: int = 0  # the matmul weights cast once per step, held through it (no FSDP)
    flops: int = 0  # matmul and attention FLOPs the step runs, activation checkpointing's recompute included


_MEASURED: dict[tuple, ActivationMeasure] = {}  # plans at several rank counts measure the same micro-batch


def measure_activation_bytes(
    cfg: JobConfig,
    *,
    batch: int,
    seq_len: int,
    param_dtype: torch.dtype,
    gpu_attention: bool = True,
    backward: bool = True,
    fsdp: bool = True,
    observer: Callable | None = None,
) -> ActivationMeasure:
    """Bytes one micro-batch's forward and loss leave alive for backward, and the most alive at once
    over forward and (``backward``) backward, at the config's width, with its converters, activation
    checkpointing and compiled blocks, on fake tensors (the package docstring). Without ``fsdp`` and with a
    ``param_dtype`` below fp32, the step runs as the builder sets it up on a GPU: fp32 parameters cast
    once per step (``mixed_precision_mode``: all of them, or the matmul weights under autocast; their
    copies: ``cast_bytes``). ``observer(func, args, kwargs, out)`` sees each op run outside compiled
    graphs (lab/bench/eager_bytes.py); a step observed is measured afresh, not cached."""
    if observer is not None:
        return _measure(cfg, batch, seq_len, param_dtype, gpu_attention, backward, fsdp, observer)
    key = (repr(cfg), batch, seq_len, param_dtype, gpu_attention, backward, fsdp)
    if key not in _MEASURED:
        if len(_MEASURED) >= 16:
            _MEASURED.clear()
        _MEASURED[key] = _measure(cfg, batch, seq_len, param_dtype, gpu_attention, backward, fsdp)
    return _MEASURED[key]


def _measure(cfg, batch, seq_len, param_dtype, gpu_attention, backward, fsdp, observer=None) -> ActivationMeasure:
    from spider_titan.components.builder import build_model
    from spider_titan.moe.layer import MoE
    from spider_titan.parallel.precision import compute_precision

    compiled = cfg.training.compile
    casts = not fsdp and param_dtype != torch.float32
    cfg = planning_config(cfg)
    notes = []
    if cfg.moe.backend != "torch":
        notes.append(f"activations measured with the torch MoE backend (config: {cfg.moe.backend!r})")
        cfg.moe.backend = "torch"
    spec, args, model = build_model(cfg)
    model.train()
    per_byte = spec.moe.tokens_per_byte(args) if spec.moe is not None else None
    # rounded first: in floats 129 * (1 / 3) is not 43 exactly
    segments = math.ceil(round(seq_len * per_byte, 9)) if per_byte is not None else None
    weight_dtype = torch.float32 if casts else param_dtype
    with FakeTensorMode(allow_non_fake_inputs=True):
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    dtype = weight_dtype if p.is_floating_point() else p.dtype
                    module._parameters[name] = nn.Parameter(
                        torch.empty(p.shape, dtype=dtype), requires_grad=p.requires_grad
                    )
                    if backward and p.requires_grad:  # gradients are planned on their own
                        module._parameters[name].grad = torch.zeros_like(module._parameters[name])
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
        inputs = torch.zeros(batch, seq_len, dtype=torch.long)
        labels = torch.zeros(batch, seq_len, dtype=torch.long)
        extra = {"sample_ids": torch.arange(batch)} if "sample_ids" in spec.training.inputs else {}
        before = [*model.parameters(), *model.buffers(), inputs, labels, *extra.values()]
        known = {
            t.untyped_storage()._cdata for t in before + [p.grad for p in model.parameters() if p.grad is not None]
        }
        recorder = _LiveStorages(known, segments, observer)
        if compiled:
            compile_like_trainer(model, spec, recorder)
            # A compiled memory budget saves the MoE top-k in a selective-checkpoint region, which Dynamo
            # numbers and these AOT traces cannot; here it is recomputed (T x k int64 indices per call, 0.3 MiB at 1B).
            for module in model.modules():
                if isinstance(module, MoE):
                    module.save_selection = False
        autocast_dtype, weights = compute_precision(model, cfg.training, param_dtype if casts else None)
        with (
            warnings.catch_warnings(),  # RMSNorm's fp32 weight under autocast: the GPU run warns once itself
            _gpu_attention() if gpu_attention else _nothing(),
            recorder,
            torch.autocast("cpu", dtype=param_dtype, enabled=autocast_dtype is not None),
            weights() if weights is not None else _nothing(),
        ):
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            cast = recorder.live
            loss = spec.training.loss_sum(model(inputs, **extra).logits, labels)  # the logits die here, as in training
            saved = recorder.live - cast
            if backward:
                loss.backward()
        del loss
    if recorder.int_reads == 0:
        segments = None
    return ActivationMeasure(saved, segments, notes, peak=recorder.peak - cast, cast_bytes=cast, flops=recorder.flops)


@contextmanager
def _nothing() -> Iterator[None]:
    yield
