"""torch.compile meets a bounded set of core shapes: 50 compiled steps at seq 1024, recompiles counted.

The debug flavor with ``segment_bucket = 64``, one 1024-byte row per step, every block compiled
(inductor on CPU, ``fullgraph=True``). The learned segmentation moves the segment count every step
(measured: 45 distinct counts in 50 steps, 67..312); the bucket rounds it to a few core shapes
(measured: 4, 128..320) and the core marks S dynamic (recurrence.py), so dynamo compiles one graph
per block structure (byte block, core block with and without Engram: 3) and recompiles none
(measured 0 recompiles with the bucket and 0 without: with S dynamic the bucket bounds the shapes
that cuDNN attention and the inductor kernels see at run time, not the graphs). Runtime: ~26 s
with a warm inductor cache, ~105 s cold on the 2-core CPU machine (compiling is most of it), so
the test is marked ``slow``; docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import logging

import pytest
import torch

BUCKET, SEQ, STEPS = 64, 1024, 50


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def dynamo_recompile_log():
    """Fresh dynamo caches and counters; yields the messages of dynamo's recompile log."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    handler = _Messages()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()


@pytest.mark.slow
def test_fifty_compiled_steps_at_seq_1024_recompile_at_most_twice(in_process, tmp_path, dynamo_recompile_log):
    from spider_titan.config.manager import parse_args
    from spider_titan.train import Trainer

    argv = [
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--training.dataset",
        "mock",
        "--training.steps",
        str(STEPS),
        "--training.seq_len",
        str(SEQ),
        "--training.local_batch_size",
        "1",
        "--training.compile",
        "true",
        "--model.max_seq_len",
        str(SEQ),
        "--model.segment_bucket",
        str(BUCKET),
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.enable_jsonl",
        "false",
        "--checkpoint.export_at_end",
        "false",
        "--job.dump_folder",
        str(tmp_path),
    ]
    trainer = Trainer(parse_args(argv, env={}))
    core_shapes, flops = set(), set()
    trainer.run.model.core.register_forward_pre_hook(
        lambda m, args, kwargs: core_shapes.add(args[0].shape[1]), with_kwargs=True
    )
    try:
        for step in range(1, STEPS + 1):
            metrics = trainer.train_step(trainer.next_micro_batches(), step)
            flops.add(float(metrics["aux.flops_per_byte"]))  # follows the unpadded segment count
    finally:
        trainer.close()
    recompiles = [m for m in dynamo_recompile_log if m.startswith("Recompiling function")]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert len(flops) > 10  # the segment count really moved from step to step
    assert len(core_shapes) <= SEQ // BUCKET and all(s % BUCKET == 0 for s in core_shapes), core_shapes
    assert len(recompiles) <= 2, recompiles
    assert graphs <= 3 + 2, graphs  # one per block structure, plus those recompiles
