"""The ``parallelize`` component: apply the parallelisms ParallelDims asks for, in order.

Order: expert parallel (shards the experts over "ep"), then FSDP2 / HSDP over the data-parallel
ranks (dense parameters over "fsdp", expert parameters over "efsdp"), then global-batch statistics
(the MoE balance statistics summed over the data-parallel ranks). Everything is applied in place
to an already materialised model.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from spider_titan.distributed import differentiable_all_reduce_sum
from spider_titan.job_config import Parallelism
from spider_titan.moe.layer import MoE
from spider_titan.parallel.comm_counter import CommCounter
from spider_titan.parallel.expert_parallel import ExpertParallelExperts, apply_expert_parallel, dropped_pairs_report
from spider_titan.parallel.fsdp import apply_forward_prefetch, apply_fsdp, device_memory_bytes, keep_gathered
from spider_titan.parallel.mesh import ParallelDims, fsdp_problems, use_fsdp
from spider_titan.protocol import ModelSpec, PostStepHook

logger = logging.getLogger("spider_titan")


def _loop_owners(spec: ModelSpec) -> list[str]:
    """FQNs of the modules that run a recurrent container's loop (its parent; "" = the root)."""
    containers = spec.recurrence.containers if spec.recurrence is not None else ()
    return sorted({c.rpartition(".")[0] for c in containers})


