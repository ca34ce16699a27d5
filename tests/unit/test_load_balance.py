"""Aux-loss-free balancing: counts over micro-batches, not recomputations; the update direction."""

from __future__ import annotations

import torch

from spider_titan.components.builder import build_model, materialize
from spider_titan.config.manager import parse_args
from spider_titan.moe.layer import MoE
from spider_titan.moe.load_balance import AuxFreeBalancer


def build(ac_mode: str):
    cfg = parse_args(["--model.name", "spider", "--activation_checkpoint.mode", ac_mode], env={})
    _, _, model = build_model(cfg)
    materialize(model, torch.device("cpu"), 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return model, opt, AuxFreeBalancer(model, opt, rate=0.01)


def run_step(model, opt, batches):
    for x in batches:
        torch.manual_seed(1)
        out = model(x)
        (out.logits.float().mean() + out.aux_loss).backward()


def test_counts_cover_all_micro_batches_and_skip_recomputation():
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 64), generator=gen) for _ in range(2)]
    model, opt, bal = build("none")
    run_step(model, opt, batches)
    ref = {k: v.clone() for k, v in bal.counts.items()}
    per_layer = [ref[id(m)] for m in model.modules() if isinstance(m, MoE)]
    total_slots = sum(float(c.sum()) for c in per_layer)
    assert total_slots > 0

    model_ac, opt_ac, bal_ac = build("full")  # full AC re-runs every MoE forward in backward
    run_step(model_ac, opt_ac, batches)
    got = [bal_ac.counts[id(m)] for m in model_ac.modules() if isinstance(m, MoE)]
    for a, b in zip(per_layer, got):
        torch.testing.assert_close(a, b)


def test_update_moves_bias_toward_balance_once_per_step():
    model, opt, bal = build("none")
    run_step(model, opt, [torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))])
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    counts = [bal.counts[id(m)].clone() for m in layers]
    opt.step()  # the pre-hook applies the update and clears the counts
    assert not bal.counts
    for layer, c in zip(layers, counts):
        expected = 0.01 * torch.sign(c.mean() - c)
        torch.testing.assert_close(layer.expert_bias, expected)
