"""The plan (spider_titan/plan.py) against real runs: the same config at debug size on 1, 2 and 4 gloo
ranks runs one real training step (the Trainer's own train_step, with the CommCounter on), and its
parameter bytes, optimizer-state bytes and collective bytes must equal what the plan says within 5 %.

The plan reads its sizes from the real parallelize applied under a fake process group; these runs
apply it under gloo to materialised weights and count what the collectives actually move.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spider_titan.config.manager import parse_args
from spider_titan.parallel.comm_counter import read_comm_counts
from spider_titan.parallel.fsdp import device_memory_bytes
from spider_titan.plan import GIB, PlanOptions, local_bytes, make_plan

BASE = [
    "--model.name",
    "spider",
    "--model.flavor",
    "debug",
    "--training.dataset",
    "mock",
    "--training.seq_len",
    "64",
    "--training.steps",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.enable_jsonl",
    "false",
    "--validation.enable",
    "false",
    "--parallelism.comm_counter",
    "true",
    # CPU runs keep parameters and reductions in fp32 (builder.precision_dtypes): plan the same
    "--training.mixed_precision_param",
    "float32",
    "--training.mixed_precision_reduce",
    "float32",
]

LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "2"]),
    "fsdp2_accum2": (2, ["--training.local_batch_size", "2", "--training.gradient_accumulation_steps", "2"]),
    "hsdp2x2_recurrent_ac": (
        4,
        [
            "--training.local_batch_size",
            "1",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--activation_checkpoint.mode",
            "recurrent",
        ],
    ),
}


def _measure(rank: int, world_size: int, store: str, argv: list[str], out: str) -> None:
    """One real train step; rank 0 writes what it measured to ``out`` (JSON)."""
    from spider_titan.train import Trainer

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    trainer = Trainer(parse_args(argv, env={"WORLD_SIZE": str(world_size)}))
    try:
        trainer.train_step(trainer.next_micro_batches(), 1)
        run = trainer.run
        params = sum(local_bytes(run.model.parameters()).values())
        opt_state = sum(
            sum(local_bytes([v]).values())
            for state in run.optimizer.state.values()
            for k, v in state.items()
            if k != "step"
        )
        if rank == 0:
            Path(out).write_text(json.dumps({"parameters": params, "optimizer": opt_state}))
        if world_size > 1:
            dist.barrier()
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_matches_a_real_step(name, tmp_path, monkeypatch):
    nprocs, extra = LAYOUTS[name]
    argv = BASE + extra + ["--job.dump_folder", str(tmp_path / "run")]
    out = tmp_path / "measured.json"
    if nprocs == 1:
        monkeypatch.setenv("WORLD_SIZE", "1")
        _measure(0, 1, "", argv, str(out))
    else:
        store = tempfile.mktemp(dir=tmp_path)
        mp.spawn(_measure, args=(nprocs, store, argv, str(out)), nprocs=nprocs, join=True)
    measured = json.loads(out.read_text())
    counts = read_comm_counts(tmp_path / "run" / "comm_counts.jsonl") if nprocs > 1 else [{}]
    step = counts[-1]

    # the real CPU run decides "keep the core gathered" from the host's memory: plan with the same
    host = device_memory_bytes(torch.device("cpu")) / GIB
    plan = make_plan(parse_args(argv, env={"WORLD_SIZE": str(nprocs)}), PlanOptions(ngpu=nprocs, gpu_memory_gib=host))

    assert plan.memory["parameters"] == pytest.approx(measured["parameters"], rel=0.05)
    assert plan.optimizer_bytes == pytest.approx(measured["optimizer"], rel=0.05)
    for kind in ("all_gather", "reduce_scatter"):
        planned, real = plan.comm.get(kind, {}), step.get(kind, {})
        assert set(planned) == set(real), (kind, sorted(planned), sorted(real))
        for tag in real:
            assert planned[tag] == pytest.approx(real[tag], rel=0.05), (kind, tag)
    if nprocs == 1:
        assert plan.comm == {}
    else:  # the comparison above saw real traffic: every unit and the root, gathered and reduced
        assert len(step["all_gather"]) == len(step["reduce_scatter"]) > 2
