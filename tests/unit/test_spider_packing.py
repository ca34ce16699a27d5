"""``pack_segments`` (attention.PackedRows, recurrence.CoreBlock): the core's per-segment work on the
batch's real segments only. The reference is the padded core (``pack_segments = false``): same
weights, same bytes, the same logits, loss and gradients up to rounding; fewer FLOPs, counted by
FlopCounterMode and by ``aux["flops_per_byte"]`` alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spider_titan.models.spider.args import SPIDER_FLAVORS
from spider_titan.models.spider.attention import PackedRows
from spider_titan.models.spider.model import Spider
from spider_titan.vocab import PAD_ID
from tests.unit.test_spider_model import build, sample_ids
from tests.unit.test_spider_params_flops import measured_train_flops


def ragged_ids() -> torch.Tensor:
    """Two rows whose space-rule segment counts differ ~4x: row 0 a space every other byte, row 1 none
    (cut by the length cap only), row 2 half PAD."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(ord("a"), ord("z") + 1, (3, 128), generator=g)
    ids[0, 1::2] = ord(" ")
    ids[2, 64:] = PAD_ID
    return ids


def test_packed_rows_pack_and_unpack():
    valid = torch.tensor([[True, True, False], [True, False, False]])
    p = PackedRows.of(valid, 3)
    assert p.index.tolist() == [0, 1, 3]
    x = torch.arange(6.0).view(2, 3, 1)
    assert p.pack(x).flatten().tolist() == [0.0, 1.0, 3.0]
    assert p.pad(p.pack(x)).flatten().tolist() == [0.0, 1.0, 0.0, 3.0, 0.0, 0.0]
    assert p.unpack(-p.pack(x), x).flatten().tolist() == [0.0, -1.0, 2.0, -3.0, 4.0, 5.0]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"boundary_predictor": "space", "chunk_convention": "mean"}, {"halting": "act", "n_loops": 3}],
    ids=["default", "space_mean", "act"],
)
def test_packed_core_equals_padded_core(overrides):
    """Logits and loss in training and eval, and every parameter's gradient, as the padded core's."""
    packed, padded = build(**overrides), build(pack_segments=False, **overrides)
    padded.load_state_dict(packed.state_dict())
    for ids in (sample_ids(0, B=3, T=64), ragged_ids()):
        labels = torch.roll(ids, -1, dims=1)
        with torch.no_grad():
            a, b = packed.eval()(ids, labels=labels), padded.eval()(ids, labels=labels)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
        packed.zero_grad()
        padded.zero_grad()
        a, b = packed.train()(ids, labels=labels), padded.train()(ids, labels=labels)
        torch.testing.assert_close(a.loss, b.loss, atol=1e-6, rtol=1e-6)
        (a.loss + a.aux_loss).backward()
        (b.loss + b.aux_loss).backward()
        grads = dict(padded.named_parameters())
        for name, p in packed.named_parameters():
            if p.grad is None:
                assert grads[name].grad is None, name
                continue
            # to the tensor's scale: zero-initialised residual_proj gets gradients of ~1e3, whose
            # small entries differ by a few 1e-5 (6e-5 at most measured, 6e-8 of the largest)
            ref = grads[name].grad
            assert (p.grad - ref).abs().max() <= 1e-6 * ref.abs().max() + 1e-7, name


def test_packed_flops_match_flop_counter_on_ragged_rows():
    """On rows with very different segment counts the packed core does measurably less work, and
    ``aux["flops_per_byte"]`` follows FlopCounterMode in both layouts (a formula that counted the
    padding under packing, or missed it without, would be off by more than the tolerance)."""
    ids = ragged_ids()
    totals = {}
    for pack in (True, False):
        args = dataclasses.replace(SPIDER_FLAVORS["debug"], boundary_predictor="space", pack_segments=pack)
        torch.manual_seed(0)
        model = Spider(args)
        model.init_weights()
        measured, aux = measured_train_flops(model, ids)
        predicted = aux["flops_per_byte"].item() * ids.numel()
        assert abs(predicted / measured - 1) < 0.03, (pack, predicted, measured)
        totals[pack] = measured
    assert totals[True] < 0.93 * totals[False], totals
