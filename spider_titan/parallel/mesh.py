"""ParallelDims: the parallel degrees of a run, validated in one place, and its device mesh.

    world_size = dp_replicate * dp_shard          (dp_shard = -1 takes what is left)
    dp_shard   = dp_shard_mod_ep * ep             (expert parallel borrows ranks from the FSDP dim)

Meshes (fixed names; each a view of one world mesh, made with ``_unflatten``):
    "world"  all ranks, 1-D: data loading (every rank reads its own slice)
    "fsdp"   dense parameters: ("dp_shard",) or, with replication, ("dp_replicate", "dp_shard") = HSDP
    "ep"     expert parallel: the ``ep`` consecutive ranks that split the experts
    "efsdp"  expert parameters' FSDP: ("dp_shard_mod_ep",) or ("dp_replicate", "dp_shard_mod_ep"),
             the data-parallel ranks that hold the same experts

Rank layout (world rank = ((replica * dp_shard_mod_ep) + j) * ep + e): the EP ranks are adjacent,
so on GPUs an EP group sits inside one node where the all-to-all is fastest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from spider_titan.job_config import Parallelism


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int, *, check: bool = True) -> ParallelDims:
        """Resolve -1 degrees against ``world_size``; with ``check``, raise ValueError on any problem."""
        rep, shard, ep = cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree, cfg.expert_parallel_degree
        if shard == -1 and rep >= 1 and world_size % rep == 0:
            shard = world_size // rep
        dims = cls(dp_replicate=rep, dp_shard=shard, ep=ep, world_size=world_size)
        if check and dims.problems():
            raise ValueError("\n".join(dims.problems()))
        return dims

    def problems(self) -> list[str]:
        """Every inconsistency, each one line showing the whole equation and a fix."""
        out = []
        if self.dp_replicate < 1:
            out.append(f"parallelism.data_parallel_replicate_degree: {self.dp_replicate} must be >= 1")
        if self.ep < 1:
            out.append(f"parallelism.expert_parallel_degree: {self.ep} must be >= 1")
        if self.dp_shard == -1:
            if self.dp_replicate >= 1:
                out.append(
                    f"parallelism: WORLD_SIZE({self.world_size}) = dp_replicate({self.dp_replicate}) * dp_shard(-1) "
                    "has no whole-number dp_shard; choose a data_parallel_replicate_degree that divides "
                    f"{self.world_size}"
                )
        elif self.dp_shard < 1:
            out.append(f"parallelism.data_parallel_shard_degree: {self.dp_shard} must be >= 1 or -1 (the rest)")
        elif self.dp_replicate >= 1 and self.dp_replicate * self.dp_shard != self.world_size:
            out.append(
                f"parallelism: dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) = "
                f"{self.dp_replicate * self.dp_shard} != WORLD_SIZE({self.world_size}); "
                "set data_parallel_shard_degree = -1"
            )
        if self.ep >= 1 and self.dp_shard >= 1 and self.dp_shard % self.ep:
            out.append(
                f"parallelism: dp_shard({self.dp_shard}) = dp_shard_mod_ep * ep({self.ep}) has no whole-number "
                "dp_shard_mod_ep (expert-parallel ranks are drawn from the FSDP dimension); "
                f"choose an expert_parallel_degree that divides {self.dp_shard}"
            )
        return out

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.ep

    @property
    def dp_degree(self) -> int:
        """Ranks that each load their own data (every rank: no tensor or pipeline parallel here)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.dp_replicate > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def gradient_divide_factor(self) -> int:
        """What every gradient is divided by after its reduction: the data-parallel degree.

        Dense gradients are summed over all dp ranks. An expert's gradient already holds the
        tokens of its whole EP group (the all-to-all backward brings them) and is then summed over
        the ``efsdp`` ranks only: the same total, so the same divisor, not the efsdp size.
        """
        return self.dp_degree

    def describe(self) -> str:
        parts = [f"dp_replicate {self.dp_replicate}", f"dp_shard {self.dp_shard}"]
        if self.ep_enabled:
            parts.append(f"ep {self.ep} (efsdp {self.dp_replicate * self.dp_shard_mod_ep})")
        return f"{' x '.join(parts)} = {self.world_size} ranks"

    def build_meshes(self, device_type: str) -> dict[str, DeviceMesh]:
        """One init_device_mesh call, then the named views of the module docstring."""
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        dense = world._unflatten(0, (self.dp_replicate, self.dp_shard), ("dp_replicate", "dp_shard"))
        sparse = world._unflatten(
            0, (self.dp_replicate, self.dp_shard_mod_ep, self.ep), ("dp_replicate", "dp_shard_mod_ep", "ep")
        )
        return {
            "world": world,
            "fsdp": dense if self.hsdp_enabled else dense["dp_shard"],
            "ep": sparse["ep"],
            "efsdp": sparse["dp_replicate", "dp_shard_mod_ep"] if self.hsdp_enabled else sparse["dp_shard_mod_ep"],
        }


