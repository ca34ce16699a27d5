"""``torch.compile`` per block (after activation checkpointing, before FSDP), like torchtitan.

Compiling block by block keeps compile time proportional to one block (blocks of a container
share code, so Dynamo reuses the graph) and lets FSDP's hooks stay outside the compiled regions.
``nn.Module.compile`` compiles in place, so parameter names (and checkpoints) are unchanged.

Data-dependent shapes: the MoE layer needs no host sync (a static upper bound on rows), so its
shapes depend only on the token count. Spider's core sees a segment count S that changes from
batch to batch; Dynamo's automatic dynamic shapes recompile once with S symbolic and then reuse
that graph, so a run compiles each block at most twice, not every step.
"""

from __future__ import annotations

import logging

from torch import nn

from spider_titan.models.common import ModelSpec

logger = logging.getLogger("spider_titan")


def apply_compile(model: nn.Module, spec: ModelSpec) -> int:
    """Compile every block of ``spec`` in place; returns how many blocks."""
    blocks = spec.blocks(model)
    for _, block in blocks:
        block.compile()
    logger.info("torch.compile: %d blocks", len(blocks))
    return len(blocks)
