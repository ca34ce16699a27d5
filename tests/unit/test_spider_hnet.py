"""H-Net's dynamic-chunking path in Spider (issue 21), each element against a reference:
the confidence-weighted straight-through estimator and the dechunk smoothing (the LM gradient
reaches the router through them and nothing else; the smoothing against a hand-written EMA loop),
the first-byte chunk convention (pooling and the start/end shift), stage-aware init and per-module
learning rates (param groups, the scheduler, a checkpoint round trip).

Causality of both conventions, with negative controls, is in test_spider_model.py (test_causality).
"""

from __future__ import annotations

import math

import pytest
import torch

from spider_titan.checkpoint.manager import OptimizerState
from spider_titan.config.manager import ConfigError, parse_args
from spider_titan.job_config import LRScheduler
from spider_titan.job_config import Optimizer as OptimizerConfig
from spider_titan.models.spider import segmentation as seg_mod
from spider_titan.models.spider.segmentation import (
    downsample_first,
    segment_bytes,
    segment_start_probs,
    smooth_segments,
    upsample_own,
)
from spider_titan.optim.lr_schedulers import build_lr_scheduler, cosine_decay
from spider_titan.optim.optimizers import build_adamw, build_muon, lr_factor
from spider_titan.vocab import BOS_ID, EOS_ID, IGNORE_INDEX, PAD_ID
from tests.unit.test_spider_model import MEAN_PATH, build, reference_boundaries, sample_ids


def ragged_ids(seed: int, B: int = 3, T: int = 48) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    ids[:, 0] = BOS_ID
    ids[0, 20] = EOS_ID
    ids[0, 21] = BOS_ID
    ids[-1, T - 9 :] = PAD_ID
    return ids


def lm_backward(model, ids: torch.Tensor) -> None:
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    model(ids, labels=labels).loss.backward()


# ------------------------------------------------------------ confidence-weighted straight-through


def without_confidence(monkeypatch) -> None:
    """The confidence factor as a constant 1 (its value): no gradient through it."""
    monkeypatch.setattr(seg_mod, "boundary_confidence", lambda seg: torch.ones_like(seg.probs))


def without_smoothing_gradient(monkeypatch) -> None:
    """The smoothing with its weights P detached: the same values, no gradient to the predictor."""
    real = seg_mod.smoothing_weights
    monkeypatch.setattr(seg_mod, "smoothing_weights", lambda seg: real(seg).detach())


@pytest.mark.parametrize("convention", ["mean", "first"])
@pytest.mark.parametrize(
    "cut, reaches",
    [
        ((), True),  # H-Net's path: the confidence factor and the smoothing
        ((without_smoothing_gradient,), True),  # the confidence factor alone
        ((without_confidence,), True),  # the smoothing alone
        ((without_confidence, without_smoothing_gradient), False),  # no other path to the router
    ],
    ids=["both", "confidence", "smoothing", "neither"],
)
def test_lm_gradient_reaches_the_router_only_through_confidence_and_smoothing(monkeypatch, convention, cut, reaches):
    # no boundary loss: only the LM loss is left
    for remove in cut:
        remove(monkeypatch)
    model = build(boundary_coeff=0.0, chunk_convention=convention).train()
    lm_backward(model, ragged_ids(1))
    grads = [p.grad for p in model.boundary_predictor.parameters()]
    total = sum(0.0 if g is None else g.abs().sum().item() for g in grads)
    if reaches:
        assert all(g is not None and torch.isfinite(g).all() for g in grads) and total > 0
    else:
        assert total == 0.0


@pytest.mark.parametrize("convention", ["mean", "first"])
def test_confidence_ste_changes_no_value(monkeypatch, convention):
    """Value exactly 1: the same weights give the same logits and losses with it and with a constant 1."""
    ids = ragged_ids(2)
    with torch.no_grad():
        conf = build(seed=4, chunk_convention=convention).train()(ids)
        without_confidence(monkeypatch)
        plain = build(seed=4, chunk_convention=convention).train()(ids)
    torch.testing.assert_close(conf.logits, plain.logits, rtol=0, atol=0)
    torch.testing.assert_close(conf.aux_loss, plain.aux_loss, rtol=0, atol=0)


