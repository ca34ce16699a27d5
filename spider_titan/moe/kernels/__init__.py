"""Triton kernels of the MoE ``triton`` backend (imported only when that backend is built).

``routing_map``: counts, padded segment offsets and the stable expert-major scatter.
``expand``:      gather token rows into the buffer (and, weighted, the reduce backward).
``reduce``:      weighted fp32 combine per token (and, unweighted, the expand backward); dw.
``cast``:        fp32 -> bf16 round-to-nearest-even that the interpreter gets right too.

``INTERPRETED`` tells whether Triton's CPU interpreter runs them (TRITON_INTERPRET=1 was set before
this package was imported); otherwise they compile for the GPU and need device tensors.
"""

from triton.runtime.interpreter import InterpretedFunction

from spider_titan.moe.kernels.expand import _expand_kernel, expand_rows
from spider_titan.moe.kernels.reduce import reduce_rows, weight_grad
from spider_titan.moe.kernels.routing_map import build_routing_map

INTERPRETED = isinstance(_expand_kernel, InterpretedFunction)

__all__ = ["INTERPRETED", "build_routing_map", "expand_rows", "reduce_rows", "weight_grad"]
