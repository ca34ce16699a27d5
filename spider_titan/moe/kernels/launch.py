"""Launch configurations of the MoE kernels: one table, read by the launchers and by the AOT test.

Why a table: the tile sizes decide register pressure. At 32 x 256 tiles and 4 warps, expand
(both forms), the weighted reduce and the weight-gradient kernel compiled to the 255-register cap
on sm_90 and spilled 8-96 B per thread (int64 row offsets for every element of the tile). The
tiles below compile without a spill for sm_90 and sm_100 at the 1B shapes; the register table and
the command that measures it are in docs/benchmarks.md ("MoE layer and kernels"), and
``tests/unit/test_triton_aot.py`` compiles every launch :func:`launch_plan` lists and fails on a
spill. Change a tile here and that test tells whether it still fits.

These kernels are gathers, memory-bound: a smaller tile costs nothing but more programs, which a
GPU with 132 SMs and T * k >= 16k rows per call keeps busy.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class TileConfig:
    """Rows (or tokens) per program, feature columns per inner step, and warps per program."""

    block_rows: int
    block_d: int
    num_warps: int


# One entry per data-path kernel family; ``block_d`` is capped at the feature width (next power of 2).
TILE_CONFIGS: dict[str, TileConfig] = {
    "expand": TileConfig(block_rows=16, block_d=128, num_warps=4),
    "reduce": TileConfig(block_rows=16, block_d=128, num_warps=4),
    "weight_grad": TileConfig(block_rows=16, block_d=128, num_warps=4),
}


def tile_config(kernel: str, d: int) -> TileConfig:
    """The tile ``kernel`` launches with on rows of width ``d``."""
    cfg = TILE_CONFIGS[kernel]
    return TileConfig(cfg.block_rows, min(cfg.block_d, triton.next_power_of_2(d)), cfg.num_warps)


def routing_map_blocks(n_experts: int) -> tuple[int, int]:
    """(BLOCK slots per program, E_PAD) of the routing-map kernels: a one-hot tile of at most 8192 int32."""
    e_pad = triton.next_power_of_2(n_experts)
    return max(16, min(1024, 8192 // e_pad)), e_pad


@dataclass(frozen=True)
class KernelLaunch:
    """One compiled variant a run can launch: the kernel's name, its constexprs and warps."""

    kernel: str
    constexprs: dict
    num_warps: int


def launch_plan(d: int, n_experts: int, top_k: int) -> list[KernelLaunch]:
    """Every kernel variant the triton backend launches for feature width ``d``, ``n_experts`` and
    ``top_k``, from the same functions the launchers call; the AOT test compiles each one."""
    block, e_pad = routing_map_blocks(n_experts)
    plan = [
        KernelLaunch("_block_histogram_kernel", {"BLOCK": block, "E_PAD": e_pad}, 4),
        KernelLaunch("_segment_offsets_kernel", {"E_PAD": e_pad}, 4),
        KernelLaunch("_scatter_positions_kernel", {"K": top_k, "BLOCK": block, "E_PAD": e_pad}, 4),
    ]
    ex, rd, wg = tile_config("expand", d), tile_config("reduce", d), tile_config("weight_grad", d)
    for has_w in (False, True):
        k = top_k if has_w else 1  # the unweighted expand reads no slots
        plan.append(
            KernelLaunch(
                "_expand_kernel",
                {"K": k, "HAS_WEIGHTS": has_w, "BLOCK_R": ex.block_rows, "BLOCK_D": ex.block_d},
                ex.num_warps,
            )
        )
        plan.append(
            KernelLaunch(
                "_reduce_kernel",
                {"K": top_k, "HAS_WEIGHTS": has_w, "BLOCK_T": rd.block_rows, "BLOCK_D": rd.block_d},
                rd.num_warps,
            )
        )
    plan.append(
        KernelLaunch("_weight_grad_kernel", {"K": top_k, "BLOCK_T": wg.block_rows, "BLOCK_D": wg.block_d}, wg.num_warps)
    )
    return plan
