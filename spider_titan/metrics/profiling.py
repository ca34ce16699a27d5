"""Profiles of chosen training steps: torch.profiler traces and, on CUDA, an allocator memory snapshot.

``[profiling]`` picks the window: the step before ``start_step`` warms the profiler up, steps
``start_step .. start_step + active_steps - 1`` are recorded, and one trace per rank is written to
``<dump_folder>/<save_traces_folder>/rank<r>.<time>.pt.trace.json`` by torch's TensorBoard handler:
the Chrome trace format, which chrome://tracing, https://ui.perfetto.dev and TensorBoard's profiler
plugin all open. With ``enable_memory_snapshot`` on a CUDA run, the caching allocator records every
allocation (with its stack) from the start, and after ``memory_snapshot_step`` its history is dumped
to ``rank<r>_step<n>_memory_snapshot.pickle`` (drag it onto https://pytorch.org/memory_viz).

The train loop enters :func:`maybe_profile` around its loop and calls ``.step()`` after each step;
outside the window that is a counter increment, no sync and no recording.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from spider_titan.job_config import Profiling

logger = logging.getLogger("spider_titan")

# allocations the CUDA allocator remembers for the snapshot (torchtitan's default)
MEMORY_HISTORY_ENTRIES = 100_000


class StepProfiler:
    """Drives a torch.profiler window and the memory snapshot by the training step number."""

    def __init__(self, cfg: Profiling, folder: Path, rank: int, first_step: int, device_type: str):
        self.cfg = cfg
        self.folder = folder
        self.rank = rank
        self.step_num = first_step - 1  # the step that last finished
        self.profiler: torch.profiler.profile | None = None
        self.snapshot = cfg.enable_memory_snapshot and device_type == "cuda" and cfg.memory_snapshot_step >= first_step
        if cfg.enable_memory_snapshot and device_type != "cuda":
            logger.info(
                "profiling: memory snapshot skipped (the CUDA caching allocator records it; this run is on %s)",
                device_type,
            )
        if cfg.enable_profiling:
            if cfg.start_step < first_step:
                logger.info(
                    "profiling: the trace window starts at step %d, before this run's first step %d; no trace",
                    cfg.start_step,
                    first_step,
                )
            else:
                self.profiler = self._start_profiler(first_step, device_type)

    def _start_profiler(self, first_step: int, device_type: str) -> torch.profiler.profile:
        cfg = self.cfg
        warmup = 1 if cfg.start_step > first_step else 0
        wait = cfg.start_step - first_step - warmup
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.folder.mkdir(parents=True, exist_ok=True)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=cfg.active_steps, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}"),
            record_shapes=True,
        )
        profiler.start()
        logger.info(
            "profiling: steps %d-%d traced to %s", cfg.start_step, cfg.start_step + cfg.active_steps - 1, self.folder
        )
        return profiler

    def start_memory_history(self) -> None:
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    def step(self) -> None:
        """After each training step."""
        self.step_num += 1
        if self.profiler is not None:
            self.profiler.step()
        if self.snapshot and self.step_num == self.cfg.memory_snapshot_step:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"rank{self.rank}_step{self.step_num}_memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot = False
            logger.info("profiling: memory snapshot of step %d written to %s", self.step_num, path)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()  # a window cut short by the end of training is still written
            self.profiler = None
        if self.snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot = False


@contextmanager
def maybe_profile(
    cfg: Profiling, dump_folder: Path, rank: int, *, first_step: int = 1, device_type: str = "cpu"
) -> Iterator[StepProfiler | None]:
    """A :class:`StepProfiler` for the window ``cfg`` asks for, or None when profiling and the
    memory snapshot are both off. ``first_step``: the step the loop starts at (a resumed run's)."""
    if not (cfg.enable_profiling or cfg.enable_memory_snapshot):
        yield None
        return
    profiler = StepProfiler(cfg, Path(dump_folder) / cfg.save_traces_folder, rank, first_step, device_type)
    profiler.start_memory_history()
    try:
        yield profiler
    finally:
        profiler.close()