def fsdp_units(spec: ModelSpec, model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FSDP units below the root, in forward order: every block, except that a recurrent
    container's blocks are not units of their own, their owner (the module running the loop,
    the container's parent) is one unit instead, in the place of its first block (see fsdp.py).
    No unit contains another, so this order is also a valid order to shard them in."""
    owners = [o for o in _loop_owners(spec) if o]
    units: list[tuple[str, nn.Module]] = []
    for fqn, block in spec.blocks(model):
        owner = next((o for o in owners if fqn.startswith(o + ".")), None)
        if owner is None:
            units.append((fqn, block))
        elif owner not in dict(units):
            units.append((owner, model.get_submodule(owner)))
    return units


def unit_reshard_after_forward(
    units: list[tuple[str, nn.Module]], owners: list[str], cfg: Parallelism, param_dtype: torch.dtype
) -> dict[str, bool]:
    """``{unit fqn: reshard after forward?}`` for the units that differ from the global policy:
    the loop owners kept gathered by the fsdp.py rule (``default`` policy only), then the
    ``fsdp_reshard_after_forward_units`` overrides. ``cfg`` is the [parallelism] section."""
    out: dict[str, bool] = {}
    modules = dict(units)
    if cfg.fsdp_reshard_after_forward == "default" and cfg.fsdp_keep_core_gathered_fraction > 0:
        for owner in owners:
            if owner not in modules:
                continue
            module = modules[owner]
            memory = device_memory_bytes(next(module.parameters()).device)
            if keep_gathered(module, param_dtype, memory, cfg.fsdp_keep_core_gathered_fraction):
                out[owner] = False
                logger.info(
                    "FSDP2: %s stays gathered between forward and backward (its parameters fit in %g of device memory)",
                    owner,
                    cfg.fsdp_keep_core_gathered_fraction,
                )
            else:
                logger.info(
                    "FSDP2: %s reshards after forward (its parameters exceed %g of device memory)",
                    owner,
                    cfg.fsdp_keep_core_gathered_fraction,
                )
    for entry in cfg.fsdp_reshard_after_forward_units:
        fqn, sep, value = entry.partition("=")
        if not sep or value.strip().lower() not in ("true", "false"):
            raise ValueError(
                f"parallelism.fsdp_reshard_after_forward_units: {entry!r} is not FQN=true|false "
                f"(e.g. core=true); units are {[f for f, _ in units]}"
            )
        out[fqn.strip()] = value.strip().lower() == "true"
    return out


def apply_parallelism(
    model: nn.Module,
    spec: ModelSpec,
    dims: ParallelDims,
    meshes: dict[str, DeviceMesh] | None,
    cfg: Parallelism,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    counter: CommCounter | None = None,
) -> list[PostStepHook]:
    """``cfg`` is the [parallelism] section; the dtypes are the ones chosen for the device.

    With a ``counter`` (``parallelism.comm_counter``; the builder makes it) every collective counts
    its bytes there; the post-step hooks returned close the counter's step after every optimizer
    step (the same list converters and load balancers hand the builder).
    """
    fsdp = use_fsdp(cfg, dims)
    if (fsdp or dims.ep_enabled) and meshes is None:
        raise ValueError(
            "parallelism: FSDP / expert parallel need a process group; launch with torchrun "
            '(WORLD_SIZE > 1) or set parallelism.fsdp = "auto"'
        )
    problems = fsdp_problems(cfg, dims)
    if problems:
        raise ValueError("\n".join(problems))
    hooks: list[PostStepHook] = [counter.post_step] if counter is not None else []
    expert_params: list[nn.Parameter] = []
    if dims.ep_enabled:
        n = apply_expert_parallel(
            model,
            meshes["ep"],
            counter=counter,
            dispatch=cfg.expert_parallel_dispatch,
            capacity_factor=cfg.expert_capacity_factor,
            capacity_tokens=cfg.expert_capacity_tokens,
        )
        if cfg.expert_parallel_dispatch == "capacity":
            hooks.append(dropped_pairs_report(model))
        expert_params = [p for m in model.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters()]
        logger.info("expert parallel: experts of %d MoE layers sharded over %d ranks", n, dims.ep)
    if not fsdp:
        return hooks
    units = fsdp_units(spec, model)
    apply_fsdp(
        model,
        meshes["fsdp"],
        units=units,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=cfg.fsdp_reshard_after_forward,
        unit_reshard=unit_reshard_after_forward(units, _loop_owners(spec), cfg, param_dtype),
        expert_params=expert_params,
        expert_mesh=meshes["efsdp"] if dims.ep_enabled else None,
        gradient_divide_factor=dims.gradient_divide_factor,
        counter=counter,
    )
    if dims.ep_enabled:
        pairs = apply_forward_prefetch(units, _loop_owners(spec))
        if pairs:
            logger.info(
                "FSDP2 forward prefetch around the core (expert parallel): %s",
                ", ".join(f"{a} -> {b}" for a, b in pairs),
            )
    logger.info(
        "FSDP2 over %s: %d units (%s) + root, params %s, reduce %s",
        dims.describe(),
        len(units),
        ", ".join(f for f, _ in units),
        str(param_dtype).replace("torch.", ""),
        str(reduce_dtype).replace("torch.", ""),
    )
    # Every rank loads its own data ("world" is the data-parallel group; under expert parallel
    # too, the EP ranks of a group hold different tokens). Only under FSDP: the exactness of the
    # gradient rests on FSDP averaging it over these same ranks (moe/layer.py, MoE._stats).
    n = apply_global_batch_statistics(model, meshes["world"].get_group())
    if n:
        logger.info(
            "global-batch load balancing: %d MoE layers' balance statistics summed over %d data-parallel ranks",
            n,
            dims.dp_degree,
        )
    return hooks


def apply_global_batch_statistics(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Make the batch-level statistics of the losses sums over ``group``, the data-parallel ranks,
    so each loss is that of the global micro-batch and training does not depend on the number of
    ranks: every module with a ``reduce_stats`` slot gets a differentiable sum. The MoE layers'
    balance statistics (f_i, P_i, token count; Qiu et al. 2025, arXiv 2501.11873: one all-reduce of
    2E+1 floats per MoE call in forward and one in backward). Returns the number of MoE layers."""
    modules = [m for m in model.modules() if hasattr(m, "reduce_stats")]
    for module in modules:
        module.reduce_stats = functools.partial(differentiable_all_reduce_sum, group=group)
    return sum(isinstance(m, MoE) for m in modules)
