"""Expert parallel: each of ``ep`` ranks holds E/ep experts and computes them for the whole EP group.

Applied by :func:`apply_expert_parallel` to every ``MoE`` layer's ``GroupedExperts``: the grouped
weights ``w1, w3 (E, inter, dim)`` and ``w2 (E, dim, inter)`` become DTensors sharded on dim 0 over
the "ep" mesh (rank r keeps experts ``[r*E/ep, (r+1)*E/ep)``), and the experts' forward becomes
dispatch -> local grouped GEMM -> combine. Router, mapping, expand, reduce and the aux loss stay
local to each rank and untouched: the MoE layer hands the experts its usual expert-major buffer
``x_exp (R, dim)`` with ``offs (E,)``, and gets back ``(R, dim)`` in the same layout.

One layer call, E experts, El = E/ep local experts:

1. ``counts (E,)`` = rows per expert (from ``offs``, alignment padding included, so segments stay
   multiples of ``align`` on the receiving side); all-to-all of the counts gives
   ``recv (ep, El)``: rows each source rank sends for each of my experts.
2. The one host sync of the call: ``counts`` and ``recv`` cross to the host together, to size the
   token all-to-all (uneven splits). Steps 1-2 are recorded in forward and replayed by an
   activation-checkpoint recompute (moe/routing_replay.py): no second exchange, no second sync, and
   the recompute's all-to-alls have the forward's split sizes on every rank. Under torch.compile
   the read gives unbacked sizes: ``_check_splits`` states they are sizes that fit the buffer, which
   inductor needs to lower ``x_exp[:n_send]`` (without it: ``GuardOnDataDependentSymNode`` at step 1).
3. Differentiable all-to-all of the rows ``x_exp[:offs[-1]]`` (they are expert-major, so the rows
   for EP rank r are one contiguous block). What arrives is rank-major ``[source][expert]``;
   a gather reorders it expert-major ``[expert][source]`` (each expert's rows in source order).
4. ``GroupedExperts.swiglu`` on the local weight shards with ``offs_local (El,)``.
5. The inverse gather, the reverse all-to-all, and zero rows for the padding past ``offs[-1]``.

The all-to-all's backward is the all-to-all with the splits swapped, so each expert's weight
gradient sums the contributions of the tokens of all ``ep`` ranks: parallelize.py divides the
expert gradients by the data-parallel degree, not by the size of their FSDP mesh ("efsdp").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from spider_titan.moe.layer import GroupedExperts, MoE
from spider_titan.moe.routing_replay import replay_or_record
from spider_titan.parallel.comm_counter import CommCounter
from spider_titan.parallel.mesh import experts_split_problem


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows: ``x`` split by ``in_splits`` -> rows split by ``out_splits``."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, counter, tag):
        ctx.splits, ctx.group, ctx.counter, ctx.tag = (out_splits, in_splits), group, counter, tag
        return _all_to_all(x, out_splits, in_splits, group, counter, tag)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group, ctx.counter, ctx.tag), None, None, None, None, None


def _all_to_all(x, out_splits, in_splits, group, counter, tag) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    if counter is not None:
        counter.add("all_to_all", tag, x.numel() * x.element_size())
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    counter: CommCounter | None = None,
    tag: str = "",
) -> torch.Tensor:
    """Differentiable uneven all-to-all of the rows of ``x`` (split sizes are row counts)."""
    return _AllToAll.apply(x, out_splits, in_splits, group, counter, tag)


def expert_major_index(recv: torch.Tensor, total: int) -> torch.Tensor:
    """Rows that arrived rank-major ``[source][expert]`` -> the gather index for ``[expert][source]``.

    ``recv (ep, El)`` holds the row counts of each (source, expert) block and ``total`` their sum
    (known on the host, so ``repeat_interleave`` does not sync). ``x[index]`` is expert-major.
    """
    ep, n_local = recv.shape
    flat = recv.reshape(-1)
    block_start = (torch.cumsum(flat, 0) - flat).view(ep, n_local)  # start of block (s, e), rank-major
    counts_em = recv.t().reshape(-1)  # the blocks in expert-major order (e, s)
    starts_em = block_start.t().reshape(-1)
    first_row_em = torch.cumsum(counts_em, 0) - counts_em
    block = torch.repeat_interleave(torch.arange(ep * n_local, device=recv.device), counts_em, output_size=total)
    row = torch.arange(total, device=recv.device)
    return starts_em[block] + (row - first_row_em[block])


def _check_splits(send_splits: list[int], recv_splits: list[int], rows: int) -> None:
    """Facts about the split sizes that torch.compile cannot know (they come from the host read, so
    under compile they are unbacked symbols): non-negative, and what is sent fits in the buffer."""
    for s in (*send_splits, *recv_splits):
        torch._check_is_size(s)
    torch._check(sum(send_splits) <= rows)


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


class ExpertParallelExperts(GroupedExperts):
    """``GroupedExperts`` whose weights are dim-0 shards over the EP group (module docstring).

    Made by :func:`apply_expert_parallel` from an existing ``GroupedExperts`` (its class is
    swapped, as ``fully_shard`` does, so FQNs and the state dict keep their names).
    """

    ep_group: dist.ProcessGroup
    ep_size: int
    comm_counter: CommCounter | None
    comm_tag: str

    def forward(self, x_exp: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ep, group = self.ep_size, self.ep_group
        n_local = self.n_experts // ep
        # Recorded in forward, replayed by an activation-checkpoint recompute (routing_replay.py):
        # the recompute neither exchanges counts nor syncs, and sends exactly what the forward did.
        send_splits, recv_splits, recv = replay_or_record(lambda: self._exchange_counts(offs))
        n_send, n_recv = sum(send_splits), sum(recv_splits)
        _check_splits(send_splits, recv_splits, x_exp.shape[0])

        x_recv = all_to_all(x_exp[:n_send], recv_splits, send_splits, group, self.comm_counter, self.comm_tag)
        recv = recv.view(ep, n_local)
        index = expert_major_index(recv, n_recv)  # (n_recv,)
        offs_local = torch.cumsum(recv.sum(0), 0).to(torch.int32)  # (El,)
        y_local = self.swiglu(x_recv[index], offs_local, _local(self.w1), _local(self.w3), _local(self.w2))
        inverse = torch.empty_like(index)
        inverse[index] = torch.arange(n_recv, device=index.device)
        y = all_to_all(y_local[inverse], send_splits, recv_splits, group, self.comm_counter, self.comm_tag)
        return F.pad(y, (0, 0, 0, x_exp.shape[0] - n_send))  # padding rows come out zero

    def _exchange_counts(self, offs: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """Steps 1-2: (rows I send to each rank, rows I receive from each, recv (ep * El,))."""
        ep, n_local = self.ep_size, self.n_experts // self.ep_size
        counts = torch.diff(offs.long(), prepend=offs.new_zeros(1, dtype=torch.long))  # (E,)
        recv = torch.empty_like(counts)  # (ep * El,) [source][local expert]
        if self.comm_counter is not None:
            self.comm_counter.add("all_to_all", self.comm_tag, counts.numel() * counts.element_size())
        dist.all_to_all_single(recv, counts, group=self.ep_group)
        host = torch.cat([counts, recv]).tolist()  # the one host sync of the layer call
        send_splits = [sum(host[r * n_local : (r + 1) * n_local]) for r in range(ep)]
        recv_host = host[self.n_experts :]
        recv_splits = [sum(recv_host[s * n_local : (s + 1) * n_local]) for s in range(ep)]
        return send_splits, recv_splits, recv


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, *, counter: CommCounter | None = None) -> int:
    """Shard every MoE layer's experts over ``ep_mesh`` (in place); returns how many layers.

    The model must already hold its full, initialised weights (the builder materialises before
    parallelizing): each rank keeps its own slice of dim 0, with no communication.
    """
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    layers = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, MoE)]
    for fqn, moe in layers:
        experts = moe.experts
        problem = experts_split_problem(experts.n_experts, ep)
        if problem:
            raise ValueError(f"{fqn}: {problem}")
        for name in ("w1", "w3", "w2"):
            full = getattr(experts, name)
            local = full.detach().chunk(ep, dim=0)[rank].clone()
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(shard, requires_grad=full.requires_grad))
        experts.__class__ = ExpertParallelExperts
        experts.ep_group = ep_mesh.get_group()
        experts.ep_size = ep
        experts.comm_counter = counter
        experts.comm_tag = f"{fqn}.experts"
    return len(layers)
