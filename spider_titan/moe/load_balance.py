"""Aux-loss-free load balancing (DeepSeek-V3): a per-expert selection bias nudged every step.

Each MoE layer routes with ``scores + expert_bias`` (selection only; the gate weights stay the
unbiased scores). After every optimizer step's backward, each layer's bias moves by
``rate * sign(mean_count - count_i)``: under-loaded experts become more attractive.

Counts are accumulated inside each MoE layer's forward (``MoE.step_counts``) over every
micro-batch (and every loop of the recurrent core), for training forwards only: a forward in eval
mode (validation between steps) and a forward re-run by activation checkpointing during backward
(moe/routing_replay.py tells) are not counted. Before the update they are summed over all ranks,
so the result does not depend on gradient accumulation or world size. The update is a post-step
hook the builder runs after every optimizer step (registry kind ``load_balance``).

All ranks are the data-parallel ranks here (every rank loads its own data; under expert parallel
each rank counts its own tokens' routing, before the dispatch), so the bias follows the global
batch's load: global-batch statistics, like the aux loss's f_i and P_i (moe/layer.py), which are
summed over the same ranks per micro-batch instead, because a micro-batch's loss is needed
before the next one is seen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from spider_titan.distributed import all_reduce_sum
from spider_titan.job_config import MoE as MoEConfig
from spider_titan.moe.layer import MoE

logger = logging.getLogger("spider_titan")


class AuxFreeBalancer:
    """Switches counting on in every MoE layer; :meth:`update`, run after each optimizer step (the
    builder registers it as a post-step hook), moves every layer's expert bias. The bias is a
    buffer the optimizer never touches, so after the step or before it gives the same model."""

    def __init__(self, model: nn.Module, rate: float):
        self.rate = rate
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        for layer in self.layers:
            layer.count_load = True
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
        for layer in self.layers:
            layer.count_load = False


# The [moe] load_balance components (registry kind "load_balance"): ``(model, cfg) -> post-step
# hooks``, ``cfg`` being the [moe] section. The aux loss itself lives in the model (its weight is
# a model arg the builder sets from [moe]); the bias needs the counting and the update.


def apply_aux_loss_balancing(model: nn.Module, cfg: MoEConfig) -> list[Callable[[], None]]:
    """``aux_loss``: nothing outside the model's loss."""
    return []


def apply_aux_free_balancing(model: nn.Module, cfg: MoEConfig) -> list[Callable[[], None]]:
    """``aux_free`` / ``both``: the selection bias, updated after every optimizer step."""
    if not any(isinstance(m, MoE) for m in model.modules()):
        return []
    return [AuxFreeBalancer(model, cfg.bias_update_rate).update]
