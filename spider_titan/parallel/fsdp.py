"""FSDP2 (``fully_shard``) over the data-parallel mesh: one unit per block, then the root.

With a 2-D ("dp_replicate", "dp_shard") mesh this is HSDP: parameters sharded inside a replica
group and replicated across groups, gradients reduce-scattered then all-reduced.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: list[nn.Module],
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
) -> None:
    """Shard ``model`` in place: each of ``blocks`` is an FSDP unit, the root holds the rest.

    reshard_after_forward: ``default`` frees each block's gathered parameters after its forward
    (re-gathered in backward) but keeps the root's, which backward needs first anyway;
    ``always`` / ``never`` apply to every unit.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    block_reshard = reshard_after_forward != "never"
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=block_reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward == "always")
