"""Segment packing (attention.PackedRows, recurrence.CoreBlock): the core's per-segment work runs on
the batch's real segments only, packed into one row. ``PackedRows`` against hand-written layouts, and
``aux["flops_per_byte"]`` against FlopCounterMode on rows whose segment counts differ ~8x (a formula
that counted the (B, S) padding would be off by more than the tolerance)."""

from __future__ import annotations

import dataclasses

import torch

from spider_titan.models.spider import spider_flops_per_byte
from spider_titan.models.spider.attention import PackedRows
from spider_titan.models.spider.model import Spider
from spider_titan.models.spider.segmentation import Chunker
from spider_titan.vocab import PAD_ID
from tests.unit.test_spider_model import DEBUG
from tests.unit.test_spider_params_flops import measured_train_flops


def ragged_ids() -> torch.Tensor:
    """Rows whose space-rule segment counts differ ~8x: row 0 a space every other byte, row 1 none
    (cut by the length cap only), row 2 half PAD."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(ord("a"), ord("z") + 1, (3, 128), generator=g)
    ids[0, 1::2] = ord(" ")
    ids[2, 64:] = PAD_ID
    return ids


def test_packed_rows_pack_and_pad():
    valid = torch.tensor([[True, True, False], [True, False, False]])
    p = PackedRows.of(valid, 3)
    assert p.index.tolist() == [0, 1, 3]
    x = torch.arange(6.0).view(2, 3, 1)
    assert p.pack(x).flatten().tolist() == [0.0, 1.0, 3.0]
    assert p.pad(p.pack(x)).flatten().tolist() == [0.0, 1.0, 0.0, 3.0, 0.0, 0.0]
    assert p.position.tolist() == [0, 1, 3, 2, 3, 3]


def test_packing_and_padding_gradients_match_autograds_scatter():
    """pack and pad take their gradients by gathering through the inverse map: the same gradients as
    autograd's own (zero-fill and scatter) of index_select / index_copy, bit for bit, spare positions
    included."""
    g = torch.Generator().manual_seed(0)
    valid = torch.rand(3, 7, generator=g) < 0.6
    for p in (PackedRows.fixed(valid, int(valid.sum()) + 3), PackedRows.fixed(valid, 4)):
        x = torch.randn(3, 7, 5, generator=g, requires_grad=True)
        w = torch.randn(1, len(p.index), 5, generator=g)
        ref_x = x.detach().clone().requires_grad_()
        flat = torch.cat([ref_x.flatten(0, 1), ref_x.new_zeros(1, 5)])
        ref = flat.index_select(0, p.index).unsqueeze(0)
        torch.testing.assert_close(p.pack(x), ref, rtol=0, atol=0)
        (p.pack(x) * w).sum().backward()
        (ref * w).sum().backward()
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)

        y = torch.randn(1, len(p.index), 5, generator=g, requires_grad=True)
        v = torch.randn(3, 7, 5, generator=g)
        ref_y = y.detach().clone().requires_grad_()
        into = torch.zeros(3 * 7 + 1, 5).index_copy(0, p.index, ref_y.squeeze(0))[:-1].view(3, 7, 5)
        ref_pad = torch.where(p.valid.unsqueeze(-1), into, 0.0)  # a spare position pads nowhere
        torch.testing.assert_close(p.pad(y), ref_pad, rtol=0, atol=0)
        (p.pad(y) * v).sum().backward()
        (ref_pad * v).sum().backward()
        torch.testing.assert_close(y.grad, ref_y.grad, rtol=0, atol=0)


def test_fixed_packed_rows_fill_with_a_spare_slot_and_drop_from_the_batch_end():
    """``PackedRows.fixed``: a static N. Past the real slots it packs zeros from a spare slot that pads
    nowhere (no real slot is written twice, no gradient reaches it); short of them it keeps the first
    N in flat order, so a drop takes the batch's last segments."""
    valid = torch.tensor([[True, True, False], [True, False, False]])
    x = torch.arange(1.0, 7.0).view(2, 3, 1).requires_grad_()
    roomy = PackedRows.fixed(valid, 5)
    assert roomy.index.tolist() == [0, 1, 3, 6, 6] and torch.equal(roomy.valid, valid)
    packed = roomy.pack(x)
    assert packed.flatten().tolist() == [1.0, 2.0, 4.0, 0.0, 0.0]
    assert roomy.pad(packed * 10).flatten().tolist() == [10.0, 20.0, 0.0, 40.0, 0.0, 0.0]
    (packed * torch.arange(1.0, 6.0).view(1, 5, 1)).sum().backward()
    assert x.grad.flatten().tolist() == [1.0, 2.0, 0.0, 3.0, 0.0, 0.0]  # the spare positions reach nothing
    tight = PackedRows.fixed(valid, 2)
    assert tight.index.tolist() == [0, 1] and tight.valid.tolist() == [[True, True, False], [False, False, False]]


