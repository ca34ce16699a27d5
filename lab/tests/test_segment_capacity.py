"""lab/analysis/segment_capacity.py: the capacity it reports is the least that drops no segment of the
batches it measured, per row (``model.segment_capacity``) and packed per batch (``packed_capacity``)."""

from __future__ import annotations

import dataclasses

import torch

from spider_titan.models.spider.args import SPIDER_FLAVORS
from spider_titan.models.spider.model import Spider
from tests.unit.test_spider_packing import ragged_ids


def test_the_capacity_it_measures_is_the_least_that_drops_nothing():
    from lab.analysis.segment_capacity import capacity_needed, summary

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
