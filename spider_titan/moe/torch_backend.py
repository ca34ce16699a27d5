"""The reference MoE backend in plain torch (``[moe] backend = "torch"``).

Readable first: every step is a few tensor ops, none of which waits on the host (no ``.item()``,
no boolean-mask indexing, no ``nonzero``), so it runs under CUDA graphs and ``torch.compile``.
The Triton backend must reproduce its routing map bit for bit.

Expand and reduce are autograd Functions with gather-based backward passes: every output row is
written by exactly one gather, never accumulated with ``index_add``/atomics, so results are
deterministic run to run.
"""

from __future__ import annotations

import torch

from spider_titan.moe.base import RoutingMap, check_expand, check_reduce, check_topk_idx, max_rows


def _histogram(flat_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(N,) expert ids -> (E,) int64 counts.

    ``torch.bincount`` would do, but on CUDA it reads the maximum back to the host to size its
    output; a scatter_add into a fixed (E,) buffer does not (integer adds are exact, so the
    atomics it uses on GPU stay deterministic).
    """
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat_idx.device)
    return counts.scatter_add_(0, flat_idx, torch.ones_like(flat_idx))


def build_routing_map(topk_idx: torch.Tensor, n_experts: int, align: int) -> RoutingMap:
    """The expert-major layout of ``topk_idx (T, k)``, see ``base.RoutingMap``."""
    topk_idx = check_topk_idx(topk_idx, n_experts, align)
    T, k = topk_idx.shape
    device = topk_idx.device
    R = max_rows(T, k, n_experts, align)
    flat = topk_idx.reshape(-1)  # (N,) slot n = t*k + j, token-major

    counts = _histogram(flat, n_experts)  # (E,)
    padded = (counts + align - 1) // align * align  # (E,) segment lengths
    seg_end = torch.cumsum(padded, 0)  # (E,) inclusive prefix sum
    seg_start = seg_end - padded  # (E,) exclusive prefix sum: first row of each segment
    count_start = torch.cumsum(counts, 0) - counts  # (E,) same, without padding

    # A stable sort keeps slots in token order within an expert; a slot's rank inside its expert
    # is its place in the sorted order minus the number of slots of earlier experts.
    order = torch.sort(flat, stable=True).indices  # (N,)
    sorted_expert = flat[order]  # (N,)
    rank = torch.arange(flat.numel(), device=device) - count_start[sorted_expert]  # (N,)
    pos_sorted = seg_start[sorted_expert] + rank  # (N,)

    slot_to_pos = torch.empty_like(flat).scatter_(0, order, pos_sorted)  # (N,)
    pos_to_token = torch.full((R,), -1, dtype=torch.int64, device=device)
    pos_to_token.scatter_(0, slot_to_pos, torch.arange(flat.numel(), device=device) // k)
    return RoutingMap(
        token_slot_to_pos=slot_to_pos.view(T, k),
        pos_to_token=pos_to_token,
        counts=counts,
        offs=seg_end.to(torch.int32),
    )


class _Expand(torch.autograd.Function):
    """x (T, d) -> x_exp (R, d): row r is x[pos_to_token[r]], or zero for a padding row.

    Backward is the unweighted reduce: dx[t] = sum_j dx_exp[token_slot_to_pos[t, j]] (fp32 sum).
    """

    @staticmethod
    def forward(ctx, x, pos_to_token, token_slot_to_pos):
        ctx.save_for_backward(token_slot_to_pos)
        T = x.shape[0]
        x_pad = torch.cat([x, x.new_zeros(1, x.shape[1])])  # (T+1, d), row T is the zero row
        return x_pad[torch.where(pos_to_token >= 0, pos_to_token, T)]  # (R, d)

    @staticmethod
    def backward(ctx, dx_exp):
        (token_slot_to_pos,) = ctx.saved_tensors
        dx = dx_exp[token_slot_to_pos].sum(1, dtype=torch.float32)  # (T, d)
        return dx.to(dx_exp.dtype), None, None


class _Reduce(torch.autograd.Function):
    """y_exp (R, d), weights (T, k) -> y (T, d) = sum_j w[t, j] * y_exp[pos[t, j]], summed in fp32.

    Backward: dy_exp[pos[t, j]] = w[t, j] * dy[t] (zero on padding rows) and
    dw[t, j] = <y_exp[pos[t, j]], dy[t]>, so the router learns from the combine.
    """

    @staticmethod
    def forward(ctx, y_exp, weights, token_slot_to_pos):
        ctx.save_for_backward(y_exp, weights, token_slot_to_pos)
        y_sel = y_exp[token_slot_to_pos].float()  # (T, k, d)
        return (y_sel * weights.float().unsqueeze(-1)).sum(1).to(y_exp.dtype)  # (T, d)

    @staticmethod
    def backward(ctx, dy):
        y_exp, weights, token_slot_to_pos = ctx.saved_tensors
        dy = dy.float()  # (T, d)
        dy_exp = dw = None
        if ctx.needs_input_grad[0]:
            rows = (weights.float().unsqueeze(-1) * dy.unsqueeze(1)).flatten(0, 1)  # (T*k, d)
            # Each buffer row belongs to at most one (token, slot): a plain store, no accumulation.
            dy_exp = y_exp.new_zeros(y_exp.shape)  # (R, d), padding rows stay zero
            dy_exp[token_slot_to_pos.reshape(-1)] = rows.to(y_exp.dtype)
        if ctx.needs_input_grad[1]:
            dw = (y_exp[token_slot_to_pos].float() * dy.unsqueeze(1)).sum(-1).to(weights.dtype)  # (T, k)
        return dy_exp, dw, None


class TorchMoEBackend:
    """Routing map, expand and reduce in plain torch: the reference the Triton backend must match."""

    name = "torch"

    @staticmethod
    def prepare(device: torch.device) -> None:
        """Process-wide set-up for a run on ``device`` (none needed)."""

    def build_map(self, topk_idx: torch.Tensor, n_experts: int, align: int) -> RoutingMap:
        with torch.no_grad():
            return build_routing_map(topk_idx, n_experts, align)

    def expand(self, x: torch.Tensor, rmap: RoutingMap) -> torch.Tensor:
        x = check_expand(x, rmap)
        return _Expand.apply(x, rmap.pos_to_token, rmap.token_slot_to_pos)

    def reduce(self, y_exp: torch.Tensor, weights: torch.Tensor, rmap: RoutingMap) -> torch.Tensor:
        y_exp, weights = check_reduce(y_exp, weights, rmap)
        return _Reduce.apply(y_exp, weights, rmap.token_slot_to_pos)
