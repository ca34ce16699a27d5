"""The few collectives everyone shares: sums over ranks (plain and differentiable), a gather, the world size and
the gradient-norm clip across meshes. No-ops in a single process; below models, MoE and parallel code
in the layering (docs/architecture.md), so any of them may use these."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over every rank (in place on a copy); identity without a process group."""
    t = t.clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (the same shape on every rank) concatenated along dim 0 in rank order, on
    every rank; ``t`` itself without a process group."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group``; the backward sums the incoming gradients over ``group`` as well (the
    adjoint of "every rank gets the sum of every rank's input"). Functional collectives, so
    ``torch.compile(fullgraph=True)`` traces it inside a block without a graph break."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(t.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


def differentiable_all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``t`` summed over the ranks of ``group``, with gradient (see ``_AllReduceSum``)."""
    return _AllReduceSum.apply(t, group)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Total gradient norm over all parameters, clipped to ``max_norm`` if > 0; returns the norm.

    Gradients may be DTensors on different meshes: FSDP shards dense parameters over "fsdp" and,
    under expert parallel, the experts over "efsdp" x "ep"; a DTensor norm cannot mix meshes. So
    every rank sums ``|g|^p`` over its local shards, each divided by how many ranks hold that
    same shard (the world size over the number of distinct shards: replicas under HSDP, or the
    ranks outside a smaller mesh), and one all-reduce over the world adds it all up: each shard
    counted once, and the same bits on every rank, so every rank clips by the same factor.
    Plain tensors count as replicated on every rank.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    ws = world_size()
    by_copies: dict[int, list[torch.Tensor]] = defaultdict(list)  # ranks holding a shard -> local shards
    for g in grads:
        if isinstance(g, DTensor):
            shards = math.prod(g.device_mesh.size(i) for i, p in enumerate(g.placements) if not p.is_replicate())
            by_copies[ws // shards].append(g.to_local())
        else:
            by_copies[ws].append(g)
    inf = math.isinf(norm_type)
    parts = []
    for copies, tensors in by_copies.items():
        n = torch.nn.utils.get_total_norm(tensors, norm_type=norm_type, foreach=True).float()
        parts.append(n if inf else n.pow(norm_type) / copies)
    total = torch.stack(parts).max() if inf else torch.stack(parts).sum()
    if ws > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    if not inf:
        total = total.pow(1.0 / norm_type)
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef.to(grads[0].device))
    return total
