"""Host syncs per training step of the 1B configs, at reduced width (issue 22, item 3).

The configs keep their structure (prelude / core / coda blocks, loops, experts, top-k, gradient
accumulation, AC mode, load balancing) at tiny widths and sequence length, run eager on CPU with
the torch MoE backend (the Triton backend runs in Triton's interpreter on CPU, whose numpy copies
are the interpreter's, not the GPU path's; both backends build the same routing map with no host
read), and count the calls that would wait on a GPU with tests/sync_counter.py over one step.

* spider_1b with dynamic shapes (``model.segment_capacity 0``): at most one per micro-batch, the segment
  count of the learned segmentation (models/spider/segmentation.py, ``S = int(n_segments.max())``),
  which sizes the core's tensors; none with a segment capacity (a fixed number of segment slots per
  row), as spider_1b and spider_1b_1gpu ship it.
* spider_1b_fp8_fsdp_ep (2 gloo ranks, EP 2; static segment shapes as shipped): one read per
  expert-parallel dispatch (the split sizes of the token all-to-all, parallel/expert_parallel.py):
  n_core x n_loops per micro-batch; an activation-checkpoint recompute replays the forward's, it does
  not read again. With ``parallelism.expert_parallel_dispatch = "capacity"`` (static split sizes) none.

The one exception allowed: moe/base.py's range check of the routing indices takes a readable
ValueError branch on CPU only; on a GPU the same line is ``torch._assert_async`` (no sync).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.sync_counter import SyncCounter
from tests.utils import tiny_run

# The 1B configs shrunk to a CPU step: the tiny run's data and batch on the config's own layout
# (its steps and log frequency kept: how often a step logs decides what it reads back).
SMALL = dict(
    model__dim=64,
    model__n_heads=2,
    model__kv_lora_rank=24,
    model__qk_nope_head_dim=16,
    model__qk_rope_head_dim=8,
    model__v_head_dim=16,
    model__inter_dim=64,
    model__moe_inter_dim=32,
    model__engram_buckets=64,
    model__engram_dim=16,
    training__steps=None,
    metrics__log_freq=None,
    training__local_batch_size=1,
    training__device="cpu",
    training__compile=False,
    training__num_workers=0,
    moe__backend="torch",
    checkpoint__enable=False,
)
CPU_ONLY_CHECK = "spider_titan/moe/base.py"  # the CPU branch of check_topk_idx (see the docstring)
SEGMENT_COUNT = "spider_titan/models/spider/segmentation.py"
EP_SPLITS = "spider_titan/parallel/expert_parallel.py"


def count_one_step(config: str, dump: Path, extra: tuple[str, ...] = ()) -> tuple[Counter, int, int]:
    """Sync sites over the second training step (the first warms up), the micro-batches per step
    and the loops x core blocks of the config."""
    from spider_titan.config.manager import parse_args
    from spider_titan.train import Trainer

    argv = [*tiny_run(job__config_file=f"train_configs/{config}", **SMALL), *extra, "--job.dump_folder", str(dump)]
    cfg = parse_args(argv)
    trainer = Trainer(cfg)
    try:
        trainer.train_step(trainer.next_micro_batches(), 1)
        with SyncCounter() as counter:
            trainer.train_step(trainer.next_micro_batches(), 2)
        args = trainer.run.model_args
        return counter.sites, cfg.training.gradient_accumulation_steps, args.n_core * args.n_loops
    finally:
        trainer.close()


def by_file(sites: Counter) -> Counter:
    out = Counter()
    for site, n in sites.items():
        out[site.split(":")[0]] += n
    return out


DYNAMIC = ("--model.segment_capacity", "0", "--model.packed_capacity", "0")  # the segments counted per batch


def test_spider_1b_with_dynamic_shapes_reads_only_the_segment_count(tmp_path, in_process):
    sites, micro_batches, _ = count_one_step("spider_1b.toml", tmp_path / "run", DYNAMIC)
    print("\nspider_1b, syncs in one step:", dict(sites))
    files = by_file(sites)
    assert set(files) <= {SEGMENT_COUNT, CPU_ONLY_CHECK}, sites
    assert files[SEGMENT_COUNT] == micro_batches == 1  # the config takes one micro-batch per step


@pytest.mark.parametrize(
    "config, overrides",
    [
        ("spider_1b.toml", ("--model.segment_capacity", "1.5", "--model.packed_capacity", "0")),
        ("spider_1b.toml", ()),  # as shipped: slots, and the core packed
        ("spider_1b_1gpu.toml", ("--training.cuda_graph", "false")),  # a CUDA graph needs CUDA
    ],
    ids=["slots", "packed", "1gpu_config"],
)
def test_spider_1b_with_a_segment_capacity_reads_nothing(tmp_path, in_process, config, overrides):
    """``model.segment_capacity`` (static shapes), on every slot or packed into a fixed number of
    positions (``packed_capacity``), as the 1B configs ship them: not even the segment count is read
    back."""
    sites, micro_batches, _ = count_one_step(config, tmp_path / "run", overrides)
    print("\n", config, "with", overrides, "syncs in one step:", dict(sites))
    assert set(by_file(sites)) <= {CPU_ONLY_CHECK}, sites


def _ep_worker(rank: int, store: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    counts = {}
    for dispatch in ("dynamic", "capacity"):
        # (the trainer's close() ends the process group, so each run starts its own)
        dist.init_process_group("gloo", init_method=f"file://{store}.{dispatch}", rank=rank, world_size=2)
        # EP 2 on 2 ranks (the config's 4 needs 8); everything else as configured
        extra = ("--parallelism.expert_parallel_degree", "2", "--parallelism.expert_parallel_dispatch", dispatch)
        sites, micro_batches, dispatches = count_one_step("spider_1b_fp8_fsdp_ep.toml", Path(out) / dispatch, extra)
        counts[dispatch] = {"sites": dict(sites), "micro_batches": micro_batches, "dispatches": dispatches}
    if rank == 0:
        torch.save(counts, Path(out) / "c.pt")


@pytest.mark.slow
def test_expert_parallel_config_reads_once_per_dynamic_dispatch_and_never_with_capacity(tmp_path):
    """Dynamic dispatch: one read per dispatch. Fixed-capacity dispatch: none. The segment count is never
    read (the config's static segment shapes)."""
    mp.spawn(_ep_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    counts = torch.load(tmp_path / "c.pt")
    for dispatch, got in counts.items():
        sites = Counter(got["sites"])
        print(f"\nspider_1b_fp8_fsdp_ep (EP 2, rank 0, {dispatch} dispatch), syncs in one step:", dict(sites))
        files = by_file(sites)
        if dispatch == "dynamic":
            assert set(files) <= {EP_SPLITS, CPU_ONLY_CHECK}, sites
            assert files[EP_SPLITS] == got["micro_batches"] * got["dispatches"]
        else:
            assert set(files) <= {CPU_ONLY_CHECK}, sites
