"""The interface every MoE backend implements (see docs/moe.md).

One MoE layer sees T local tokens, E experts and top-k routing. The router (plain torch) picks
``topk_idx (T, k)`` and gate ``weights (T, k)``. A backend then provides the three steps between
the router and the experts' grouped GEMM, and back:

1. ``build_map``  (no gradient): the expert-major layout. Each (token, slot) pair gets a row in a
   buffer of ``R = T*k + E*(align-1)`` rows, rounded up to a multiple of ``align`` (a static upper
   bound, so nothing waits on the host; the rounding keeps the buffer's transposed stride aligned,
   which the fp8 grouped GEMM's weight-gradient needs);
   expert e's rows are contiguous, in token order (stable), and each expert's segment is padded
   up to a multiple of ``align``. Rows past the last used one are padding too.
2. ``expand``     (autograd): gather x's rows into that buffer; padding rows are zero.
3. ``reduce``     (autograd): per token, the fp32 sum over its k rows weighted by the gate weights;
   its backward gives the gradient to the expert outputs and to the gate weights.

and, on the class, ``prepare(device)``: process-wide set-up that must happen before the first
backend is built (the builder calls it once per run; Triton's CPU interpreter is switched on there).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch


def op_namespace(module_name: str) -> str:
    """The ``torch.library`` namespace of the custom ops that module ``module_name`` defines.

    ``spider_titan`` for this package's own modules. A copy of the module imported under another
    name (the sources an export bundles for transformers, hf/bundle.py) gets a namespace of its own,
    made from its package's name: defining an op name a second time frees the first definition
    (``torch.library.custom_op`` allows overwriting), and this package's functions would then call
    a freed op (seen as "Tried to access the schema for  which doesn't have a schema registered").
    """
    if module_name.startswith("spider_titan."):
        return "spider_titan"
    return "spider_titan_" + re.sub(r"\W", "_", module_name.rpartition(".")[0])


@dataclass
class RoutingMap:
    """The expert-major layout of one MoE call.

    token_slot_to_pos: (T, k) int64, the buffer row of each (token, slot)
    pos_to_token:      (R,) int64, the token of each buffer row, -1 for padding rows
    counts:            (E,) int64, routed (token, slot) pairs per expert, without padding
    offs:              (E,) int32, cumulative END of each expert's padded segment (for _grouped_mm)
    """

    token_slot_to_pos: torch.Tensor
    pos_to_token: torch.Tensor
    counts: torch.Tensor
    offs: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.pos_to_token.shape[0]


class MoEBackend(Protocol):
    """Routing-map / expand / reduce provider for a MoE layer (the registry's ``moe_backend`` kind)."""

    name: str

    @staticmethod
    def prepare(device: torch.device) -> None:
        """Process-wide set-up for a run on ``device``, before the first backend is built."""
        ...

    def build_map(self, topk_idx: torch.Tensor, n_experts: int, align: int) -> RoutingMap: ...

    def expand(self, x: torch.Tensor, rmap: RoutingMap) -> torch.Tensor: ...

    def reduce(self, y_exp: torch.Tensor, weights: torch.Tensor, rmap: RoutingMap) -> torch.Tensor: ...


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's when autocast is on for ``t``'s device, else ``t``'s.

    Autocast has no rule for ``torch._grouped_mm`` and RMSNorm returns fp32 under it, so without
    this cast the experts would get fp32 tokens, and on CUDA torch's non-bf16 grouped GEMM falls
    back to a loop over experts that waits on the host.
    """
    device_type = t.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


def max_rows(num_tokens: int, top_k: int, n_experts: int, align: int) -> int:
    """Static upper bound on the expert-major buffer's rows, a multiple of ``align``: torchao's fp8
    grouped GEMM computes the weight gradient from the transposed buffer, whose row stride (R bytes
    in fp8) must be a multiple of 16 (seen on an H100 with the debug model: T*k + E*15 was not)."""
    bound = num_tokens * top_k + n_experts * (align - 1)
    return -(-bound // align) * align


def check_topk_idx(topk_idx: torch.Tensor, n_experts: int, align: int) -> torch.Tensor:
    """Validate ``build_map``'s inputs; return ``topk_idx`` as contiguous int64 ``(T, k)``.

    The range check reads the values, which on an accelerator would wait on the host (and under
    torch.compile would break the graph), so there it is a device-side assert
    (``torch._assert_async``) instead of a ValueError.
    """
    if n_experts < 1 or align < 1:
        raise ValueError(f"MoE map: n_experts ({n_experts}) and align ({align}) must be >= 1")
    if topk_idx.dim() != 2 or topk_idx.is_floating_point() or topk_idx.is_complex():
        raise ValueError(
            f"MoE map: topk_idx must be an integer (T, k) tensor, got {tuple(topk_idx.shape)} {topk_idx.dtype}"
        )
    topk_idx = topk_idx.long().contiguous()
    if topk_idx.numel() == 0:
        return topk_idx
    in_range = (topk_idx.min() >= 0) & (topk_idx.max() < n_experts)
    if topk_idx.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(in_range):
            raise ValueError(
                f"MoE map: topk_idx values must lie in [0, {n_experts}), got "
                f"[{int(topk_idx.min())}, {int(topk_idx.max())}]"
            )
    else:
        torch._assert_async(in_range, f"MoE map: topk_idx values must lie in [0, {n_experts})")
    return topk_idx


def check_expand(x: torch.Tensor, rmap: RoutingMap) -> torch.Tensor:
    """Validate ``expand``'s inputs; return ``x`` contiguous."""
    T = rmap.token_slot_to_pos.shape[0]
    if x.dim() != 2 or x.shape[0] != T or not x.is_floating_point():
        raise ValueError(f"MoE expand: x must be a floating (T={T}, dim) tensor, got {tuple(x.shape)} {x.dtype}")
    if x.device != rmap.pos_to_token.device:
        raise ValueError(f"MoE expand: x is on {x.device} but the routing map on {rmap.pos_to_token.device}")
    return x.contiguous()


def check_reduce(y_exp: torch.Tensor, weights: torch.Tensor, rmap: RoutingMap) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``reduce``'s inputs; return ``(y_exp, weights)`` contiguous.

    ``weights`` must have y_exp's dtype or be fp32 (the router's precision; the sum is fp32 anyway).
    """
    R, (T, k) = rmap.num_rows, rmap.token_slot_to_pos.shape
    if y_exp.dim() != 2 or y_exp.shape[0] != R or not y_exp.is_floating_point():
        raise ValueError(
            f"MoE reduce: y_exp must be a floating (R={R}, dim) tensor, got {tuple(y_exp.shape)} {y_exp.dtype}"
        )
    if weights.shape != (T, k):
        raise ValueError(f"MoE reduce: weights must be (T={T}, k={k}), got {tuple(weights.shape)}")
    if weights.dtype not in (y_exp.dtype, torch.float32):
        raise ValueError(f"MoE reduce: weights dtype {weights.dtype} must be y_exp's ({y_exp.dtype}) or torch.float32")
    if not (y_exp.device == weights.device == rmap.pos_to_token.device):
        raise ValueError(
            f"MoE reduce: y_exp ({y_exp.device}), weights ({weights.device}) and the routing map "
            f"({rmap.pos_to_token.device}) must be on one device"
        )
    return y_exp.contiguous(), weights.contiguous()
