"""``torch.compile`` per block (after activation checkpointing, before FSDP), like torchtitan.

Compiling block by block keeps compile time proportional to one block (blocks of a container
share code, so Dynamo reuses the graph) and lets FSDP's hooks stay outside the compiled regions.
``nn.Module.compile`` compiles in place, so parameter names (and checkpoints) are unchanged.

``fullgraph=True``: a graph break inside a block is an error, not a silent fall back to eager
for part of it. What makes the blocks whole graphs: the MoE layer needs no host sync (a static
upper bound on rows) and its Triton kernels are custom ops; aux-free load counts are kept inside
forward; Spider's core passes its loop index as a tensor and marks the segment count S dynamic
(models/spider/recurrence.py), so one graph per block structure serves every loop and every
batch. Measured on the debug flavor (CPU, inductor, 20 steps, n_loops 3, aux-free balancing):
no graph break, 1 recompile (core blocks with and without Engram differ in structure), losses
equal to eager within 1e-7 (tests/integration/test_precision_compile.py).

The model's ``compiled_modules`` (protocol.ModelSpec) are compiled the same way: glue between the
blocks on shapes that never change with the data, whose many small ops would otherwise each run
eagerly (Spider's boundary predictor: its fp32 cosine score forward and backward, docs/benchmarks.md).
"""

from __future__ import annotations

import logging

from torch import nn

from spider_titan.protocol import ModelSpec

logger = logging.getLogger("spider_titan")


def apply_compile(model: nn.Module, spec: ModelSpec) -> int:
    """Compile every block of ``spec`` and its ``compiled_modules`` in place; returns how many blocks."""
    blocks = spec.blocks(model)
    extras = spec.compiled_extras(model)
    for _, module in blocks + extras:
        module.compile(fullgraph=True)
    logger.info("torch.compile: %d blocks%s", len(blocks), "".join(f", {fqn}" for fqn, _ in extras))
    return len(blocks)
