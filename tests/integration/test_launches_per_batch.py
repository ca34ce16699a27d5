"""What a step launches does not grow with the micro-batch (issue 39).

A step that waits on its host (no CUDA graph: every multi-GPU run) costs about as many host
launches per micro-batch whatever the micro-batch holds, so a larger micro-batch buys more bytes per
launch; the shipped 8-GPU configs rely on that (docs/benchmarks.md). The debug flavor with static
shapes (64-byte rows), eager, one profiled step at 2 and at 8 rows: the kernels a GPU would launch
(lab/bench/launches.py's count) must be the same. The control computes one part row by row, as a
Python loop over samples would, and its count grows with the rows.
"""

from __future__ import annotations

import torch

from spider_titan.models.spider.segmentation import Chunker
from tests.utils import tiny_run


def _launches(tmp_path, batch: int) -> int:
    from lab.bench.launches import count_launches, host_events
    from spider_titan.config.manager import parse_args
    from spider_titan.train import Trainer

    argv = tiny_run(
        training__local_batch_size=batch,
        training__steps=2,
        model__segment_capacity=2.0,
        model__packed_capacity=1.5,
        optimizer__implementation="fused",  # what `auto` takes on a GPU
        metrics__enable_jsonl=False,
        job__dump_folder=tmp_path / f"batch{batch}",
    )
    trainer = Trainer(parse_args(argv, env={}))
    try:
        trainer.train_step(trainer.next_micro_batches(), 1)
        batches = trainer.next_micro_batches()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            trainer.train_step(batches, 2)
        return count_launches(host_events(prof))[0]["launched"]
    finally:
        trainer.close()


def test_launches_per_step_do_not_grow_with_the_micro_batch(in_process, tmp_path, monkeypatch):
    counts = {batch: _launches(tmp_path, batch) for batch in (2, 8)}
    print("\nlaunches per step by micro-batch rows:", counts)
    assert counts[2] == counts[8], counts

    # the control: the Engram ids gathered row by row, a Python loop over samples (one op per row)
    engram_ids = Chunker.engram_ids

    def row_by_row(self, input_ids, seg):
        return torch.stack([row + 0 for row in engram_ids(self, input_ids, seg).unbind(0)])

    monkeypatch.setattr(Chunker, "engram_ids", row_by_row)
    control = {batch: _launches(tmp_path / "control", batch) for batch in (2, 8)}
    print("launches with a loop over rows:", control)
    assert control[8] > control[2], control
