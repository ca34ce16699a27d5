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

Fixed-capacity dispatch (``parallelism.expert_parallel_dispatch = "capacity"``, training only):
every rank sends every expert exactly C rows, C = ``expert_capacity_factor`` x the balanced share
``expert_capacity_tokens x top_k / E``, rounded up to a multiple of 16 (:func:`capacity_rows`). C
comes from the config, not from the batch: a rank's token count changes with its segmentation, and
every rank must know what every other sends. The split sizes are then known before the call: no
count exchange, no host read, one equal-split all-to-all each way (GShard / Switch). An expert's rows past C are dropped: they come back zero, so
that (token, slot) pair adds nothing and the token keeps its residual path. Real tokens fill an
expert's slots first, then padding tokens (the MoE layer hands the experts ``row_real``), each in
buffer order, so a short row's padding never crowds out another row's real segment. Slots not filled are
zero rows, which the experts map to zero (SwiGLU without biases) and which add nothing to the
weight gradients. The dropped (token, slot) pairs are counted on the device and logged as
``moe_dropped_frac`` (a post-step hook, parallelize.py). Evaluation always uses the dynamic path, so
validation is never scored on dropped tokens. The price: C·E rows cross the network each way
instead of the R actually routed (factor 1.25: ~25 % more bytes when balanced), the experts
compute on the empty slots, and under imbalance the dropped pairs (docs/benchmarks.md).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from spider_titan.moe.layer import GroupedExperts, MoE
from spider_titan.moe.routing_replay import is_recomputing, replay_or_record
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
        torch._check(s >= 0)
    torch._check(sum(send_splits) <= rows)


CAPACITY_ALIGN = 16  # rows; keeps every local expert's group 16-aligned (fp8 grouped GEMM, GEMM tiles)


