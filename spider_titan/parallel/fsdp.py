"""FSDP2 (``fully_shard``) over the data-parallel mesh: one unit per block, one per recurrent loop, the root.

With a 2-D ("dp_replicate", "dp_shard") mesh this is HSDP: parameters sharded inside a replica
group and replicated across groups, gradients reduce-scattered then all-reduced.

Units. FSDP2 all-gathers a unit's parameters in its forward pre-hook and again in its pre-backward
hook, once per forward *call*. A block applied ``n_loops`` times per step (the recurrent core)
would therefore be gathered ``n_loops`` times in forward and ``n_loops`` times in backward. So a
recurrent container is not split into per-block units: the module that runs the loop (the
container's parent, e.g. ``core``) is one unit, called once per forward: one all-gather in
forward, one in backward (none when it stays gathered, below) and one reduce-scatter, for any
``n_loops``. Measured with the comm benchmark (debug flavor, 2 ranks, fp32, core resharded after
forward): the core unit all-gathers 5.00 MB per step at n_loops 2 and at n_loops 4; per-block
units all-gather 9.71 MB and 19.43 MB. The price is that the whole
core is unsharded at once during its forward and backward (per-block units would have to stay
gathered across loops anyway to avoid the re-gathering).

Expert weights. Under expert parallel the experts live inside those units but are sharded over
another mesh ("efsdp"); FSDP2's per-parameter mesh (``shard_placement_fn`` returning a
``ShardPlacementResult``, torch >= 2.12; on torch 2.11 expert parallel with FSDP stops at
start-up) keeps them in the same unit as a second parameter group, so they are gathered and
reduced with it, once per forward and backward too.

Shard dim. FSDP2 shards a parameter on dim 0 and pads it to a multiple of the shard group, so a
dim 0 smaller than the group is mostly padding: the 1B flavor's 32 experts (``(E, out, in)``) at
64 data-parallel ranks left half the ranks a padding expert each, and at 512 ranks every rank held
a whole expert's worth (the planner measured 21.5 and 71 GiB per rank). :func:`shard_dim` picks a
later dim that divides evenly when padding dim 0 would waste more than 10 % (FSDP2 shards dims
other than 0 only evenly); the price is one extra copy of the gathered parameter after each
all-gather (FSDP2 re-interleaves the chunks), paid only by those parameters.

Reshard after forward. A unit resharded after forward is all-gathered again in backward. The
recurrent core is the unit whose re-gather costs most (it holds the experts), and with recurrent
activation checkpointing its backward recomputes every loop, so by default it stays gathered
from its forward to its backward when that fits: when its unsharded parameters (param dtype) take
at most ``parallelism.fsdp_keep_core_gathered_fraction`` (0.1) of the device's memory (the GPU's,
or the host's on CPU; expert weights count at their full size, an upper bound under expert
parallel). The price is those bytes held through the rest of the forward and the loss. Every other unit reshards
(``reshard_after_forward = "default"``) and the root does not (backward needs it first).
``unit_reshard`` overrides the rule per unit (``parallelism.fsdp_reshard_after_forward_units``).

Gradient accumulation. :func:`maybe_no_grad_sync` turns FSDP2's gradient sync off for every
micro-batch but the last: gradients accumulate unsharded on each rank and are reduce-scattered
once per optimizer step instead of once per micro-batch (the reduce-scatter bytes divide by the
accumulation steps, at the memory cost of one unsharded gradient per parameter until the sync).

Collectives. FSDP2's own all-gather and reduce-scatter are used unless this package's custom
ones are needed (:func:`needs_custom_comms`): when the CommCounter counts bytes, and on gloo, which
has no float8 dtype (float8 payloads must move as uint8, float8_allgather.py) and rejects the
``PREMUL_SUM`` reduction FSDP2 asks for with a gradient divide factor (below). On NCCL with the
counter off FSDP2 keeps its default path (its own buffers, no Python call per collective).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
from torch.distributed.tensor import Shard

from spider_titan.parallel.comm_counter import CommCounter, CountingComm
from spider_titan.parallel.float8_allgather import BytesAllGather

logger = logging.getLogger("spider_titan")

try:  # torch >= 2.12: a parameter may be sharded over its own mesh inside a unit (experts under EP)
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # torch 2.11
    ShardPlacementResult = None

# torch >= 2.12 name; 2.11 has only the older one (deprecated since, the same collective)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
        return _reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _mesh_info(mesh: DeviceMesh) -> FSDPMeshInfo:
    if mesh.ndim == 1:
        return FSDPMeshInfo(mesh, shard_mesh_dim=0)
    return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)


def needs_custom_comms(*, counter_enabled: bool, backend: str) -> bool:
    """Whether FSDP units get this package's custom all-gather / reduce-scatter: to count bytes, or
    on gloo (float8 as uint8, PREMUL_SUM as SUM). Otherwise FSDP2's default collectives run."""
    return counter_enabled or backend == "gloo"


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of ``device``: the GPU's, or the host's physical memory for a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def shard_dim(shape: Sequence[int], group_size: int, max_padding: float = 0.1) -> int:
    """The dim FSDP2 shards a parameter of ``shape`` on over ``group_size`` ranks (module docstring):
    0 unless padding dim 0 to a multiple of the group adds more than ``max_padding`` of the
    parameter, then the first later dim that the group divides (0 when none does)."""
    if not shape or group_size <= 1:
        return 0
    padded = -(-shape[0] // group_size) * group_size
    if padded <= (1.0 + max_padding) * shape[0]:
        return 0
    return next((d for d in range(1, len(shape)) if shape[d] % group_size == 0), 0)


def keep_gathered(module: nn.Module, param_dtype: torch.dtype, device_memory: int, fraction: float) -> bool:
    """The rule for a loop owner (module docstring): keep it gathered after forward when its
    unsharded parameters, in ``param_dtype``, take at most ``fraction`` of ``device_memory``."""
    nbytes = sum(p.numel() for p in module.parameters()) * param_dtype.itemsize
    return nbytes <= fraction * device_memory


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    units: list[tuple[str, nn.Module]],
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
    unit_reshard: dict[str, bool] | None = None,
    expert_params: Sequence[nn.Parameter] = (),
    expert_mesh: DeviceMesh | None = None,
    gradient_divide_factor: float | None = None,
    counter: CommCounter | None = None,
) -> None:
    """Shard ``model`` in place: each of ``units`` (fqn, module) is an FSDP unit, the root holds the rest.

    reshard_after_forward: ``default`` frees each unit's gathered parameters after its forward
    (re-gathered in backward) but keeps the root's, which backward needs first anyway;
    ``always`` / ``never`` apply to every unit.
    unit_reshard: ``{fqn: reshard?}`` for single units, overriding ``reshard_after_forward``
    (apply_parallelism fills it with the keep-the-core-gathered rule and the config's overrides).
    expert_params are sharded over ``expert_mesh`` instead of ``mesh`` (in whatever unit holds them).
    gradient_divide_factor: what every reduced gradient is divided by (FSDP2's default is the
    size of each parameter's own data-parallel mesh).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    unit_reshard = unit_reshard or {}
    unknown = sorted(set(unit_reshard) - {fqn for fqn, _ in units})
    if unknown:
        raise ValueError(
            f"parallelism.fsdp_reshard_after_forward_units: no FSDP unit named {unknown}; "
            f"units are {[fqn for fqn, _ in units]}"
        )
    if expert_mesh is not None and ShardPlacementResult is None:
        raise ValueError(
            f"parallelism.expert_parallel_degree > 1 with FSDP needs torch >= 2.12 (FSDP2 per-parameter meshes; "
            f"this is torch {torch.__version__}); upgrade torch or set parallelism.expert_parallel_degree = 1"
        )
    expert_ids = {id(p) for p in expert_params} if expert_mesh is not None else set()
    expert_info = _mesh_info(expert_mesh) if expert_mesh is not None else None  # one object: FSDP2 groups by it
    group_size = mesh.size(mesh.ndim - 1)

    off_dim0: set[int] = set()

    def placement_fn(param: nn.Parameter):
        experts = id(param) in expert_ids
        dim = shard_dim(param.shape, expert_mesh.size(expert_mesh.ndim - 1) if experts else group_size)
        if dim:
            off_dim0.add(id(param))
        if experts:
            return ShardPlacementResult(Shard(dim), expert_info)
        return Shard(dim) if dim else None

    default_reshard = reshard_after_forward != "never"
    for fqn, unit in units:
        fully_shard(
            unit,
            mesh=mesh,
            mp_policy=mp,
            reshard_after_forward=unit_reshard.get(fqn, default_reshard),
            shard_placement_fn=placement_fn,
        )
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mp,
        reshard_after_forward=reshard_after_forward == "always",
        shard_placement_fn=placement_fn,
    )

    if off_dim0:
        logger.info("FSDP2: %d parameters sharded on a dim other than 0 (dim 0 would be mostly padding)", len(off_dim0))
    backend = dist.get_backend(mesh.get_group(mesh.ndim - 1))
    if not needs_custom_comms(counter_enabled=counter is not None, backend=backend):
        logger.info("FSDP2: default collectives (%s, comm counter off)", backend)
    expert_group = expert_mesh.get_group(expert_mesh.ndim - 1) if expert_mesh is not None else None
    for fqn, module in [*units, ("root", model)]:
        if needs_custom_comms(counter_enabled=counter is not None, backend=backend):
            tags = {expert_group: f"{fqn}.experts"} if expert_group is not None else {}
            _set_comms(module, BytesAllGather(counter, fqn, tags), CountingReduceScatter(counter, fqn, tags))
        if gradient_divide_factor is not None:
            module.set_gradient_divide_factor(gradient_divide_factor)


def fsdp_wrapped(model: nn.Module) -> bool:
    """Whether FSDP2 holds ``model`` (its root is a unit, as :func:`apply_fsdp` makes it): its
    MixedPrecisionPolicy then casts the parameters for compute, so the train loop needs no autocast.
    Asked of the model, not of the parallelize component's name."""
    return isinstance(model, FSDPModule)


