"""The Triton MoE backend (``[moe] backend = "triton"``): routing map, expand and reduce as kernels.

Same interface and, by construction, the same routing map as ``TorchMoEBackend`` (bit for bit);
expand and reduce are custom ops (``torch.library``, so torch.compile traces them with fullgraph)
whose backward passes are kernels too:
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
import logging
import os
from types import ModuleType

import torch

from spider_titan.moe.base import (
    RoutingMap,
    check_expand,
    check_reduce,
    check_topk_idx,
    max_rows,
    op_namespace,
)

logger = logging.getLogger("spider_titan")


@functools.cache
def _kernels() -> ModuleType:
    try:
        from spider_titan.moe import kernels
    except ImportError as e:
        raise ImportError(
            f"MoE backend 'triton' needs a working Triton install ({e}); "
            'install triton or set [moe] backend = "torch"'
        ) from e
    return kernels


def _check_device(t: torch.Tensor, interpreted: bool) -> None:
    if t.device.type == "cpu" and not interpreted:
        raise ValueError(
            "MoE backend 'triton' got CPU tensors but Triton's interpreter is off: set TRITON_INTERPRET=1 "
            'before triton is first imported, move the model to a GPU, or use [moe] backend = "torch"'
        )


# ---- the kernels as custom ops ------------------------------------------------------------------
# Each launch is a ``torch.library.custom_op`` with a fake (meta) implementation, and expand / reduce
# carry their backward with ``register_autograd``: torch.compile (fullgraph) then treats every
# kernel as one opaque op of known output shape instead of tracing into Triton's launcher, and
# AOTAutograd sees the backward as ops too. Shapes: T tokens, k slots, R = max_rows(...) buffer rows.
_NS = op_namespace(__name__)  # "spider_titan" (moe/base.py)


@torch.library.custom_op(f"{_NS}::moe_routing_map", mutates_args=())
def _routing_map_op(
    topk_idx: torch.Tensor, n_experts: int, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> token_slot_to_pos (T, k) int64, pos_to_token (R,) int64, counts (E,) int64, offs (E,) int32."""
    rmap = _kernels().build_routing_map(topk_idx, n_experts, align)
    return rmap.token_slot_to_pos, rmap.pos_to_token, rmap.counts, rmap.offs


@_routing_map_op.register_fake
def _(topk_idx, n_experts, align):
    T, k = topk_idx.shape
    new = topk_idx.new_empty
    return (
        new(T, k, dtype=torch.int64),
        new(max_rows(T, k, n_experts, align), dtype=torch.int64),
        new(n_experts, dtype=torch.int64),
        new(n_experts, dtype=torch.int32),
    )


