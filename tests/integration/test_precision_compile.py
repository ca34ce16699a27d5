"""fp8 and torch.compile against the plain run, end to end through the trainer (in process)."""

from __future__ import annotations

import pytest
import torch

from spider_titan.config.manager import parse_args
from spider_titan.train import Trainer


def train_losses(args: list[str], steps: int, dump, on_step=None) -> list[float]:
    cfg = parse_args(
        ["--job.config_file", "train_configs/debug_model.toml", "--training.dataset", "mock",
         "--training.steps", str(steps), "--training.seq_len", "128", "--training.local_batch_size", "4",
         "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
         "--job.dump_folder", str(dump), *args],
        env={},
    )
    trainer = Trainer(cfg)
    losses = []
    try:
        for _ in range(steps):
            step = len(losses) + 1
            losses.append(trainer.reduce_metrics(trainer.train_step(trainer.next_micro_batches(), step))["loss"])
            if on_step is not None:
                on_step()
        return losses
    finally:
        trainer.close()


def test_fp8_tracks_high_precision_over_30_steps(tmp_path):
    ref = train_losses([], 30, tmp_path / "hp")
    fp8 = train_losses(["--training.precision", "fp8"], 30, tmp_path / "fp8")
    assert ref[-1] < 0.8 * ref[0]  # it learned something
    assert fp8[-1] == pytest.approx(ref[-1], rel=0.02)


def test_compile_matches_eager_without_recompiling_every_step(tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs = []
    eager = train_losses([], 6, tmp_path / "eager")
    compiled = train_losses(["--training.compile", "true"], 6, tmp_path / "compiled",
                            on_step=lambda: graphs.append(counters["stats"]["unique_graphs"]))
    for step, (a, b) in enumerate(zip(eager, compiled)):
        assert b == pytest.approx(a, rel=1e-4), (step, eager, compiled)
    # Spider's segment count changes every batch: after one recompile with it symbolic, later
    # steps reuse the graphs (no growth over the last steps).
    assert graphs[0] > 0
    assert graphs[2] == graphs[-1], graphs
