"""Reduce kernels: combine each token's k expert rows, and the gate-weight gradient.

What they compute, with pos = token_slot_to_pos (T, K):
  ``_reduce_kernel``       y[t] = sum_j w[t, j] * y_exp[pos[t, j]]   (the reduce forward)
                           y[t] = sum_j y_exp[pos[t, j]]             (HAS_WEIGHTS off: the expand
                                                                      backward, dx from dx_exp)
  ``_weight_grad_kernel``  dw[t, j] = <y_exp[pos[t, j]], dy[t]>      (the reduce backward to the router)

Layout: y_exp (R, D), y / dy (T, D), w / dw (T, K), all row-major contiguous. One program handles
BLOCK_T tokens (tile sizes: ``launch.py``); it walks D in BLOCK_D chunks and the K slots in a fixed
order, gathering rows, so the sum order is fixed: deterministic, no atomics. Rows are loaded in
their dtype (bf16 or fp32) and accumulated in fp32 (bf16 tl.sum is wrong under TRITON_INTERPRET=1,
and fp32 is the contract), then rounded to the output dtype with ``cast.round_to``.

Limits: K is a compile-time constant (top-k); offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spider_titan.moe.kernels.cast import round_to
from spider_titan.moe.kernels.launch import tile_config


@triton.jit(do_not_specialize=["T"])  # T changes with the segment count: one compile serves every T
def _reduce_kernel(
    y_exp_ptr,
    slot_to_pos_ptr,
    w_ptr,
    out_ptr,
    T,
    D,
    K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    tok_ok = toks < T
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = tok_ok[:, None] & (cols < D)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(K):
            pos = tl.load(slot_to_pos_ptr + toks * K + j, mask=tok_ok, other=0)  # (BLOCK_T,)
            v = tl.load(y_exp_ptr + pos[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                v = v * tl.load(w_ptr + toks * K + j, mask=tok_ok, other=0.0).to(tl.float32)[:, None]
            acc += v
        tl.store(out_ptr + toks[:, None] * D + cols[None, :], round_to(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _weight_grad_kernel(
    y_exp_ptr,
    dy_ptr,
    slot_to_pos_ptr,
    dw_ptr,
    T,
    D,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    tok_ok = toks < T
    for j in tl.static_range(K):
        pos = tl.load(slot_to_pos_ptr + toks * K + j, mask=tok_ok, other=0)  # (BLOCK_T,)
        acc = tl.zeros([BLOCK_T], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = tok_ok[:, None] & (cols < D)[None, :]
            v = tl.load(y_exp_ptr + pos[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.load(dy_ptr + toks[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum(v * g, 1)
        tl.store(dw_ptr + toks * K + j, round_to(acc, dw_ptr.dtype.element_ty), mask=tok_ok)


def reduce_rows(
    y_exp: torch.Tensor, token_slot_to_pos: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """y_exp (R, D) -> (T, D) in y_exp's dtype: the (weighted) fp32 sum of each token's k rows."""
    (T, K), D = token_slot_to_pos.shape, y_exp.shape[1]
    out = torch.empty(T, D, dtype=y_exp.dtype, device=y_exp.device)
    tile = tile_config("reduce", D)
    has_w = weights is not None
    _reduce_kernel[(triton.cdiv(T, tile.block_rows),)](
        y_exp,
        token_slot_to_pos,
        weights if has_w else y_exp,
        out,
        T,
        D,
        K=K,
        HAS_WEIGHTS=has_w,
        BLOCK_T=tile.block_rows,
        BLOCK_D=tile.block_d,
        num_warps=tile.num_warps,
    )
    return out


def weight_grad(
    y_exp: torch.Tensor, dy: torch.Tensor, token_slot_to_pos: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """dw (T, K) in ``dtype``: dw[t, j] = <y_exp[pos[t, j]], dy[t]>, summed in fp32."""
    (T, K), D = token_slot_to_pos.shape, y_exp.shape[1]
    dw = torch.empty(T, K, dtype=dtype, device=y_exp.device)
    tile = tile_config("weight_grad", D)
    _weight_grad_kernel[(triton.cdiv(T, tile.block_rows),)](
        y_exp,
        dy,
        token_slot_to_pos,
        dw,
        T,
        D,
        K=K,
        BLOCK_T=tile.block_rows,
        BLOCK_D=tile.block_d,
        num_warps=tile.num_warps,
    )
    return dw