@torch.library.custom_op(f"{_NS}::moe_expand_rows", mutates_args=())
def _expand_rows_op(
    x: torch.Tensor,
    pos_to_token: torch.Tensor,
    weights: torch.Tensor | None,
    token_slot_to_pos: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """x (T, D) -> (R, D), rows scaled by their gate weight when ``weights`` is given."""
    return _kernels().expand_rows(x, pos_to_token, weights, token_slot_to_pos, out_dtype=out_dtype)


@_expand_rows_op.register_fake
def _(x, pos_to_token, weights, token_slot_to_pos, out_dtype):
    return x.new_empty(pos_to_token.shape[0], x.shape[1], dtype=out_dtype or x.dtype)


@torch.library.custom_op(f"{_NS}::moe_reduce_rows", mutates_args=())
def _reduce_rows_op(y_exp: torch.Tensor, token_slot_to_pos: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """y_exp (R, D) -> (T, D): each token's k rows summed in fp32, weighted when ``weights`` is given."""
    return _kernels().reduce_rows(y_exp, token_slot_to_pos, weights)


@_reduce_rows_op.register_fake
def _(y_exp, token_slot_to_pos, weights):
    return y_exp.new_empty(token_slot_to_pos.shape[0], y_exp.shape[1])


@torch.library.custom_op(f"{_NS}::moe_weight_grad", mutates_args=())
def _weight_grad_op(
    y_exp: torch.Tensor, dy: torch.Tensor, token_slot_to_pos: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """dw (T, k): dw[t, j] = <y_exp[pos[t, j]], dy[t]>."""
    return _kernels().weight_grad(y_exp, dy, token_slot_to_pos, dtype)


@_weight_grad_op.register_fake
def _(y_exp, dy, token_slot_to_pos, dtype):
    return y_exp.new_empty(token_slot_to_pos.shape, dtype=dtype)


@torch.library.custom_op(f"{_NS}::triton_moe_expand", mutates_args=())
def _expand(x: torch.Tensor, pos_to_token: torch.Tensor, token_slot_to_pos: torch.Tensor) -> torch.Tensor:
    """Expand forward: gather rows; backward is the unweighted reduce (dx[t] = sum_j dx_exp[pos[t, j]])."""
    return _kernels().expand_rows(x, pos_to_token)  # (R, d)


@_expand.register_fake
def _(x, pos_to_token, token_slot_to_pos):
    return x.new_empty(pos_to_token.shape[0], x.shape[1])


def _expand_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])


def _expand_backward(ctx, dx_exp):
    (token_slot_to_pos,) = ctx.saved_tensors
    return _reduce_rows_op(dx_exp.contiguous(), token_slot_to_pos, None), None, None


_expand.register_autograd(_expand_backward, setup_context=_expand_setup)


@torch.library.custom_op(f"{_NS}::triton_moe_reduce", mutates_args=())
def _reduce(
    y_exp: torch.Tensor, weights: torch.Tensor, token_slot_to_pos: torch.Tensor, pos_to_token: torch.Tensor
) -> torch.Tensor:
    """Reduce forward: weighted fp32 combine; backward: dy_exp[pos] = w * dy and dw = <y_exp[pos], dy>."""
    return _kernels().reduce_rows(y_exp, token_slot_to_pos, weights)  # (T, d)


@_reduce.register_fake
def _(y_exp, weights, token_slot_to_pos, pos_to_token):
    return y_exp.new_empty(token_slot_to_pos.shape[0], y_exp.shape[1])


def _reduce_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _reduce_backward(ctx, dy):
    y_exp, weights, token_slot_to_pos, pos_to_token = ctx.saved_tensors
    dy = dy.contiguous()  # out.sum().backward() hands in a stride-0 gradient
    dy_exp = dw = None
    if ctx.needs_input_grad[0]:
        dy_exp = _expand_rows_op(dy, pos_to_token, weights, token_slot_to_pos, y_exp.dtype)
    if ctx.needs_input_grad[1]:
        dw = _weight_grad_op(y_exp, dy, token_slot_to_pos, weights.dtype)
    return dy_exp, dw, None, None


_reduce.register_autograd(_reduce_backward, setup_context=_reduce_setup)


class TritonMoEBackend:
    """Routing map, expand and reduce as Triton kernels (GPU, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"

    @staticmethod
    def prepare(device: torch.device) -> None:
        """Process-wide set-up before a run on ``device`` builds the backend: on CPU switch on
        Triton's interpreter, which Triton reads when the kernels are first defined."""
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            os.environ["TRITON_INTERPRET"] = "1"
            logger.info("MoE backend 'triton' on CPU: running its kernels in Triton's interpreter (correct, slow)")

    def __init__(self) -> None:
        self.interpreted = _kernels().INTERPRETED  # read once: torch.compile need not trace the cache

    def build_map(self, topk_idx: torch.Tensor, n_experts: int, align: int) -> RoutingMap:
        topk_idx = check_topk_idx(topk_idx, n_experts, align)
        _check_device(topk_idx, self.interpreted)
        token_slot_to_pos, pos_to_token, counts, offs = _routing_map_op(topk_idx, n_experts, align)
        return RoutingMap(token_slot_to_pos=token_slot_to_pos, pos_to_token=pos_to_token, counts=counts, offs=offs)

    def expand(self, x: torch.Tensor, rmap: RoutingMap) -> torch.Tensor:
        x = check_expand(x, rmap)
        _check_device(x, self.interpreted)
        return _expand(x, rmap.pos_to_token, rmap.token_slot_to_pos)

    def reduce(self, y_exp: torch.Tensor, weights: torch.Tensor, rmap: RoutingMap) -> torch.Tensor:
        y_exp, weights = check_reduce(y_exp, weights, rmap)
        _check_device(y_exp, self.interpreted)
        return _reduce(y_exp, weights, rmap.token_slot_to_pos, rmap.pos_to_token)
