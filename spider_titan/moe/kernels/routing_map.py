"""Routing map kernels: (T, k) expert ids -> the expert-major row layout, without a host sync.

What it computes (the same map as ``torch_backend.build_routing_map``, bit for bit):
  counts[e]                 routed (token, slot) pairs per expert
  offs[e]                   end of expert e's segment, each segment padded to a multiple of ``align``
  token_slot_to_pos[t, j]   the row of slot j of token t; inside a segment rows follow token order
  pos_to_token[r]           the token of row r, -1 for padding (pre-filled by the caller)

Layout: slots are read token-major (n = t*k + j) in blocks of BLOCK slots. Three launches:
  1. ``_block_histogram_kernel`` (grid = blocks): per-block expert histogram via a (BLOCK, E)
     one-hot compare and column sum; no atomics, so no contention on hot experts.
  2. ``_segment_offsets_kernel`` (grid = 1): walks the blocks in order, turning the histograms into
     each block's running base per expert; then counts, padded segment ends (``tl.cumsum``) and
     starts. Its sequential loop has N / BLOCK steps, tiny next to the expert GEMMs.
  3. ``_scatter_positions_kernel`` (grid = blocks): a slot's rank among the earlier same-expert
     slots of its block is an exclusive ``tl.cumsum`` of the one-hot down the block; the position
     is segment start + block base + that rank. Ranks grow with n, hence the stable order.

Limits: E up to a few hundred (the one-hot tile is BLOCK x next_pow2(E)); rows are int32
(R < 2**31); ids are range-checked before launch (``base.check_topk_idx``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spider_titan.moe.base import RoutingMap, max_rows
from spider_titan.moe.kernels.launch import routing_map_blocks


@triton.jit(do_not_specialize=["N"])  # N and n_blocks change with the segment count
def _block_histogram_kernel(idx_ptr, hist_ptr, N, E, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    b = tl.program_id(0)
    slots = b * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    expert = tl.load(idx_ptr + slots, mask=slots < N, other=-1)  # (BLOCK,)
    experts = tl.arange(0, E_PAD)  # (E_PAD,)
    onehot = (expert[:, None] == experts[None, :]).to(tl.int32)  # (BLOCK, E_PAD)
    tl.store(hist_ptr + b * E + experts, tl.sum(onehot, 0), mask=experts < E)


@triton.jit(do_not_specialize=["n_blocks"])
def _segment_offsets_kernel(
    hist_ptr, block_base_ptr, counts_ptr, seg_start_ptr, offs_ptr, n_blocks, E, align, E_PAD: tl.constexpr
):
    experts = tl.arange(0, E_PAD)
    in_range = experts < E
    running = tl.zeros([E_PAD], dtype=tl.int32)  # slots of each expert in blocks before b
    for b in range(0, n_blocks):
        h = tl.load(hist_ptr + b * E + experts, mask=in_range, other=0)
        tl.store(block_base_ptr + b * E + experts, running, mask=in_range)
        running += h
    padded = (running + align - 1) // align * align  # (E_PAD,) zero beyond E
    seg_end = tl.cumsum(padded, 0)
    tl.store(counts_ptr + experts, running.to(tl.int64), mask=in_range)
    tl.store(seg_start_ptr + experts, seg_end - padded, mask=in_range)
    tl.store(offs_ptr + experts, seg_end, mask=in_range)


@triton.jit(do_not_specialize=["N"])
def _scatter_positions_kernel(
    idx_ptr,
    block_base_ptr,
    seg_start_ptr,
    slot_to_pos_ptr,
    pos_to_token_ptr,
    N,
    E,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    slots = b * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    valid = slots < N
    expert = tl.load(idx_ptr + slots, mask=valid, other=-1)  # (BLOCK,)
    experts = tl.arange(0, E_PAD)
    onehot = (expert[:, None] == experts[None, :]).to(tl.int32)  # (BLOCK, E_PAD)
    earlier = tl.cumsum(onehot, 0) - onehot  # same-expert slots before this one in the block
    rank = tl.sum(earlier * onehot, 1)  # (BLOCK,)
    safe = tl.where(valid, expert, 0)
    base = tl.load(seg_start_ptr + safe, mask=valid, other=0) + tl.load(
        block_base_ptr + b * E + safe, mask=valid, other=0
    )
    pos = base + rank  # (BLOCK,)
    tl.store(slot_to_pos_ptr + slots, pos.to(tl.int64), mask=valid)
    tl.store(pos_to_token_ptr + pos, (slots // K).to(tl.int64), mask=valid)


def build_routing_map(topk_idx: torch.Tensor, n_experts: int, align: int) -> RoutingMap:
    """Launch the three kernels on validated, contiguous int64 ``topk_idx (T, k)``."""
    T, k = topk_idx.shape
    N, E, device = T * k, n_experts, topk_idx.device
    BLOCK, E_PAD = routing_map_blocks(E)  # one-hot tile of at most 8192 int32
    n_blocks = max(1, triton.cdiv(N, BLOCK))

    hist = torch.empty(n_blocks, E, dtype=torch.int32, device=device)
    block_base = torch.empty_like(hist)
    seg_start = torch.empty(E, dtype=torch.int32, device=device)
    counts = torch.empty(E, dtype=torch.int64, device=device)
    offs = torch.empty(E, dtype=torch.int32, device=device)
    slot_to_pos = torch.empty(T, k, dtype=torch.int64, device=device)
    pos_to_token = torch.full((max_rows(T, k, E, align),), -1, dtype=torch.int64, device=device)

    _block_histogram_kernel[(n_blocks,)](topk_idx, hist, N, E, BLOCK=BLOCK, E_PAD=E_PAD)
    _segment_offsets_kernel[(1,)](hist, block_base, counts, seg_start, offs, n_blocks, E, align, E_PAD=E_PAD)
    _scatter_positions_kernel[(n_blocks,)](
        topk_idx, block_base, seg_start, slot_to_pos, pos_to_token, N, E, K=k, BLOCK=BLOCK, E_PAD=E_PAD
    )
    return RoutingMap(token_slot_to_pos=slot_to_pos, pos_to_token=pos_to_token, counts=counts, offs=offs)
