"""The ``parallelize`` component: apply the parallelisms ParallelDims asks for, in order.

Order: expert parallel (shards the experts over "ep"), then FSDP2 / HSDP over the data-parallel
ranks. Everything is applied in place to an already materialised model.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from spider_titan.models.common import ModelSpec
from spider_titan.parallel.fsdp import apply_fsdp
from spider_titan.parallel.mesh import ParallelDims

logger = logging.getLogger("spider_titan")


def apply_parallelism(
    model: nn.Module,
    spec: ModelSpec,
    dims: ParallelDims,
    meshes: dict[str, DeviceMesh] | None,
    cfg,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
) -> None:
    """``cfg`` is the [parallelism] section; the dtypes are the ones chosen for the device."""
    if dims.ep_enabled:
        raise ValueError(
            "parallelism.expert_parallel_degree > 1 is not available yet; set expert_parallel_degree = 1"
        )
    fsdp = cfg.fsdp_enabled == "always" or (cfg.fsdp_enabled == "auto" and dims.fsdp_enabled)
    if not fsdp:
        return
    apply_fsdp(
        model,
        meshes["fsdp"],
        blocks=[b for _, b in spec.blocks(model)],
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=cfg.fsdp_reshard_after_forward,
    )
    logger.info(
        "FSDP2 over %d ranks%s, %d block units, params %s",
        dims.dp_degree,
        f" (HSDP {dims.dp_replicate} x {dims.dp_shard})" if dims.hsdp_enabled else "",
        len(spec.blocks(model)),
        str(param_dtype).replace("torch.", ""),
    )