def capacity_rows(factor: float, tokens: int, top_k: int, n_experts: int) -> int:
    """C: ``factor`` x the balanced share ``tokens * top_k / n_experts``, rounded up to a multiple of
    :data:`CAPACITY_ALIGN` (module docstring)."""
    share = math.ceil(factor * tokens * top_k / n_experts)
    return max(CAPACITY_ALIGN, -(-share // CAPACITY_ALIGN) * CAPACITY_ALIGN)


def capacity_layout(
    offs: torch.Tensor, capacity: int, rows: int, row_real: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed-capacity layout of one MoE call's expert-major buffer, on the device (no host read).

    ``offs (E,)``: cumulative ends of the experts' row segments in the ``rows``-row buffer;
    ``row_real (rows,)`` bool (None: all real): an expert's slots go to its real-token rows first, in
    buffer order, then to the rest (padding tokens), so padding never crowds out a real token.
    Returns ``send (E * capacity,)``: the buffer row that fills each (expert, slot), ``rows`` for an
    empty slot (a zero row appended to the buffer); and ``back (rows,)``: the (expert, slot) each
    buffer row's output comes from, ``E * capacity`` (a zero row) for a dropped or padding row.
    """
    E = offs.shape[0]
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    starts = ends - counts
    row = torch.arange(rows, device=offs.device)
    expert = torch.searchsorted(ends, row, right=True).clamp(max=E - 1)  # segment of each row
    if row_real is None:
        order = row  # the buffer order already
    else:  # stable: within an expert, real rows first, each group in buffer order
        key = torch.where(row < ends[-1], expert * 2 + (~row_real).long(), 2 * E)
        order = torch.sort(key, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = row  # each row's place in its expert's priority order (segment starts unchanged)
    slot = torch.arange(capacity, device=offs.device)
    filled = slot < counts.unsqueeze(1)  # (E, C)
    send = torch.where(filled, order[(starts.unsqueeze(1) + slot).clamp(max=rows - 1)], rows).reshape(-1)
    pos = rank - starts[expert]
    kept = (row < ends[-1]) & (pos < capacity)
    back = torch.where(kept, expert * capacity + pos, E * capacity)
    return send, back


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
    dispatch: str  # "dynamic" | "capacity"
    capacity: int  # C, rows this rank sends each expert per call (capacity dispatch)
    dropped_pairs: torch.Tensor  # () fp32, this step's dropped (token, slot) pairs (capacity dispatch)
    routed_pairs: torch.Tensor  # () fp32, this step's routed pairs

    def forward(
        self, x_exp: torch.Tensor, offs: torch.Tensor, row_real: torch.Tensor | None = None, filled: bool = False
    ) -> torch.Tensor:
        """``filled`` (the local layout's): not read, the exchanged rows are laid out anew."""
        if self.dispatch == "capacity" and self.training:
            return self._forward_capacity(x_exp, offs, row_real)
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

    def _forward_capacity(self, x_exp: torch.Tensor, offs: torch.Tensor, row_real: torch.Tensor | None) -> torch.Tensor:
        """Fixed-capacity dispatch (module docstring): static splits, no host read."""
        ep, group = self.ep_size, self.ep_group
        E, rows, dim = self.n_experts, x_exp.shape[0], x_exp.shape[1]
        n_local, C = E // ep, self.capacity
        send, back = capacity_layout(offs, C, rows, row_real)
        splits = [n_local * C] * ep  # rank-major: expert e's C slots go to rank e // n_local
        x_send = F.pad(x_exp, (0, 0, 0, 1))[send]  # (E*C, dim), empty slots zero
        x_recv = all_to_all(x_send, splits, splits, group, self.comm_counter, self.comm_tag)  # [source][expert][slot]
        x_local = x_recv.view(ep, n_local, C, dim).transpose(0, 1).reshape(n_local * ep * C, dim)  # expert-major
        offs_local = torch.arange(1, n_local + 1, device=x_exp.device, dtype=torch.int32) * (ep * C)
        y_local = self.swiglu(x_local, offs_local, _local(self.w1), _local(self.w3), _local(self.w2))
        y_back = y_local.view(n_local, ep, C, dim).transpose(0, 1).reshape(ep * n_local * C, dim)
        y = all_to_all(y_back, splits, splits, group, self.comm_counter, self.comm_tag)  # (E*C, dim), mine again
        if not is_recomputing():  # an activation-checkpoint recompute routes the same pairs again
            ends = offs.long()
            real = torch.ones(rows, device=x_exp.device) if row_real is None else row_real.float()
            seg = torch.searchsorted(ends, torch.arange(rows, device=ends.device), right=True)  # E: past the end
            per_expert = real.new_zeros(E + 1).scatter_add_(0, seg, real)[:E]  # real pairs per expert
            self.dropped_pairs += (per_expert - C).clamp(min=0).sum()
            self.routed_pairs += per_expert.sum()
        return F.pad(y, (0, 0, 0, 1))[back]  # dropped and padding rows come out zero

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


def apply_expert_parallel(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    *,
    counter: CommCounter | None = None,
    dispatch: str = "dynamic",
    capacity_factor: float = 1.25,
    capacity_tokens: int = 0,
) -> int:
    """Shard every MoE layer's experts over ``ep_mesh`` (in place); returns how many layers.

    The model must already hold its full, initialised weights (the builder materialises before
    parallelizing): each rank keeps its own slice of dim 0, with no communication. ``dispatch``:
    ``dynamic`` (exact splits, one host read per call) or ``capacity`` (module docstring; C from
    ``capacity_factor`` and ``capacity_tokens``, the tokens of one call).
    """
    if dispatch == "capacity" and capacity_tokens < 1:
        raise ValueError("expert parallel: capacity dispatch needs capacity_tokens >= 1 (tokens of one MoE call)")
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
        experts.dispatch = dispatch
        experts.capacity = capacity_rows(capacity_factor, capacity_tokens, moe.top_k, experts.n_experts)
        for name in ("dropped_pairs", "routed_pairs"):
            experts.register_buffer(name, torch.zeros((), device=experts.w1.device), persistent=False)
    return len(layers)


def dropped_pairs_report(model: nn.Module):
    """The post-step hook of capacity dispatch: the step's fraction of dropped (token, slot) pairs
    over every expert-parallel layer (device scalars; the counters restart for the next step)."""
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]

    def report() -> dict[str, torch.Tensor]:
        dropped = torch.stack([m.dropped_pairs for m in layers]).sum()
        routed = torch.stack([m.routed_pairs for m in layers]).sum()
        for m in layers:
            m.dropped_pairs.zero_()
            m.routed_pairs.zero_()
        return {"moe_dropped_frac": dropped / routed.clamp(min=1.0)}

    return report