def test_confidence_gradient_has_the_sign_of_the_choice():
    """dL/dp at a chosen boundary is +<grad, output> and at a skipped one -<grad, output> (c = p or 1 - p),
    taken at the byte after the decision; forced positions get none."""
    from spider_titan.models.spider.segmentation import boundary_confidence

    g = torch.Generator().manual_seed(5)
    ids = ragged_ids(5, B=2, T=30)
    logits = (torch.randn(2, 30, generator=g) * 2).requires_grad_()
    seg = segment_bytes(logits, ids, max_segment_bytes=6)
    conf = boundary_confidence(seg)
    assert torch.equal(conf.detach(), torch.ones_like(conf))
    w = torch.randn(2, 30, generator=g)
    (conf * w).sum().backward()
    p = torch.sigmoid(logits.detach())
    for b in range(2):
        for t in range(29):
            want = 0.0
            if seg.free[b, t]:
                sign = 1.0 if seg.boundaries[b, t] else -1.0
                want = sign * w[b, t + 1].item() * p[b, t].item() * (1 - p[b, t].item())  # d sigmoid
            assert logits.grad[b, t].item() == pytest.approx(want, abs=1e-6)


# ----------------------------------------------------------------------------------- smoothing


def reference_start_probs(seg, b: int) -> list[float]:
    """P_k by hand: 1 for the first segment and after a forced boundary, else the rule's value there."""
    ends = [t for t in range(seg.boundaries.shape[1]) if seg.boundaries[b, t]]
    out = [1.0]
    for end in ends[:-1]:
        out.append(seg.probs[b, end].item() if seg.free[b, end] else 1.0)
    return out


