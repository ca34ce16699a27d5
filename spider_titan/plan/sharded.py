"""The sharded model under a fake process group: the builder's meta model with the REAL parallelize
applied at N ranks, and the per-rank sizes read from what FSDP2 built (parameter shards, FSDP
parameter groups, optimizer state)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from spider_titan import registry
from spider_titan.job_config import JobConfig
from spider_titan.parallel.fsdp import keep_gathered
from spider_titan.parallel.mesh import ParallelDims, destroy_process_groups, use_fsdp
from spider_titan.parallel.parallelize import _loop_owners, fsdp_units
from spider_titan.protocol import DTYPES


@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """torch.distributed's ``fake`` backend as the default group: collectives return at once,
    nothing is sent, so the real parallelize runs on one CPU for any world size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("plan: a process group is already initialised; run the plan in its own process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        destroy_process_groups()


def planning_config(cfg: JobConfig) -> JobConfig:
    """A copy of ``cfg`` for meta builds: no torch.compile (Dynamo cannot trace under the measuring
    dispatch mode; the activation measurement stands in for it with :class:`CompiledSaves`)."""
    cfg = copy.deepcopy(cfg)
    cfg.training.compile = False
    return cfg


def keep_gathered_overrides(
    cfg: JobConfig, spec, model: nn.Module, param_dtype: torch.dtype, gpu_memory_bytes: float
) -> list[str]:
    """fsdp.py's keep-the-core-gathered rule decided for the GPU's memory (on the meta device
    parallelize would ask the host's), as ``FQN=true|false`` entries the config's own
    ``fsdp_reshard_after_forward_units`` still override."""
    par = cfg.parallelism
    if par.fsdp_reshard_after_forward != "default" or par.fsdp_keep_core_gathered_fraction <= 0:
        return []
    out = []
    for owner in _loop_owners(spec):
        if owner:
            kept = keep_gathered(
                model.get_submodule(owner), param_dtype, gpu_memory_bytes, par.fsdp_keep_core_gathered_fraction
            )
            out.append(f"{owner}={'false' if kept else 'true'}")
    return out


def build_sharded_model(cfg: JobConfig, ngpu: int, gpu_memory_bytes: float):
    """(spec, args, model, dims, units) with the real parallelize applied at ``ngpu`` ranks on
    meta; call inside :func:`fake_process_group` (units: the FSDP units, [] without FSDP)."""
    from spider_titan.components.builder import build_model

    cfg = planning_config(cfg)
    param_dtype, reduce_dtype = DTYPES[cfg.training.mixed_precision_param], DTYPES[cfg.training.mixed_precision_reduce]
    dims = ParallelDims.from_config(cfg.parallelism, ngpu)
    spec, args, model = build_model(cfg)
    cfg.parallelism.fsdp_reshard_after_forward_units = keep_gathered_overrides(
        cfg, spec, model, param_dtype, gpu_memory_bytes
    ) + list(cfg.parallelism.fsdp_reshard_after_forward_units)
    cfg.parallelism.comm_counter = False
    meshes = dims.build_meshes("cpu") if ngpu > 1 else None
    name = cfg.parallelism.name
    registry.get("parallelize", name)(
        model,
        spec,
        dims,
        meshes,
        registry.section("parallelize", name, cfg),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
    )
    units = fsdp_units(spec, model) if ngpu > 1 and use_fsdp(cfg.parallelism, dims) else []
    return spec, args, model, dims, units


@dataclass
class UnitGroup:
    """One FSDP parameter group of one unit (a unit has two under expert parallel: dense, experts)."""

    tag: str  # the CommCounter's tag: unit FQN ("root"), "<unit>.experts" for expert weights
    shard_size: int  # ranks the group is sharded over
    replicas: int  # HSDP replicas (1 without)
    reshard_after_forward: bool
    gathered_bytes: int  # the unsharded parameters in their all-gather dtype (padded)
    reduce_scatter_bytes: int  # the reduce-scatter input: padded unsharded gradient, reduce dtype
    accumulated_grad_bytes: int  # the unsharded gradient kept between micro-batches


def fsdp_groups(model: nn.Module, units: list[tuple[str, nn.Module]]) -> list[UnitGroup]:
    """Every FSDP unit's parameter groups as FSDP2 built them (sizes padded the way it pads)."""
    out = []
    for fqn, module in [*units, ("root", model)]:
        state = module._get_fsdp_state()
        n_groups = len(state._fsdp_param_groups)
        for group in state._fsdp_param_groups:
            info = group.mesh_info
            shard = info.shard_mesh_size
            replicas = getattr(info, "replicate_mesh_size", 1)
            gathered = rs = acc = 0
            for fp in group.fsdp_params:
                padded = fp.padded_sharded_param_size.numel() * shard
                # what lazy init will resolve (fp.param_dtype / reduce_dtype are set at the first forward)
                param_dtype = fp.mp_policy.param_dtype or fp.sharded_param.dtype
                # a float8 weight (torchao's fsdp_pre_all_gather) is gathered as 1-byte float8
                ag_itemsize = 1 if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather") else param_dtype.itemsize
                reduce_dtype = fp.mp_policy.reduce_dtype or param_dtype
                gathered += padded * ag_itemsize
                rs += padded * reduce_dtype.itemsize
                acc += math.prod(fp._orig_size) * reduce_dtype.itemsize
            # expert weights form their own group only when they live on another mesh (expert parallel)
            is_expert = n_groups > 1 and all(".experts." in n for n in _group_param_names(module, group))
            out.append(
                UnitGroup(
                    tag=f"{fqn}.experts" if is_expert else fqn,
                    shard_size=shard,
                    replicas=replicas,
                    reshard_after_forward=group.post_forward_mesh_info is not None,
                    gathered_bytes=gathered,
                    reduce_scatter_bytes=rs,
                    accumulated_grad_bytes=acc,
                )
            )
    return out


def _group_param_names(module: nn.Module, group) -> list[str]:
    ids = {id(fp.sharded_param) for fp in group.fsdp_params}
    return [n for n, p in module.named_parameters() if id(p) in ids]


def local_bytes(tensors) -> dict[str, int]:
    """{dtype name: bytes} of the local shards of ``tensors`` (DTensor or plain)."""
    out: dict[str, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        key = str(local.dtype).replace("torch.", "")
        out[key] = out.get(key, 0) + local.numel() * local.element_size()
    return out


def optimizer_state_bytes(model: nn.Module, cfg: JobConfig) -> int:
    """Bytes of the optimizer's per-parameter state on this rank, from the optimizer the config
    names built on the (sharded, meta) parameters: AdamW keeps ``exp_avg`` and ``exp_avg_sq`` like
    the parameter, Muon one ``momentum_buffer`` (its AdamW part two moments)."""
    optimizer = registry.get("optimizer", cfg.optimizer.name)(model, cfg.optimizer)
    inner = [optimizer.muon, optimizer.adamw] if hasattr(optimizer, "muon") else [optimizer]
    total = 0
    for opt in inner:
        states = 1 if isinstance(opt, torch.optim.Muon) else 2
        for group in opt.param_groups:
            total += states * sum(sum(local_bytes([p]).values()) for p in group["params"])
    return total
