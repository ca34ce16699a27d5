"""The few collectives everyone shares: sums over ranks (plain and differentiable), a gather, the world size and
the gradient-norm clip across meshes; the process group's start under torchrun and the collectives' timeout.
No-ops in a single process; below models, MoE and parallel code in the layering (docs/architecture.md), so
any of them may use these."""

from __future__ import annotations

import math
import os
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor


def init_process_group(backend: str, *, timeout_s: float) -> None:
    """Join the job's default process group, its collectives bounded by ``timeout_s`` seconds.

    Under torchrun the workers' store is, by default, the TCP store of torchrun's own rendezvous,
    shared by every restart of the job (``TORCHELASTIC_USE_AGENT_STORE=True``). A restarted worker then
    meets the keys the workers before it wrote there and hangs or fails to connect in gloo's
    ``connectFullMesh`` (pytorch/pytorch#135712, #167288). scripts/run_train.sh sets
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (each restart gets a fresh store); for a bare ``torchrun``
    the group's keys live under a prefix of their own per start: each global rank counts its starts in
    the shared store (an atomic add), and every restart starts every rank once, so the counts agree on
    every node. ``TORCHELASTIC_RESTART_COUNT`` cannot serve: it counts per node (pytorch/pytorch#108158)."""
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shared = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False, timeout=timeout
    )
    start = shared.add(f"spider_titan/starts/rank{rank}", 1)
    store = dist.PrefixStore(f"spider_titan/start{start}/", shared)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)


def set_collective_timeout(seconds: float) -> None:
    """Every process group's collectives now give up after ``seconds`` (a rank that died, hangs or is
    stopped: the others raise instead of waiting out the library's 10 or 30 minutes, or for ever).
    Groups made later start with torch's default; call again after making one."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    timeout = timedelta(seconds=seconds)
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


# How gloo and NCCL word a collective whose peer is gone or silent (RuntimeError or torch's DistError).
_TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")
_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused", "aborted")
_BACKENDS = ("gloo", "NCCL", "nccl", "c10d", "ProcessGroup")


def collective_failure(e: BaseException) -> str | None:
    """``timeout`` (another rank did not answer in time), ``lost`` (its connection closed) or None
    (``e`` is not a collective's failure)."""
    if not isinstance(e, RuntimeError):
        return None
    text = str(e)
    if not (isinstance(e, dist.DistError) or any(b in text for b in _BACKENDS)):
        return None
    if any(t in text for t in _TIMED_OUT):
        return "timeout"
    if isinstance(e, dist.DistError) or any(t in text for t in _LOST):
        return "lost"
    return None


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