def use_fsdp(cfg: Parallelism, dims: ParallelDims) -> bool:
    """Whether FSDP2 wraps the model: ``parallelism.fsdp = "auto"`` means more than one dp rank."""
    return cfg.fsdp == "always" or (cfg.fsdp == "auto" and dims.fsdp_enabled)


# The rules between the parallel layout and the model, written once: the config validator reports
# them at start-up and the parallel code raises them for callers that skip the config.


def experts_split_problem(n_experts: int, ep: int) -> str | None:
    """Expert parallel splits the experts evenly over ``ep`` ranks."""
    if ep > 1 and n_experts % ep:
        return (
            f"parallelism.expert_parallel_degree: n_experts({n_experts}) = experts_per_rank * "
            f"expert_parallel_degree({ep}) has no whole-number experts_per_rank; choose a degree that divides "
            "the expert count"
        )
    return None


def fsdp_problems(cfg: Parallelism, dims: ParallelDims) -> list[str]:
    """The shipped ``fsdp`` parallelize component averages gradients over the data-parallel ranks
    through FSDP, and expert parallel lives inside it: with several ranks it must be on. (Another
    parallelize component averages gradients its own way.)"""
    if cfg.name != "fsdp" or cfg.fsdp != "never":
        return []
    if dims.ep > 1:
        return ['parallelism.expert_parallel_degree > 1 needs FSDP; set parallelism.fsdp = "auto"']
    if dims.world_size > 1:
        return [
            f"parallelism.fsdp: 'never' with WORLD_SIZE={dims.world_size} leaves the ranks' gradients "
            'unsynchronised; set it to "auto" or run one process'
        ]
    return []


def destroy_process_groups() -> None:
    """Destroy every process group, and drop the references that keep their backends alive after it.

    DTensor caches its sharding and redistribution plans (in Python and in a C++ cache) keyed by specs
    that hold the device mesh, and so the mesh's process groups. Left there, the gloo or NCCL backends
    and their threads outlive ``destroy_process_group`` until the process exits and are destroyed
    during or after the interpreter's shutdown: a 4-rank gloo run aborted then, now and then, with
    "terminate called without an active exception" (1 run in 25 of tests/distributed/test_split_invariance's
    FSDP 4 run on 2 cores). Emptied here, the backends go as soon as the model does."""
    from torch.distributed.tensor import _collective_utils, _redistribute, debug

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # Private caches, so each only where this torch has it (2.11 on the GPU machines, 2.13 here).
    clear_sharding_cache = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear_sharding_cache is not None:
        clear_sharding_cache()
    for cached in (
        getattr(_redistribute, "_gen_transform_infos", None),
        getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None),
    ):
        if cached is not None:
            cached.cache_clear()
    planners = getattr(_redistribute, "_planner_cache", None)  # weak keys, but each planner holds its mesh
    if planners is not None:
        planners.clear()