def test_smoothing_matches_a_loop_reference():
    g = torch.Generator().manual_seed(8)
    ids = ragged_ids(8)
    B, T, D = ids.shape[0], ids.shape[1], 6
    logits = (torch.randn(B, T, generator=g) * 2).requires_grad_()
    seg = segment_bytes(logits, ids, max_segment_bytes=5)
    S = seg.num_segments
    y = torch.randn(B, S, D, generator=g, requires_grad=True)
    got = smooth_segments(y, seg)
    for b in range(B):
        n = int(seg.seg_valid[b].sum())
        P = reference_start_probs(seg, b)
        assert len(P) == n
        torch.testing.assert_close(segment_start_probs(seg)[b, :n].detach(), torch.tensor(P))
        prev = torch.zeros(D)
        for k in range(n):
            p = min(max(P[k], 1e-4), 1 - 1e-4)
            prev = p * y[b, k].detach() + (1 - p) * prev
            torch.testing.assert_close(got[b, k].detach(), prev, atol=1e-5, rtol=1e-5)

    # gradients against the same loop in torch ops
    w = torch.randn(B, S, D, generator=g)
    (got * w).sum().backward(retain_graph=True)
    grad_y, grad_logits = y.grad.clone(), logits.grad.clone()
    y.grad, logits.grad = None, None
    P = segment_start_probs(seg).clamp(1e-4, 1 - 1e-4)
    outs, prev = [], torch.zeros(B, D)
    for k in range(S):
        prev = P[:, k : k + 1] * y[:, k] + (1 - P[:, k : k + 1]) * prev
        outs.append(prev)
    (torch.stack(outs, 1) * w).sum().backward()
    torch.testing.assert_close(grad_y, y.grad, atol=1e-5, rtol=1e-5)
    assert grad_logits.abs().sum() > 0  # the smoothing carries the predictor's gradient
    torch.testing.assert_close(grad_logits, logits.grad, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------- first-byte convention


def test_chunk_start_logits_decide_the_previous_byte_end():
    """With chunk_start, a decision at t is "t starts a chunk", i.e. the segment ends at t - 1."""
    g = torch.Generator().manual_seed(3)
    ids = ragged_ids(3)
    B, T, L = ids.shape[0], ids.shape[1], 5
    decide = torch.rand(B, T, generator=g) < 0.3
    seg = segment_bytes(torch.where(decide, 5.0, -5.0), ids, max_segment_bytes=L, chunk_start=True)
    for b in range(B):
        ends_decided = decide[b, 1:].tolist() + [False]
        assert seg.boundaries[b].tolist() == reference_boundaries(ids[b].tolist(), ends_decided, L)


def test_first_byte_pooling_matches_reference():
    g = torch.Generator().manual_seed(4)
    ids = ragged_ids(4, B=2, T=30)
    B, T, D = 2, 30, 5
    seg = segment_bytes(torch.randn(B, T, generator=g) * 3, ids, max_segment_bytes=5, chunk_start=True)
    x = torch.randn(B, T, D, generator=g)
    s = downsample_first(x, seg)
    y = torch.randn(B, seg.num_segments, D, generator=g)
    up = upsample_own(y, seg)
    for b in range(B):
        n = int(seg.seg_valid[b].sum())
        for k in range(n):
            first = min(t for t in range(T) if seg.seg_id[b, t] == k)
            torch.testing.assert_close(s[b, k], x[b, first])
        for t in range(T):
            torch.testing.assert_close(up[b, t], y[b, seg.seg_id[b, t]])


# ---------------------------------------------------------------------------- stage-aware init


def test_stage_init_scales_each_stage_and_starts_the_skip_at_zero():
    model = build(**MEAN_PATH)
    a = model.args
    assert torch.equal(model.residual_proj.weight, torch.zeros_like(model.residual_proj.weight))
    assert torch.equal(model.up_proj.weight, torch.eye(a.dim))
    byte_w2 = torch.cat([b.feed_forward.w2.weight.flatten() for b in [*model.prelude.layers, *model.coda.layers]])
    core_wo = torch.cat([b.attention.wo.weight.flatten() for b in model.core.layers])
    assert byte_w2.std().item() == pytest.approx(0.02 / math.sqrt(2 * (a.n_prelude + a.n_coda)), rel=0.1)
    want_core = 0.02 / math.sqrt(2 * (a.n_prelude + a.n_core * a.n_loops + a.n_coda))
    assert core_wo.std().item() == pytest.approx(want_core, rel=0.1)
    # at the start the coda reads only the core's output: the prelude residual is cut
    ids = sample_ids(0)
    seen = {}
    model.coda.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    with torch.no_grad():
        model.eval()(ids)
    first_segment = torch.zeros_like(ids, dtype=torch.bool)  # bytes of segment 0 read zeros (mean convention)
    first_segment[:, 0] = True
    assert (seen["x"][first_segment] == 0).all()


# ------------------------------------------------------------------ per-module learning rates


RULES = ["*=2", "core=1", "core.layers.1=0.5"]


def expected_factor(name: str) -> float:
    if name.startswith("core.layers.1."):
        return 0.5
    if name.startswith("core."):
        return 1.0
    return 2.0


@pytest.mark.parametrize("builder", [build_adamw, build_muon], ids=["adamw", "muon"])
def test_param_groups_carry_the_right_lr(builder):
    model = build(byte_ngram_orders=[])  # the tables' own factor: test_the_ngram_tables_train_at_their_own_factor
    cfg = OptimizerConfig(lr=1e-3, muon_lr=0.02, weight_decay=0.1, lr_multipliers=list(RULES))
    opt = builder(model, cfg)
    lr_of = {id(p): (g["lr"], g) for g in opt.param_groups for p in g["params"]}
    muon = (
        {id(p) for g in getattr(opt, "muon", opt).param_groups for p in g["params"]} if builder is build_muon else set()
    )
    for name, p in model.named_parameters():
        base = cfg.muon_lr if id(p) in muon else cfg.lr
        assert lr_of[id(p)][0] == pytest.approx(base * expected_factor(name)), name
    assert len({id(p) for g in opt.param_groups for p in g["params"]}) == len(list(model.parameters()))
    # the scheduler scales every group by the same factor: the ratios hold through warmup and decay
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=3), 10, cosine_decay)
    for _ in range(5):
        opt.step()
        sched.step()
    for name, p in model.named_parameters():
        base = cfg.muon_lr if id(p) in muon else cfg.lr
        assert lr_of[id(p)][1]["lr"] == pytest.approx(base * expected_factor(name) * sched.lr_lambdas[0](5)), name


def test_no_multipliers_keep_the_decay_groups_and_the_tables_own():
    """Without rules: decayed and undecayed weights at the base lr, the n-gram tables undecayed at 8x it."""
    opt = build_adamw(build(byte_ngram_orders=[]), OptimizerConfig(lr=1e-3))
    assert [(g["weight_decay"], g["lr"]) for g in opt.param_groups] == [(0.1, 1e-3), (0.0, 1e-3)]
    model = build(byte_ngram_orders=[3, 4], byte_ngram_lr=8.0)
    opt = build_adamw(model, OptimizerConfig(lr=1e-3))
    assert [(g["weight_decay"], g["lr"]) for g in opt.param_groups] == [(0.1, 1e-3), (0.0, 1e-3), (0.0, 8e-3)]
    assert {id(p) for p in opt.param_groups[2]["params"]} == {id(p) for p in model.byte_ngrams.parameters()}