def apply_forward_prefetch(units_in_order: list[tuple[str, nn.Module]], owners: Sequence[str]) -> list[tuple[str, str]]:
    """Explicit forward prefetch around each loop owner (the recurrent core): the unit before it
    prefetches the core, and the core the unit after it. Under expert parallel the core's MoE
    layers wait on the host once per call (the counts' ``.tolist()``), so an all-gather that is
    only issued when the next unit's pre-forward runs starts late; issued one unit ahead, the
    core's all-gather overlaps the previous unit's compute and the next unit's overlaps the
    core's. Returns the (unit, prefetched unit) pairs."""
    pairs = []
    names = [fqn for fqn, _ in units_in_order]
    modules = dict(units_in_order)
    for owner in owners:
        if owner not in modules:
            continue
        i = names.index(owner)
        for a, b in ((i - 1, i), (i, i + 1)):
            if 0 <= a and b < len(names):
                modules[names[a]].set_modules_to_forward_prefetch([modules[names[b]]])
                pairs.append((names[a], names[b]))
    return pairs


@contextmanager
def eval_pass(model: nn.Module) -> Iterator[None]:
    """An eval pass of ``model`` between training steps (validation, calibration): eval mode and no
    autograd inside; after it, training mode again and what the pass left gathered freed. With no
    backward to follow, the FSDP units that keep their parameters after forward (the root; the core
    when it fits) stay unsharded, and the finite check, the final save and the export read the sharded
    parameters (under fp8 all-gather an unsharded one is a float8 tensor that most ops refuse)."""
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        model.train()


@contextmanager
def maybe_no_grad_sync(model: nn.Module, is_last_microbatch: bool) -> Iterator[None]:
    """Around one micro-batch's forward and backward: no gradient reduce-scatter (nor HSDP
    all-reduce) unless it is the last micro-batch of the step. Does nothing for the last
    micro-batch or a model without FSDP. Gradients accumulate unsharded until the last backward
    reduces their sum once; the result equals syncing every micro-batch."""
    if is_last_microbatch or not isinstance(model, FSDPModule):
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _set_comms(module: FSDPModule, all_gather: BytesAllGather, reduce_scatter: CountingReduceScatter) -> None:
    """Install the custom collectives on every parameter group of ``module``.

    A unit with one parameter group (always on torch 2.11) uses the public setters.
    ``FSDPModule.set_custom_all_gather`` refuses a unit with several groups (torch >= 2.12, experts
    on their own mesh: one comm would be "ambiguous across meshes"); ours take the process group
    per call, so one object serves every group and is set on each group's slot directly.
    """
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None)
    if groups is None or len(groups) <= 1:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
        return
    for group in groups:
        group._all_gather_comm = all_gather
        group._reduce_scatter_comm = reduce_scatter
