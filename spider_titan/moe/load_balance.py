"""Aux-loss-free load balancing (DeepSeek-V3): a per-expert selection bias nudged every step.

Each MoE layer routes with ``scores + expert_bias`` (selection only; the gate weights stay the
unbiased scores). After every optimizer step's backward, each layer's bias moves by
``rate * sign(mean_count - count_i)``: under-loaded experts become more attractive.

Counts are accumulated by a forward hook over every micro-batch (and every loop of the
recurrent core) and summed over all ranks before the update, so the result does not depend on
gradient accumulation or world size. Forwards re-run by activation checkpointing during
backward are not counted. The update runs in an optimizer step pre-hook, i.e. once per step,
after all gradients exist.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from spider_titan.moe.layer import MoE
from spider_titan.parallel.utils import all_reduce_sum

logger = logging.getLogger("spider_titan")


class AuxFreeBalancer:
    """Owns the hooks; ``counts`` holds the running per-layer counts of the current step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, rate: float):
        self.rate = rate
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        self.counts: dict[int, torch.Tensor] = {}
        self.handles = [layer.register_forward_hook(self._accumulate) for layer in self.layers]
        self.handles.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.update()))
        logger.info("aux-loss-free balancing on %d MoE layers, rate %g", len(self.layers), rate)

    def _accumulate(self, layer: MoE, inputs, output) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside backward (activation checkpointing): already counted
        counts = output[1].counts.detach().float()
        key = id(layer)
        self.counts[key] = self.counts[key] + counts if key in self.counts else counts.clone()

    @torch.no_grad()
    def update(self) -> None:
        if not self.counts:
            return
        keys = [id(layer) for layer in self.layers if id(layer) in self.counts]
        stacked = all_reduce_sum(torch.stack([self.counts[k] for k in keys]))  # (layers, E), over all ranks
        by_id = {id(layer): layer for layer in self.layers}
        for key, counts in zip(keys, stacked):
            by_id[key].update_expert_bias(counts, self.rate)
        self.counts.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def maybe_apply_aux_free_balancing(model: nn.Module, optimizer: torch.optim.Optimizer, cfg) -> AuxFreeBalancer | None:
    """``cfg`` is the [moe] section; None when the mode does not use the bias or there is no MoE."""
    if cfg.load_balance not in ("aux_free", "both"):
        return None
    if not any(isinstance(m, MoE) for m in model.modules()):
        return None
    return AuxFreeBalancer(model, optimizer, cfg.bias_update_rate)
