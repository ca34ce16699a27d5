"""scripts/segment_capacity.py: the capacity it reports is the least that drops no segment of the
batches it measured, per row (``model.segment_capacity``) and packed per batch (``packed_capacity``)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from spider_titan.models.spider.args import SPIDER_FLAVORS
from spider_titan.models.spider.model import Spider
from tests.distributed.test_parallelism import COMMON
from tests.unit.test_spider_packing import ragged_ids
from tests.utils import REPO, check_ok, run_train


def test_the_capacity_it_measures_is_the_least_that_drops_nothing(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from segment_capacity import capacity_needed, summary

    args = SPIDER_FLAVORS["debug"]
    torch.manual_seed(0)
    model = Spider(args)
    model.init_weights()
    model.eval()
    ids = ragged_ids()  # rows whose segment counts differ several-fold
    B, T = ids.shape
    need = capacity_needed(model, [ids])
    rows, packed = max(need["rows"]), need["batches"][0]
    assert len(need["rows"]) == B and min(need["rows"]) < rows / 2, need  # one value per row, and they differ
    assert summary(need)["rows"]["q1"] == rows

    def dropped(**capacities) -> float:
        capped = Spider(dataclasses.replace(args, **capacities))
        capped.load_state_dict(model.state_dict())
        capped.eval()
        with torch.no_grad():
            return capped(ids).aux["segments_dropped"].item()

    one_slot = args.target_bytes_per_segment / T  # in capacity units: one slot less per row
    assert dropped(segment_capacity=rows) == 0.0
    assert dropped(segment_capacity=rows - one_slot) > 0.0
    assert dropped(segment_capacity=rows, packed_capacity=packed) == 0.0
    assert dropped(segment_capacity=rows, packed_capacity=packed - 1.5 * one_slot / B) > 0.0


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
