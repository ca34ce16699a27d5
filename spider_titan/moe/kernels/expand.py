"""Expand kernel: gather token rows into the expert-major buffer, optionally scaled per row.

What it computes, for every buffer row r with t = pos_to_token[r]:
  out[r] = x[t]                (the expand forward)
  out[r] = w[t, j] * x[t]      (HAS_WEIGHTS: the reduce backward, dy_exp[r] = w * dy[t]),
                               where j is the slot with token_slot_to_pos[t, j] == r
  out[r] = 0                   for padding rows (t == -1)
Every row is written exactly once by a gather, so no zero-fill and no atomics are needed.

Layout: x (T, D) and out (R, D) row-major contiguous; w (T, K) and token_slot_to_pos (T, K).
One program handles BLOCK_R rows and walks D in BLOCK_D chunks (tile sizes: ``launch.py``). Values
are loaded in their own dtype (bf16 or fp32), scaled in fp32 and rounded to out's dtype
(``cast.round_to``); no tl.dot or bf16 arithmetic, so the kernel is exact under TRITON_INTERPRET=1 too.

Limits: offsets are int64 (no overflow for large R * D); K is a compile-time constant (top-k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spider_titan.moe.kernels.cast import round_to
from spider_titan.moe.kernels.launch import tile_config


@triton.jit(do_not_specialize=["R"])  # R changes with the segment count: one compile serves every R
def _expand_kernel(
    x_ptr,
    pos_to_token_ptr,
    w_ptr,
    slot_to_pos_ptr,
    out_ptr,
    R,
    D,
    K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    row_ok = rows < R
    tok = tl.load(pos_to_token_ptr + rows, mask=row_ok, other=-1)  # (BLOCK_R,) int64
    real = tok >= 0
    if HAS_WEIGHTS:
        scale = tl.zeros([BLOCK_R], dtype=tl.float32)
        for j in tl.static_range(K):
            pos_j = tl.load(slot_to_pos_ptr + tok * K + j, mask=real, other=-1)
            w_j = tl.load(w_ptr + tok * K + j, mask=real, other=0.0).to(tl.float32)
            scale = tl.where(pos_j == rows, w_j, scale)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
        col_ok = cols < D
        v = tl.load(x_ptr + tok[:, None] * D + cols[None, :], mask=real[:, None] & col_ok[None, :], other=0.0)
        if HAS_WEIGHTS:
            v = round_to(v.to(tl.float32) * scale[:, None], out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * D + cols[None, :], v, mask=row_ok[:, None] & col_ok[None, :])


def expand_rows(
    x: torch.Tensor,
    pos_to_token: torch.Tensor,
    weights: torch.Tensor | None = None,
    token_slot_to_pos: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x (T, D) -> (R, D) in ``out_dtype`` (default x's); rows scaled by their gate weight if given."""
    R, D = pos_to_token.shape[0], x.shape[1]
    out = torch.empty(R, D, dtype=out_dtype or x.dtype, device=x.device)
    has_w = weights is not None
    K = weights.shape[1] if has_w else 1
    tile = tile_config("expand", D)
    _expand_kernel[(triton.cdiv(R, tile.block_rows),)](
        x,
        pos_to_token,
        weights if has_w else x,
        token_slot_to_pos if has_w else pos_to_token,
        out,
        R,
        D,
        K=K,
        HAS_WEIGHTS=has_w,
        BLOCK_R=tile.block_rows,
        BLOCK_D=tile.block_d,
        num_warps=tile.num_warps,
    )
    return out
