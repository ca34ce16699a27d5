"""torch.compile across a whole segmentation trajectory at seq 4096: no recompile after warm-up.

The debug flavor at two core loops, one 4096-byte row per step, every block compiled (inductor on CPU,
``fullgraph=True``). The boundary predictor's threshold
is set before each step so the batch's bytes per segment walk from the 16-byte length cap down to
~3 and back up (the path a run takes from an untrained predictor to its target rate, and the
swings after); the optimizer step moves it only a little. The segment count S is marked dynamic
(recurrence.py), so after the first two steps (the first compiles, the second meets a new S) dynamo
must not compile again, whatever S is. The last step is profiled: the kernels a GPU would launch
for it (lab/bench/launches.py's count) stay under a stated bound.
"""

from __future__ import annotations

import logging

import pytest
import torch

SEQ = 4096
# standardised-score thresholds: 8 (no predicted boundary: the cap) down to < 3 bytes/segment and back
# (measured: 15.6, 9.2, 4.4, 2.7, 1.8, 3.3, 15.7 bytes per segment)
THRESHOLDS = [8.0, 0.4, 0.3, 0.2, 0.1, 0.3, 8.0]
WARMUP = 2
LAUNCH_BOUND = 925  # kernels a GPU would launch for one step of this config: 893 measured, 2026-11-29
GRAPHED_BOUND = 60  # of those, outside the forward-backward a CUDA graph replays: 38 measured, 2026-11-27


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
def test_no_recompile_after_warmup_from_the_cap_down_to_3_bytes_and_back(
    in_process, tmp_path, dynamo_recompile_log, monkeypatch
):
    from lab.bench.launches import count_launches, host_events, outside_forward_backward
    from spider_titan.config.manager import parse_args
    from spider_titan.train import Trainer

    argv = [
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--training.dataset",
        "mock",
        "--training.steps",
        str(len(THRESHOLDS)),
        "--training.seq_len",
        str(SEQ),
        "--training.local_batch_size",
        "1",
        "--training.compile",
        "true",
        "--model.max_seq_len",
        str(SEQ),
        "--model.n_loops",  # two loops, as measured before debug trained one: the regions between loops too
        "2",
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.enable_jsonl",
        "false",
        "--optimizer.implementation",  # what `auto` takes on a GPU: the launch count is a GPU's
        "fused",
        "--checkpoint.export_at_end",
        "false",
        "--job.dump_folder",
        str(tmp_path),
    ]
    # the generated kernels record themselves, so the profiled last step counts them (lab/bench/gpu.py); by
    # config.patch, since undoing a monkeypatch deletes the option from inductor's config for later tests
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        trainer = Trainer(parse_args(argv, env={}))
        threshold = trainer.run.model.boundary_predictor.threshold
        rates, after_warmup = [], None
        try:
            for step, value in enumerate(THRESHOLDS, start=1):
                with torch.no_grad():
                    threshold.fill_(value)
                if step < len(THRESHOLDS):
                    metrics = trainer.train_step(trainer.next_micro_batches(), step)
                else:  # the last step profiled: what a GPU would launch (lab/bench/launches.py's count)
                    batches = trainer.next_micro_batches()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                        metrics = trainer.train_step(batches, step)
                    host = host_events(prof)
                    launches, ops = count_launches(host)
                    graphed = outside_forward_backward(host, ops)
                rates.append(float(metrics["aux.bytes_per_segment"]))
                if step == WARMUP:
                    after_warmup = len(dynamo_recompile_log)
        finally:
            trainer.close()
    print("\nlaunches per step:", launches)
    # What a GPU would launch for this step (lab.bench.launches.count_launches): 893 measured (508 ops outside
    # compiled code, 385 inside 16 compiled regions, the boundary predictor's and the byte n-grams' forward
    # and backward four of them; torch 2.13 CPU inductor), docs/benchmarks.md.
    assert launches["regions"] == 16 and launches["launched"] <= LAUNCH_BOUND, launches
    # With training.cuda_graph the forward-backward is one graph launch; the host still launches the
    # clipping, optimizer, hooks and metrics outside it.
    print("launches outside the forward-backward:", graphed)
    assert graphed <= GRAPHED_BOUND, graphed
    print("\nbytes per segment, step by step:", [round(r, 1) for r in rates])
    low = min(range(len(rates)), key=rates.__getitem__)
    assert rates[0] > 12 and rates[-1] > 12, rates  # the cap at both ends
    assert rates[low] < 3.2 and 0 < low < len(rates) - 1, rates  # ~3 bytes per segment in between
    # the walk followed the thresholds: down to the lowest, then up again
    assert all(b <= a + 0.5 for a, b in zip(rates[:low], rates[1 : low + 1])), rates
    assert all(b >= a - 0.5 for a, b in zip(rates[low:], rates[low + 1 :])), rates
    recompiles = [m for m in dynamo_recompile_log[after_warmup:] if m.startswith("Recompiling function")]
    assert recompiles == [], recompiles
