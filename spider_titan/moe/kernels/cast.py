"""Exact fp32 -> output-dtype conversion shared by the MoE kernels.

What it computes: ``v.to(dtype)`` with round-to-nearest-even, as torch's ``.to(torch.bfloat16)``
does. For bf16 the rounding is spelled out in integer ops because Triton's CPU interpreter
truncates on ``.to(tl.bfloat16)`` (and its "rtne" mode rounds half up), which would make
interpreter results differ from torch's by one bf16 ulp. The integer version is exact on both the
GPU and the interpreter and costs a few ALU ops in these memory-bound kernels.

Layout: elementwise on any block. Limits: NaN inputs become the canonical bf16 NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """fp32 ``v`` -> ``dtype``, round-to-nearest-even."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # add half an ulp, ties to even
        high = tl.where(v != v, 0x7FC0, bits >> 16)
        return high.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)
