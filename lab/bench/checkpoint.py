"""Checkpoint I/O benchmark: save / load time and size of full checkpoints and exports.

For every registered model:

* ``debug`` is measured: the model is built and initialised with AdamW state, then a full
  checkpoint (model + optimizer + lr scheduler + RNG) is saved, committed and loaded through the
  :class:`~spider_titan.checkpoint.manager.Checkpointer` ``REPEATS`` times (median), an async save
  is timed for the part that blocks training, and the safetensors export is written.
* ``1B`` is estimated: sizes from a model built on the meta device (fp32 weights + two fp32
  AdamW moments per parameter; export = weights in bf16), times = size / the DCP write and read
  bandwidth measured in this process on a probe of 1B-sized tensors (``PROBE_MIB``).

Loads read files just written, so they come from the page cache: a lower bound on a cold read.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from spider_titan import registry
from spider_titan.checkpoint.manager import (
    SINGLE_PROCESS_NOTICE,
    Checkpointer,
    ModelIdentity,
    ModelState,
    OptimizerState,
    RNGState,
)
from spider_titan.components.builder import materialize
from spider_titan.job_config import Checkpoint, LRScheduler, Optimizer
from spider_titan.optim.lr_schedulers import build_lr_scheduler, cosine_decay

REPEATS = 3
PROBE_MIB = 256


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def probe_bandwidth(folder: Path, mib: int = PROBE_MIB) -> dict[str, float]:
    """DCP write and read MB/s on ``mib`` MiB of (2048, 2048) fp32 tensors (a 1B model's matrix size)."""
    n = mib // 16
    tensors = {f"w{i}": torch.randn(2048, 2048) for i in range(n)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_NOTICE)
        t0 = time.perf_counter()
        dcp.save(tensors, checkpoint_id=str(folder), no_dist=True)
        write_s = time.perf_counter() - t0
        target = {k: torch.empty_like(v) for k, v in tensors.items()}
        t0 = time.perf_counter()
        dcp.load(target, checkpoint_id=str(folder), no_dist=True)
        read_s = time.perf_counter() - t0
    shutil.rmtree(folder)
    return {
        "mb": round(nbytes / 1e6, 1),
        "write_mb_s": round(nbytes / 1e6 / write_s, 1),
        "read_mb_s": round(nbytes / 1e6 / read_s, 1),
    }


def measure(name: str, flavor: str, root: Path, repeats: int = REPEATS) -> dict[str, Any]:
    """Save / load / async / export timings and sizes of one flavor, built for real."""
    spec = registry.get("model", name)
    margs = spec.build_args(flavor)
    model = spec.build_on_meta(margs)
    materialize(model, torch.device("cpu"), seed=0)
    optimizer = registry.get("optimizer", "AdamW")(model, Optimizer())
    states = {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, optimizer),
        "lr_scheduler": build_lr_scheduler(optimizer, LRScheduler(), 100, cosine_decay),
        "rng": RNGState(),
    }
    states["optimizer"].state_dict()  # creates the AdamW moments (a zero-lr step), as after training
    cfg = Checkpoint(enable=True, folder=f"{name}_{flavor}", keep_latest_k=1)
    identity = ModelIdentity.of(name, flavor, margs)
    ckpt = Checkpointer(cfg, states=states, identity=identity, dump_folder=root)

    save_s, load_s, async_block_s, async_total_s = [], [], [], []
    for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        ckpt.save(step)
        save_s.append(time.perf_counter() - t0)
        loader = Checkpointer(
            dataclasses.replace(cfg, load_step=step), states=states, identity=identity, dump_folder=root
        )
        t0 = time.perf_counter()
        loader.load()
        load_s.append(time.perf_counter() - t0)
    size = _folder_bytes(root / cfg.folder / f"step-{repeats}")
    for step in range(repeats + 1, 2 * repeats + 1):
        t0 = time.perf_counter()
        ckpt.save(step, asynchronous=True)
        async_block_s.append(time.perf_counter() - t0)
        ckpt.wait()
        async_total_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    ckpt.export(root / f"{name}_{flavor}_export")
    export_s = time.perf_counter() - t0
    export_size = _folder_bytes(root / f"{name}_{flavor}_export")
    return {
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
        "checkpoint_mb": round(size / 1e6, 2),
        "save_s": round(statistics.median(save_s), 4),
        "load_s": round(statistics.median(load_s), 4),
        "async_save_blocking_s": round(statistics.median(async_block_s), 4),
        "async_save_total_s": round(statistics.median(async_total_s), 4),
        "export_fp32_mb": round(export_size / 1e6, 2),
        "export_s": round(export_s, 4),
    }


def estimate(name: str, flavor: str, bandwidth: dict[str, float]) -> dict[str, Any]:
    """Checkpoint and export sizes of a flavor built on meta, and times at the probe's bandwidth."""
    spec = registry.get("model", name)
    model = spec.build_on_meta(spec.build_args(flavor))
    n = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for _, b in model.named_buffers() if b is not None)
    checkpoint_bytes = 12 * n + buffers  # fp32 weights + AdamW exp_avg and exp_avg_sq
    return {
        "estimated": True,
        "params_m": round(n / 1e6, 1),
        "checkpoint_gb": round(checkpoint_bytes / 1e9, 2),
        "save_s": round(checkpoint_bytes / 1e6 / bandwidth["write_mb_s"], 1),
        "load_s": round(checkpoint_bytes / 1e6 / bandwidth["read_mb_s"], 1),
        "export_bf16_gb": round(2 * n / 1e9, 2),
    }


def benchmark_checkpoint_io(args) -> dict[str, Any]:
    """The ``checkpoint_io`` scenario of lab/bench/benchmark.py; works under ``args.dump_folder`` (``args.reduced``:
    a 16 MiB probe and one save and load each, the suite's dry run)."""
    reduced = getattr(args, "reduced", False)
    root = Path(args.dump_folder) / "checkpoint_io"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    try:
        probe = probe_bandwidth(root / "probe", mib=16 if reduced else PROBE_MIB)
        results: dict[str, Any] = {"probe": probe}
        for name in registry.names("model"):
            debug = measure(name, "debug", root, repeats=1 if reduced else REPEATS)
            results[name] = {"debug": debug, "1B": estimate(name, "1B", probe)}
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)
