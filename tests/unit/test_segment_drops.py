"""A capacity that drops segments says so: the trainer's warning on a sustained share of dropped segments
(training/health.py DropWatch), and a run whose ``model.segment_capacity`` is too small."""

from __future__ import annotations

import logging

import pytest

from tests.distributed.test_parallelism import COMMON
from tests.utils import check_ok, run_train


def test_drops_warn_on_a_sustained_mean_once_and_again_when_it_doubles(caplog):
    from spider_titan.training.health import DropWatch

    watch = DropWatch("the capacity")
    # one dense batch does not warn; a median over 1 % does, once; again only when the median doubles
    shares = [0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.02, 0.02, 0.02, 0.02, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07]
    with caplog.at_level(logging.WARNING, logger="spider_titan"):
        warned = [step for step, share in enumerate(shares, 1) if watch.log_step(step, share)]
    assert warned == [9, 16], warned  # medians 0.02 at step 9, then 0.05 > 2 x 0.02 at step 16
    assert watch.log_step(17, None) is False  # no capacity, nothing to watch
    assert "dropped a median 2.0 % of the segments at the last 5 logged steps" in caplog.records[0].getMessage()


@pytest.mark.parametrize("capacity, warns", [(0.5, True), (4.0, False)])
def test_a_run_whose_capacity_drops_segments_says_so(tmp_path, capacity, warns):
    """Half a slot per expected segment: the trainer warns, naming the share dropped; 4 slots: silent."""
    # COMMON: the debug model on mock data, 5 steps of 64 bytes, each logged
    args = COMMON + ["--model.segment_capacity", str(capacity), "--checkpoint.export_at_end", "false"]
    args += ["--job.dump_folder", str(tmp_path)]
    proc = run_train(args)
    check_ok(proc)
    said = "of the segments at the last 5 logged steps" in proc.stdout + proc.stderr
    assert said == warns, proc.stderr[-3000:]
