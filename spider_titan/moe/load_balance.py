"""Aux-loss-free load balancing (DeepSeek-V3): a per-expert selection bias nudged every step.

Each MoE layer routes with ``scores + expert_bias`` (selection only; the gate weights stay the
unbiased scores). After every optimizer step's backward, each layer's bias moves by
``rate * sign(mean_count - count_i)``: under-loaded experts become more attractive.

Counts are accumulated inside each MoE layer's forward (``MoE.step_counts``) over every
micro-batch (and every loop of the recurrent core), for training forwards only: a forward in eval
mode (validation between steps) and a forward re-run by activation checkpointing during backward
(moe/routing_replay.py tells) are not counted. Before the update they are summed over all ranks,
so the result does not depend on gradient accumulation or world size. The update runs in an
optimizer step pre-hook, i.e. once per step, after all gradients exist.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from spider_titan.moe.layer import MoE
from spider_titan.parallel.utils import all_reduce_sum

logger = logging.getLogger("spider_titan")


class AuxFreeBalancer:
    """Switches counting on in every MoE layer and applies the bias update before each optimizer step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, rate: float):
        self.rate = rate
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        for layer in self.layers:
            layer.count_load = True
        self.handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.update())
        logger.info("aux-loss-free balancing on %d MoE layers, rate %g", len(self.layers), rate)

    def counts(self) -> list[torch.Tensor]:
        """Each layer's routed slots per expert so far in this step, on this rank."""
        return [layer.step_counts for layer in self.layers]

    @torch.no_grad()
    def update(self) -> None:
        if not self.layers:
            return
        stacked = all_reduce_sum(torch.stack(self.counts()))  # (layers, E), over all ranks
        for layer, counts in zip(self.layers, stacked):
            layer.update_expert_bias(counts, self.rate)  # all zero (no training forward): no change
            layer.step_counts.zero_()

    def remove(self) -> None:
        self.handle.remove()
        for layer in self.layers:
            layer.count_load = False


def maybe_apply_aux_free_balancing(model: nn.Module, optimizer: torch.optim.Optimizer, cfg) -> AuxFreeBalancer | None:
    """``cfg`` is the [moe] section; None when the mode does not use the bias or there is no MoE."""
    if cfg.load_balance not in ("aux_free", "both"):
        return None
    if not any(isinstance(m, MoE) for m in model.modules()):
        return None
    return AuxFreeBalancer(model, optimizer, cfg.bias_update_rate)
