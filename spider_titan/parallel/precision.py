"""Compute weights: parameters cast to the compute dtype once per optimizer step.

Under autocast every use of a weight casts it again: each of the core's loops, each micro-batch,
each activation-checkpoint recompute, and every explicit ``w.to(x.dtype)`` (the MoE experts, the
per-loop LoRA slices), which the autocast cache does not cover. FSDP's MixedPrecisionPolicy casts
once per gather; :class:`ComputeWeights` does the same for a model FSDP does not hold. Inside its
context the model's matmul weights are replaced by bf16 (or fp16) copies made once on entry; the
forward, its loops and the backward's recompute all read those, and each copy's gradient flows
back through its one cast into the fp32 parameter's ``.grad`` (accumulated there in fp32 across
micro-batches). Autocast stays on for everything else, so the forward computes exactly what plain
autocast computes: autocast rounds these weights to the same dtype at every use anyway.

With ``every_param`` (``training.mixed_precision_mode = "params"``) every floating parameter is cast,
embedding tables and norm gains included, and the step runs without autocast: what FSDP's
MixedPrecisionPolicy computes, so activations and the residual stream are bf16, not fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call swaps with


def matmul_weight_names(model: nn.Module) -> list[str]:
    """The parameters autocast would cast at every use: floating, two or more dims, not an
    embedding table (autocast leaves lookups in the table's dtype), not one a module reads in fp32
    whatever autocast does (its ``FP32_PARAMS``, e.g. the MoE router)."""
    kept = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for m in model.modules():
        kept.update(id(m.get_parameter(name)) for name in getattr(m, "FP32_PARAMS", ()))
    return [name for name, p in model.named_parameters() if p.is_floating_point() and p.ndim >= 2 and id(p) not in kept]


def floating_param_names(model: nn.Module) -> list[str]:
    """Every floating parameter: what FSDP's MixedPrecisionPolicy casts to its param dtype."""
    return [name for name, p in model.named_parameters() if p.is_floating_point()]


class ComputeWeights:
    """``with compute_weights(): ...``: the model's matmul weights (``every_param``: all its floating
    parameters) in ``dtype``, cast on entry, for every forward and backward inside (the train step
    wraps all its micro-batches in one)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, every_param: bool = False):
        self.model, self.dtype = model, dtype
        self.names = floating_param_names(model) if every_param else matmul_weight_names(model)

    @contextmanager
    def __call__(self) -> Iterator[None]:
        params = dict(self.model.named_parameters())
        cast = {name: params[name].to(self.dtype) for name in self.names}
        with _reparametrize_module(self.model, cast, tie_weights=True):
            yield


def compute_precision(
    model: nn.Module, training, dtype: torch.dtype | None
) -> tuple[torch.dtype | None, ComputeWeights | None]:
    """``(autocast_dtype, compute_weights)`` for a model the train step casts itself (no FSDP) to
    ``dtype`` (None: it computes in its parameters' dtype); ``training`` is the [training] section."""
    if dtype is None:
        return None, None
    if training.mixed_precision_mode == "params":
        return None, ComputeWeights(model, dtype, every_param=True)
    return dtype, ComputeWeights(model, dtype) if training.cast_weights_once else None
