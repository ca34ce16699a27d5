"""Small distributed helpers used by the train loop (no-ops in a single process)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over every rank (in place on a copy); identity without a process group."""
    t = t.clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Total gradient 2-norm over all parameters (DTensor-aware), clipped to ``max_norm`` if > 0.

    Sharded gradients give a partial norm per rank; ``full_tensor()`` reduces it so every rank
    clips by the same global norm.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total, foreach=True)
    return total
