"""The seed trainer's MoE experts: a Python loop over experts (benchmark baseline, second reference).

Each expert picks its tokens with ``nonzero`` (a host sync per expert), runs SwiGLU with plain
matmuls and adds its weighted output back with ``index_add``. Simple and obviously right, but it
launches O(E) small kernels, waits on the host E times and is not deterministic on GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from spider_titan.moe.base import compute_dtype


def python_loop_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor | Sequence[torch.Tensor],
    w3: torch.Tensor | Sequence[torch.Tensor],
    w2: torch.Tensor | Sequence[torch.Tensor],
) -> torch.Tensor:
    """y[t] = sum_j weights[t, j] * SwiGLU_{topk_idx[t, j]}(x[t]), differentiable in every float input.

    x (T, dim), topk_idx (T, k) int, weights (T, k), w1/w3 (E, inter, dim), w2 (E, dim, inter)
    -> y (T, dim) in x's dtype. The weights may also be sequences of E per-expert matrices, the
    layout of a seed-style ModuleList of experts (no slicing of a 3-D tensor in backward).
    The experts compute in ``base.compute_dtype`` (autocast's when it is on), like the grouped path.
    """
    dtype = compute_dtype(x)
    y = torch.zeros_like(x)
    for e in range(len(w1)):
        tok, slot = (topk_idx == e).nonzero(as_tuple=True)  # (n_e,), (n_e,)
        if tok.numel() == 0:
            continue
        xe = x.index_select(0, tok).to(dtype)  # (n_e, dim)
        ye = (F.silu(xe @ w1[e].to(dtype).T) * (xe @ w3[e].to(dtype).T)) @ w2[e].to(dtype).T  # (n_e, dim)
        y = y.index_add(0, tok, ye * weights[tok, slot].unsqueeze(-1).to(x.dtype))
    return y
