"""The ``comm`` benchmark: bytes each collective moves per training step, by parallel layout.

    python -m lab.bench.benchmark comm

Runs ``comm_world_size`` (default 2) gloo processes on this machine and measures with the
CommCounter (comm_counter.py). Byte counts do not depend on the device, so a CPU measures what a
GPU run would move. Each scenario builds the Spider debug flavor (or a stack of linears), applies
the parallelisms the way the builder does, and trains ``comm_steps`` (default 2) steps on random
bytes; the numbers are those of the last step.

Scenarios (``comm_scenarios``, comma-separated):
  n_loops          FSDP over all ranks, n_loops 2 and 4 (no Engram): all-gather and reduce-scatter
                   bytes of the core unit and in total. For contrast, the same with a unit per core
                   block (how FSDP is usually applied), whose bytes grow with the loop count.
  float8           FSDP with bf16 parameters, float8 converter, without and with fp8 all-gather:
                   all-gather bytes per unit.
  float8_linears   the same for a stack of converted linears alone, one FSDP unit each (every
                   unit all-float8: the payload moves as uint8): exactly the linear weights' bytes.
  expert_parallel  EP over all ranks (experts split ``world_size`` ways) inside FSDP: all-to-all,
                   all-gather and reduce-scatter bytes per step.
  grad_accum       FSDP with 2 micro-batches per step, fp32: before (gradient sync on every
                   micro-batch, the core resharded after forward) and after (sync on the last
                   micro-batch only, ``fsdp.maybe_no_grad_sync``; the core kept gathered, the default).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lab.cli import check_positive, parser, refuse
from lab.overrides import parse_sets, trainer_flags

SCENARIOS = ("n_loops", "float8", "float8_linears", "expert_parallel", "grad_accum")


def benchmark_comm(args: argparse.Namespace) -> dict:
    """Run the scenarios named by ``args.comm_scenarios`` (default all) and return their bytes."""
    world_size = int(getattr(args, "comm_world_size", None) or 2)
    steps = int(getattr(args, "comm_steps", None) or 2)
    names = getattr(args, "comm_scenarios", None) or ",".join(SCENARIOS)
    scenarios = [s for s in names.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        raise ValueError(f"comm_scenarios: unknown {unknown}; choose from {list(SCENARIOS)}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        torch.multiprocessing.spawn(
            _worker, args=(world_size, str(Path(tmp) / "store"), scenarios, steps, str(out)), nprocs=world_size
        )
        result = json.loads(out.read_text())
    return {"world_size": world_size, "steps": steps, "unit": "bytes per step on rank 0", **result}


def _worker(rank: int, world_size: int, store: str, scenarios: list[str], steps: int, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        result = {name: _RUNNERS[name](world_size, steps) for name in scenarios}
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        # No rank tears its gloo group down while another still talks to it: once seen in CI as
        # "terminate called without an active exception" (SIGABRT) on one rank at exit.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spider_step(
    world_size: int,
    steps: int,
    overrides: dict[str, object],
    *,
    param_dtype: torch.dtype,
    per_block_units: bool = False,
    accum: int = 1,
    no_sync: bool = False,
) -> dict[str, dict[str, int]]:
    """Train the Spider debug flavor ``steps`` steps under FSDP (+ overrides), ``accum`` micro-batches
    a step (gradient sync on the last only with ``no_sync``); the last step's tally."""
    from spider_titan.components.builder import build_model, materialize
    from spider_titan.config.manager import parse_args
    from spider_titan.distributed import clip_grad_norm_
    from spider_titan.parallel.comm_counter import CommCounter
    from spider_titan.parallel.fsdp import apply_fsdp, maybe_no_grad_sync
    from spider_titan.parallel.mesh import ParallelDims
    from spider_titan.parallel.parallelize import apply_parallelism
    from spider_titan.quantization.float8 import build_float8_post_step_hook

    cfg = parse_args(
        trainer_flags({"model.name": "spider", "model.flavor": "debug", "parallelism.comm_counter": True, **overrides}),
        env={"WORLD_SIZE": str(world_size)},
    )
    spec, _, model = build_model(cfg)
    materialize(model, torch.device("cpu"), cfg.training.seed)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    meshes = dims.build_meshes("cpu")
    counter = CommCounter()
    if per_block_units:
        apply_fsdp(
            model,
            meshes["fsdp"],
            units=spec.blocks(model),
            param_dtype=param_dtype,
            reduce_dtype=torch.float32,
            counter=counter,
        )
    else:
        apply_parallelism(
            model,
            spec,
            dims,
            meshes,
            cfg.parallelism,
            param_dtype=param_dtype,
            reduce_dtype=torch.float32,
            counter=counter,
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    post_step = build_float8_post_step_hook(model, cfg.float8)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        for i in range(accum):
            x = torch.randint(0, 256, (2, 65), generator=gen)
            with maybe_no_grad_sync(model, is_last_microbatch=not no_sync or i == accum - 1):
                model(x[:, :-1], labels=x[:, 1:]).loss.backward()
        clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if post_step is not None:
            post_step()
        counter.step()
    return counter.steps[-1]


def _total(tally: dict, kind: str, prefix: str = "") -> int:
    from spider_titan.parallel.comm_counter import step_total

    return step_total(tally, kind, prefix)


def _n_loops(world_size: int, steps: int) -> dict:
    """Without the Engram: the core reads each block's Engram tables once per step, before the blocks run
    (recurrence.engram_memory), which a unit per block would hand over still sharded."""
    out = {}
    for n in (2, 4):
        overrides = {"model.n_loops": n, "model.engram_layers": []}
        loop_unit = _spider_step(world_size, steps, overrides, param_dtype=torch.float32)
        per_block = _spider_step(world_size, steps, overrides, param_dtype=torch.float32, per_block_units=True)
        out[f"n_loops_{n}"] = {
            "core_all_gather": _total(loop_unit, "all_gather", "core"),
            "core_reduce_scatter": _total(loop_unit, "reduce_scatter", "core"),
            "total_all_gather": _total(loop_unit, "all_gather"),
            "total_reduce_scatter": _total(loop_unit, "reduce_scatter"),
            "per_block_units_core_all_gather": _total(per_block, "all_gather", "core.layers"),
            "per_block_units_core_reduce_scatter": _total(per_block, "reduce_scatter", "core.layers"),
        }
    return out


def _float8(world_size: int, steps: int) -> dict:
    base = {"model.converters": ["float8"]}
    bf16 = _spider_step(world_size, steps, base, param_dtype=torch.bfloat16)["all_gather"]
    fp8 = _spider_step(
        world_size, steps, base | {"float8.enable_fsdp_float8_all_gather": True}, param_dtype=torch.bfloat16
    )["all_gather"]
    return {
        "bf16_all_gather": bf16,
        "fp8_all_gather": fp8,
        "ratio_by_unit": {k: round(fp8[k] / bf16[k], 4) for k in bf16},
    }


def _float8_linears(world_size: int, steps: int) -> dict:
    out = {
        name: _linear_stack_all_gather(world_size, steps, fp8_all_gather=on)
        for name, on in (("bf16_all_gather", False), ("fp8_all_gather", True))
    }
    return {**out, "ratio": round(out["fp8_all_gather"] / out["bf16_all_gather"], 4)}


def _linear_stack_all_gather(world_size: int, steps: int, *, fp8_all_gather: bool, dim: int = 256) -> int:
    """All-gather bytes per step of 4 converted linears, one FSDP unit each, bf16 parameters."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    from spider_titan.parallel.comm_counter import CommCounter
    from spider_titan.parallel.fsdp import apply_fsdp
    from spider_titan.parallel.mesh import ParallelDims

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(4)])
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather))
    meshes = ParallelDims(dp_replicate=1, dp_shard=world_size, ep=1, world_size=world_size).build_meshes("cpu")
    counter = CommCounter()
    apply_fsdp(
        model,
        meshes["fsdp"],
        units=list(model.named_children()),
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        counter=counter,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        model(torch.randn(16, dim, generator=gen)).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if fp8_all_gather:
            precompute_float8_dynamic_scale_for_fsdp(model)
        counter.step()
    return _total(counter.steps[-1], "all_gather")


def _expert_parallel(world_size: int, steps: int) -> dict:
    tally = _spider_step(
        world_size, steps, {"parallelism.expert_parallel_degree": world_size}, param_dtype=torch.float32
    )
    return {
        "expert_parallel_degree": world_size,
        "all_to_all": _total(tally, "all_to_all"),
        "all_to_all_by_layer": tally.get("all_to_all", {}),
        "all_gather": _total(tally, "all_gather"),
        "reduce_scatter": _total(tally, "reduce_scatter"),
    }


def _grad_accum(world_size: int, steps: int) -> dict:
    before = _spider_step(
        world_size,
        steps,
        {"parallelism.fsdp_reshard_after_forward_units": "core=true"},
        param_dtype=torch.float32,
        accum=2,
    )
    after = _spider_step(world_size, steps, {}, param_dtype=torch.float32, accum=2, no_sync=True)
    out = {}
    for name, tally in (("before", before), ("after", after)):
        out[name] = {
            "all_gather": _total(tally, "all_gather"),
            "reduce_scatter": _total(tally, "reduce_scatter"),
            "core_all_gather": _total(tally, "all_gather", "core"),
            "core_reduce_scatter": _total(tally, "reduce_scatter", "core"),
        }
        out[name]["total"] = out[name]["all_gather"] + out[name]["reduce_scatter"]
    out["after_over_before"] = round(out["after"]["total"] / out["before"]["total"], 4)
    return out


_RUNNERS = {
    "n_loops": _n_loops,
    "float8": _float8,
    "float8_linears": _float8_linears,
    "expert_parallel": _expert_parallel,
    "grad_accum": _grad_accum,
}


# ------------------------------------------------------------- fixed-capacity expert-parallel dispatch

CAPACITY_FACTORS = (1.0, 1.25, 1.5, 2.0)


def benchmark_ep_capacity(args: argparse.Namespace) -> dict:
    """Expert-parallel all-to-all bytes and dropped pairs per step: dynamic dispatch vs fixed capacity
    at ``CAPACITY_FACTORS``, on the routing of a real training run (``python -m spider_titan.train``:
    debug flavor, built-in corpus, 2 gloo ranks, EP 2, comm counter on). Each mode trains
    ``capacity_steps`` (default 150) steps from the same seed; the figures are means over the second
    half (the segmentation has settled near its target rate by then, so the tokens per call are close
    to what the capacity is planned for), and the last logged loss shows what dropping cost."""
    import subprocess
    import sys

    reduced = getattr(args, "reduced", False)  # the suite's dry run: 4 steps of one 64-byte row, one factor
    steps = int(getattr(args, "capacity_steps", None) or (4 if reduced else 150))
    root = Path(__file__).resolve().parents[2]
    modes = [("dynamic", None)] + [("capacity", f) for f in ((1.25,) if reduced else CAPACITY_FACTORS)]
    overrides = {"training.seq_len": 64, "training.local_batch_size": 1} if reduced else {}
    overrides |= parse_sets(getattr(args, "set", None) or [])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dispatch, factor in modes:
            name = dispatch if factor is None else f"capacity_{factor}"
            dump = Path(tmp) / name
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            cmd += ["-m", "spider_titan.train"]
            cmd += trainer_flags(
                {
                    "job.config_file": "train_configs/debug_model.toml",
                    "parallelism.expert_parallel_degree": 2,
                    "parallelism.comm_counter": True,
                    "parallelism.expert_parallel_dispatch": dispatch,
                    "parallelism.expert_capacity_factor": factor or 1.25,
                    "training.steps": steps,
                    "training.local_batch_size": 4,
                    "metrics.log_freq": 1,
                    "metrics.enable_tensorboard": False,
                    "validation.enable": False,
                    "checkpoint.export_at_end": False,
                    "job.dump_folder": dump,
                    **overrides,
                }
            )
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
            if proc.returncode:
                raise RuntimeError(f"{name}: training failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
            comm = [json.loads(line) for line in (dump / "comm_counts.jsonl").read_text().splitlines()]
            metrics = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
            late = [c for c in comm if c["step"] > steps // 2]
            a2a = [sum(c.get("all_to_all", {}).values()) for c in late]
            dropped = [m.get("moe_dropped_frac", 0.0) for m in metrics if "loss" in m and m["step"] > steps // 2]
            results[name] = {
                "all_to_all_bytes_per_step": round(sum(a2a) / len(a2a)),
                "dropped_pair_fraction": round(sum(dropped) / len(dropped), 4),
                "max_dropped_pair_fraction": round(max(dropped), 4),
                "final_loss": round([m for m in metrics if "loss" in m][-1]["loss"], 4),
                "bytes_per_segment": round(
                    sum(m["bytes_per_segment"] for m in metrics if "loss" in m and m["step"] > steps // 2)
                    / len(dropped),
                    2,
                ),
            }
    base = results["dynamic"]["all_to_all_bytes_per_step"]
    for r in results.values():
        r["bytes_vs_dynamic"] = round(r["all_to_all_bytes_per_step"] / base, 3)
    return {"steps": steps, "ranks": 2, "expert_parallel": 2, "results": results}


def main(argv: list[str] | None = None) -> int:
    """``python -m lab.bench.comm [scenario ...]``: the scenarios' bytes as JSON."""
    prog = "python -m lab.bench.comm"
    p = parser(prog, __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenarios", nargs="*", metavar="scenario", help=f"any of {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--world_size", type=int, default=2, help="gloo processes (default 2)")
    p.add_argument("--steps", type=int, default=2, help="training steps per scenario, the last one counted (default 2)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        raise refuse(prog, f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    check_positive(prog, steps=args.steps)
    if args.world_size < 2:
        raise refuse(prog, f"--world_size {args.world_size}: give at least 2 (collectives need two ranks)")
    chosen = argparse.Namespace(
        comm_scenarios=",".join(args.scenarios), comm_world_size=args.world_size, comm_steps=args.steps
    )
    print(json.dumps(benchmark_comm(chosen), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
