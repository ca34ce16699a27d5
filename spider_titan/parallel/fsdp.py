"""FSDP2 (``fully_shard``) over the data-parallel mesh: one unit per block, one per recurrent loop, the root.

With a 2-D ("dp_replicate", "dp_shard") mesh this is HSDP: parameters sharded inside a replica
group and replicated across groups, gradients reduce-scattered then all-reduced.

Units. FSDP2 all-gathers a unit's parameters in its forward pre-hook and again in its pre-backward
hook, once per forward *call*. A block applied ``n_loops`` times per step (the recurrent core)
would therefore be gathered ``n_loops`` times in forward and ``n_loops`` times in backward. So a
recurrent container is not split into per-block units: the module that runs the loop (the
container's parent, e.g. ``core``) is one unit, called once per forward: one all-gather in
forward, one in backward and one reduce-scatter, for any ``n_loops``. Measured with the comm
benchmark (debug flavor, 2 ranks, fp32): the core unit all-gathers 5.00 MB per step at n_loops 2
and at n_loops 4; per-block units all-gather 9.71 MB and 19.43 MB. The price is that the whole
core is unsharded at once during its forward and backward (per-block units would have to stay
gathered across loops anyway to avoid the re-gathering).

Expert weights. Under expert parallel the experts live inside those units but are sharded over
another mesh ("efsdp"); FSDP2's per-parameter mesh (``shard_placement_fn`` returning a
``ShardPlacementResult``) keeps them in the same unit as a second parameter group, so they are
gathered and reduced with it, once per forward and backward too.

Collectives. Every unit gets this package's custom all-gather (float8 payloads move as uint8,
float8_allgather.py) and reduce-scatter (below), which also count bytes into a CommCounter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import Shard

from spider_titan.parallel.comm_counter import CommCounter, CountingComm
from spider_titan.parallel.float8_allgather import BytesAllGather


class CountingReduceScatter(CountingComm, ReduceScatter):
    """FSDP2 custom reduce-scatter: counts bytes, and runs on gloo with a gradient divide factor.

    With a divide factor that is not the reduce-scatter group's size (HSDP; experts under EP),
    FSDP2 asks for ``PREMUL_SUM(1/factor)``, which gloo rejects ("Cannot use ReduceOp.PREMUL_SUM
    with Gloo"). There the input is scaled by the factor first and reduced with SUM: the same sum.
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.count("reduce_scatter", group, input_tensor.numel() * input_tensor.element_size())
        if getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM and dist.get_backend(group) == "gloo":
            input_tensor.mul_(op.factor)
            op = dist.ReduceOp.SUM
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _mesh_info(mesh: DeviceMesh) -> FSDPMeshInfo:
    if mesh.ndim == 1:
        return FSDPMeshInfo(mesh, shard_mesh_dim=0)
    return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    units: list[tuple[str, nn.Module]],
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
    expert_params: Sequence[nn.Parameter] = (),
    expert_mesh: DeviceMesh | None = None,
    gradient_divide_factor: float | None = None,
    counter: CommCounter | None = None,
) -> None:
    """Shard ``model`` in place: each of ``units`` (fqn, module) is an FSDP unit, the root holds the rest.

    reshard_after_forward: ``default`` frees each unit's gathered parameters after its forward
    (re-gathered in backward) but keeps the root's, which backward needs first anyway;
    ``always`` / ``never`` apply to every unit.
    expert_params are sharded over ``expert_mesh`` instead of ``mesh`` (in whatever unit holds them).
    gradient_divide_factor: what every reduced gradient is divided by (FSDP2's default is the
    size of each parameter's own data-parallel mesh).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    placement_fn = None
    if expert_mesh is not None:
        expert_ids = {id(p) for p in expert_params}
        expert_info = _mesh_info(expert_mesh)  # one object: FSDP2 groups parameters by it

        def placement_fn(param: nn.Parameter):
            return ShardPlacementResult(Shard(0), expert_info) if id(param) in expert_ids else None

    unit_reshard = reshard_after_forward != "never"
    for _, unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=unit_reshard, shard_placement_fn=placement_fn)
    fully_shard(
        model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward == "always",
        shard_placement_fn=placement_fn,
    )

    expert_group = expert_mesh.get_group(expert_mesh.ndim - 1) if expert_mesh is not None else None
    for fqn, module in [*units, ("root", model)]:
        tags = {expert_group: f"{fqn}.experts"} if expert_group is not None else {}
        _set_comms(
            module,
            BytesAllGather(counter, fqn, tags),
            CountingReduceScatter(counter, fqn, tags),
        )
        if gradient_divide_factor is not None:
            module.set_gradient_divide_factor(gradient_divide_factor)


def _set_comms(module: FSDPModule, all_gather: BytesAllGather, reduce_scatter: CountingReduceScatter) -> None:
    """Install the custom collectives on every parameter group of ``module``.

    ``FSDPModule.set_custom_all_gather`` refuses a unit with several parameter groups (one comm
    would be "ambiguous across meshes"); ours take the process group per call, so one object
    serves every group and is set on each directly.
    """
    for group in module._get_fsdp_state()._fsdp_param_groups:
        group._all_gather_comm = all_gather
        group._reduce_scatter_comm = reduce_scatter
