"""The Triton MoE backend (``[moe] backend = "triton"``): routing map, expand and reduce as kernels.

Same interface and, by construction, the same routing map as ``TorchMoEBackend`` (bit for bit);
expand and reduce are autograd Functions whose backward passes are kernels too:
  expand:  forward gathers rows; backward is the unweighted reduce (dx[t] = sum_j dx_exp[pos[t, j]]).
  reduce:  forward is the weighted fp32 combine; backward is the weighted expand
           (dy_exp[pos] = w * dy) plus the gate-weight gradient dw[t, j] = <y_exp[pos], dy[t]>.
All gathers, no atomics: deterministic. The kernels live in ``moe/kernels/``.

Triton is imported when the backend is constructed, not when this module is, so a machine without
a working Triton fails with a clear message only if it asks for this backend. On CPU the kernels
run in Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``) before the kernels
are first imported.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from spider_titan.moe.base import RoutingMap, check_expand, check_reduce, check_topk_idx


@functools.cache
def _kernels() -> ModuleType:
    try:
        from spider_titan.moe import kernels
    except ImportError as e:
        raise ImportError(
            f"MoE backend 'triton' needs a working Triton install ({e}); "
            "install triton or set [moe] backend = \"torch\""
        ) from e
    return kernels


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not _kernels().INTERPRETED:
        raise ValueError(
            "MoE backend 'triton' got CPU tensors but Triton's interpreter is off: set TRITON_INTERPRET=1 "
            "before triton is first imported, move the model to a GPU, or use [moe] backend = \"torch\""
        )


class _TritonExpand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pos_to_token, token_slot_to_pos):
        ctx.save_for_backward(token_slot_to_pos)
        return _kernels().expand_rows(x, pos_to_token)  # (R, d)

    @staticmethod
    def backward(ctx, dx_exp):
        (token_slot_to_pos,) = ctx.saved_tensors
        return _kernels().reduce_rows(dx_exp.contiguous(), token_slot_to_pos), None, None


class _TritonReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_exp, weights, token_slot_to_pos, pos_to_token):
        ctx.save_for_backward(y_exp, weights, token_slot_to_pos, pos_to_token)
        return _kernels().reduce_rows(y_exp, token_slot_to_pos, weights)  # (T, d)

    @staticmethod
    def backward(ctx, dy):
        y_exp, weights, token_slot_to_pos, pos_to_token = ctx.saved_tensors
        dy = dy.contiguous()  # out.sum().backward() hands in a stride-0 gradient
        dy_exp = dw = None
        if ctx.needs_input_grad[0]:
            dy_exp = _kernels().expand_rows(dy, pos_to_token, weights, token_slot_to_pos, out_dtype=y_exp.dtype)
        if ctx.needs_input_grad[1]:
            dw = _kernels().weight_grad(y_exp, dy, token_slot_to_pos, weights.dtype)
        return dy_exp, dw, None, None


class TritonMoEBackend:
    """Routing map, expand and reduce as Triton kernels (GPU, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self) -> None:
        _kernels()

    def build_map(self, topk_idx: torch.Tensor, n_experts: int, align: int) -> RoutingMap:
        topk_idx = check_topk_idx(topk_idx, n_experts, align)
        _check_device(topk_idx)
        return _kernels().build_routing_map(topk_idx, n_experts, align)

    def expand(self, x: torch.Tensor, rmap: RoutingMap) -> torch.Tensor:
        x = check_expand(x, rmap)
        _check_device(x)
        return _TritonExpand.apply(x, rmap.pos_to_token, rmap.token_slot_to_pos)

    def reduce(self, y_exp: torch.Tensor, weights: torch.Tensor, rmap: RoutingMap) -> torch.Tensor:
        y_exp, weights = check_reduce(y_exp, weights, rmap)
        _check_device(y_exp)
        return _TritonReduce.apply(y_exp, weights, rmap.token_slot_to_pos, rmap.pos_to_token)