def test_a_packed_capacity_computes_what_the_counted_packing_does(monkeypatch):
    """``packed_capacity`` (static N) with room for every segment: the same logits as the counted
    packing (host N) on ragged rows, and ``aux["flops_per_byte"]`` charges the N packed positions
    (FlopCounterMode within 3 %); a tight one drops segments and says so."""
    ids = ragged_ids()
    segment = Chunker.segment
    monkeypatch.setattr(
        Chunker,
        "segment",
        lambda self, logits, input_ids, **kw: segment(
            self, logits + torch.where(input_ids == ord(" "), 1e3, -1e3), input_ids, **kw
        ),
    )
    outputs = {}
    for name, overrides in {
        "counted": {},
        "roomy": {"segment_capacity": 4.0, "packed_capacity": 3.0},
        "tight": {"segment_capacity": 4.0, "packed_capacity": 0.5},
    }.items():
        torch.manual_seed(0)
        model = Spider(dataclasses.replace(DEBUG, **overrides))
        model.init_weights()
        if name == "roomy":
            measured, aux = measured_train_flops(model, ids)
            predicted = aux["flops_per_byte"].item() * ids.numel()
            assert abs(predicted / measured - 1) < 0.03, (predicted, measured)
        outputs[name] = model(ids)
    torch.testing.assert_close(outputs["roomy"].logits, outputs["counted"].logits, rtol=1e-5, atol=1e-5)
    assert outputs["roomy"].aux["segments_dropped"].item() == 0.0
    assert outputs["tight"].aux["segments_dropped"].item() > 0.1, outputs["tight"].aux["segments_dropped"]


def test_packed_flops_match_flop_counter_on_ragged_rows(monkeypatch):
    """A space rule on top of the learned predictor's logits (its matmuls still run) gives rows of
    ~64, 8 and 8 segments: ``aux["flops_per_byte"]`` follows FlopCounterMode within 3 %, and the
    formula charged for the padded (B, S) layout would be more than 3 % off (not vacuous)."""
    ids = ragged_ids()
    B, T = ids.shape
    segment, seen = Chunker.segment, []

    def space_rule(self, logits, input_ids, **kwargs):
        rule = torch.where(input_ids == ord(" "), 1e3, -1e3)
        seen.append(segment(self, logits + rule, input_ids, **kwargs))
        return seen[-1]

    monkeypatch.setattr(Chunker, "segment", space_rule)
    args = DEBUG
    torch.manual_seed(0)
    model = Spider(args)
    model.init_weights()
    measured, aux = measured_train_flops(model, ids)
    predicted = aux["flops_per_byte"].item() * ids.numel()
    assert abs(predicted / measured - 1) < 0.03, (predicted, measured)
    (seg,) = seen
    S = seg.num_segments
    assert S >= 4 * min(seg.seg_valid.sum(dim=1).tolist()), seg.seg_valid.sum(dim=1)  # really ragged
    padded = spider_flops_per_byte(args, T, n_loops=aux["loops_run"].item(), bytes_per_segment=T / S, row_segments=S)
    assert abs(padded * ids.numel() / measured - 1) > 0.03, (padded * ids.numel(), measured)


def test_a_ragged_batch_gives_each_row_its_own_logits_and_gradients():
    """Packing is exact: rows with very different segment counts give, in one batch, the logits and
    the LM-loss gradients they give alone (the core's attention must not mix the packed rows)."""
    torch.manual_seed(0)
    model = Spider(DEBUG)
    model.init_weights()
    model.eval()
    ids = ragged_ids()
    ids[1, ::16] = ord(" ")  # rows of different lengths in segments: ~64, ~8 (cap), and half PAD

    def lm_grads(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logits = model(batch).logits
        logits.float().logsumexp(-1).sum().backward()  # a per-row loss: rows add up
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    together, grads = lm_grads(ids)
    alone_grads: dict[str, torch.Tensor] = {}
    for r in range(ids.shape[0]):
        logits, g = lm_grads(ids[r : r + 1])
        torch.testing.assert_close(together[r : r + 1], logits, atol=1e-5, rtol=1e-5)
        for name, value in g.items():
            alone_grads[name] = alone_grads.get(name, 0) + value
    for name, value in grads.items():
        torch.testing.assert_close(value, alone_grads[name], atol=1e-4, rtol=1e-4, msg=name)