@pytest.mark.parametrize("builder", [build_adamw, build_muon], ids=["adamw", "muon"])
def test_the_ngram_tables_train_at_their_own_factor_times_the_rules(builder):
    """byte_ngram_lr multiplies the tables' lr (and any lr_multipliers rule on top); on AdamW's first step
    (the same gradients, no decay on tables) their update is exactly that factor times the plain one."""
    ngrams = {"byte_ngram_orders": [2, 3]}
    models = {lr: build(seed=1, byte_ngram_lr=lr, **ngrams) for lr in (1.0, 8.0)}
    tables = {id(p) for p in models[8.0].byte_ngrams.parameters()}
    cfg = OptimizerConfig(lr=1e-3, muon_lr=0.02, lr_multipliers=list(RULES))
    opt = builder(models[8.0], cfg)
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    muon = (
        {id(p) for g in getattr(opt, "muon", opt).param_groups for p in g["params"]} if builder is build_muon else set()
    )
    for name, p in models[8.0].named_parameters():
        base = cfg.muon_lr if id(p) in muon else cfg.lr
        want = base * expected_factor(name) * (8.0 if id(p) in tables else 1.0)
        assert lr_of[id(p)] == pytest.approx(want), name
    steps = {}
    for lr, model in models.items():
        before = [t.weight.detach().clone() for t in model.byte_ngrams.tables]
        opt = build_adamw(model, OptimizerConfig(lr=1e-3))
        ids = sample_ids(0)
        model(ids, labels=torch.roll(ids, -1, dims=1)).loss.backward()
        opt.step()
        steps[lr] = torch.cat([(t.weight - b).flatten() for t, b in zip(model.byte_ngrams.tables, before)])
    assert steps[1.0].abs().max() > 0
    torch.testing.assert_close(steps[8.0], 8.0 * steps[1.0], rtol=1e-4, atol=1e-9)


def test_lr_factor_sees_through_wrappers_and_prefers_the_longest_prefix():
    rules = {"*": 2.0, "core": 1.0, "core.layers.1": 0.5}
    assert lr_factor("core.layers.1._checkpoint_wrapped_module.attention.wq.weight", rules) == 0.5
    assert lr_factor("core.layers.10.attention.wq.weight", rules) == 1.0  # a prefix ends at a dot
    assert lr_factor("_orig_mod.coda.layers.0.attention.wq.weight", rules) == 2.0
    assert lr_factor("embed_tokens.weight", {"core": 3.0}) == 1.0


def test_lr_groups_survive_a_checkpoint_round_trip():
    cfg = OptimizerConfig(lr=1e-3, lr_multipliers=list(RULES))
    model = build()
    opt = build_adamw(model, cfg)
    lm_backward(model, sample_ids(0))
    opt.step()
    saved = OptimizerState(model, opt).state_dict()
    fresh_model = build(seed=9)
    fresh_model.load_state_dict(model.state_dict())
    fresh = build_adamw(fresh_model, cfg)
    OptimizerState(fresh_model, fresh).load_state_dict(saved)
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in opt.param_groups]
    assert [len(g["params"]) for g in fresh.param_groups] == [len(g["params"]) for g in opt.param_groups]
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], fresh.state[q][key])


@pytest.mark.parametrize(
    "entries, words",
    [
        (["core"], "is not PREFIX=FACTOR"),
        (["core=0"], "is not PREFIX=FACTOR"),
        (["core=x"], "is not PREFIX=FACTOR"),
        (["core=1", "core=2"], "given twice"),
        (["cor=2"], "matches no parameter"),
    ],
)
def test_bad_lr_multipliers_are_config_errors(entries, words):
    with pytest.raises(ConfigError) as e:
        parse_args(
            [
                "--job.config_file",
                "train_configs/debug_model.toml",
                "--optimizer.lr_multipliers",
                str(entries).replace("'", '"'),
            ],
            env={},
        )
    assert any(p.startswith("optimizer.lr_multipliers:") and words in p for p in e.value.problems), e.value.problems
