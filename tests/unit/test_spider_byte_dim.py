"""The byte-stack width ``byte_dim`` (model.py, args.py): at ``dim`` the model is today's tensor for
tensor; narrower, the byte parts shrink, the core keeps its width and the model stays causal. The
boundary predictor's width ``boundary_dim`` likewise: 0 is today's square routing module, narrower
its projections start as the identity's first rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from spider_titan.models.spider.args import SPIDER_FLAVORS
from tests.unit.test_spider_model import build, causality_gaps, content_predictor, sample_ids

# Today's debug model (byte_dim = dim = 128): the byte-level tensors and the projections around
# the core, by name and shape, as old checkpoints hold them.
TODAY = {
    "embed_tokens.weight": (272, 128),
    "prelude.layers.0.attention.wq.weight": (192, 128),
    "prelude.layers.0.feed_forward.w1.weight": (256, 128),
    "core.inject.weight": (128, 128),
    "up_proj.weight": (128, 128),
    "coda.layers.0.ffn_norm.weight": (128,),
    "norm.weight": (128,),
    "lm_head.weight": (272, 128),
}


def test_byte_dim_equal_to_dim_is_todays_model():
    """byte_dim = 0 (the default) and byte_dim = dim build the same state dict (names and shapes)
    and, from the same seed, the same logits."""
    default, explicit = build(), build(byte_dim=128)
    sd, sd2 = default.state_dict(), explicit.state_dict()
    assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in sd2.items()}
    for name, shape in TODAY.items():
        assert tuple(sd[name].shape) == shape, name
    ids = sample_ids(0)
    with torch.no_grad():
        assert torch.equal(default.eval()(ids).logits, explicit.eval()(ids).logits)


@pytest.mark.parametrize("byte_mlp", [True, False])
def test_narrow_byte_stack_shapes_and_parameters(byte_mlp):
    """byte_dim 64: every byte-level tensor at 64, the core at 128, the projections between them;
    without byte MLPs the byte blocks have none; training runs forward and backward."""
    model = build(byte_dim=64, byte_mlp=byte_mlp)
    sd = model.state_dict()
    assert tuple(sd["embed_tokens.weight"].shape) == (272, 64)
    assert tuple(sd["lm_head.weight"].shape) == (272, 64)
    assert tuple(sd["core.inject.weight"].shape) == (128, 64)  # byte_dim -> dim
    assert tuple(sd["up_proj.weight"].shape) == (64, 128)  # dim -> byte_dim
    assert tuple(sd["prelude.layers.0.attention.wq.weight"].shape) == (192, 64)
    assert tuple(sd["core.layers.0.attention.wq.weight"].shape) == (192, 128)
    assert any(".feed_forward." in k for k in sd) == byte_mlp
    full = sum(p.numel() for p in build().parameters())
    assert sum(p.numel() for p in model.parameters()) < full
    ids = sample_ids(1)
    out = model.train()(ids, labels=torch.roll(ids, -1, dims=1))
    out.loss.backward()
    assert out.logits.shape == (*ids.shape, 272)
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() for n, p in model.named_parameters() if "prelude" in n
    )


@pytest.mark.parametrize("train", [False, True])
def test_narrow_byte_stack_is_causal(monkeypatch, train):
    model = build(byte_dim=64, byte_mlp=False)
    monkeypatch.setattr(model.boundary_predictor, "forward", content_predictor)
    ids = sample_ids(2, B=2, T=48)
    for u, before, after in causality_gaps(model, ids, train=train, seed=0, positions=(5, 17, 30)):
        assert before < 1e-5, f"u={u}: logits before u moved by {before}"
        assert after > 1e-4, f"u={u}: changing byte u changed nothing (vacuous test)"


def test_boundary_dim_full_width_is_hnets_predictor():
    """boundary_dim = 0 and = the byte width build the same square, identity-initialised q/k projections
    (H-Net's routing module, the debug flavor's before it took 32) and the same logits."""
    default, explicit = build(boundary_dim=0), build(boundary_dim=128)
    for name in ("boundary_predictor.q_proj.weight", "boundary_predictor.k_proj.weight"):
        assert torch.equal(default.state_dict()[name], torch.eye(128))
        assert torch.equal(explicit.state_dict()[name], torch.eye(128))
    ids = sample_ids(3)
    with torch.no_grad():
        assert torch.equal(default.eval()(ids).logits, explicit.eval()(ids).logits)


def test_narrow_boundary_dim_reads_the_first_coordinates_at_init():
    """boundary_dim 32: q_proj and k_proj are (32, 128), and at init the raw score is H-Net's cosine of
    the first 32 coordinates of adjacent prelude states (a reference computed here); the model trains."""
    model = build(boundary_dim=32)
    bp = model.boundary_predictor
    assert tuple(bp.q_proj.weight.shape) == tuple(bp.k_proj.weight.shape) == (32, 128)
    h = torch.randn(2, 12, 128, generator=torch.Generator().manual_seed(0))
    cos = F.cosine_similarity(h[:, :, :32], F.pad(h[:, :-1, :32], (0, 0, 1, 0)), dim=-1, eps=1e-6)
    p = ((1 - cos) / 2).clamp(1e-6, 1 - 1e-6)
    torch.testing.assert_close(bp.raw_score(h), torch.log(p) - torch.log1p(-p))
    ids = sample_ids(4)
    out = model.train()(ids, labels=torch.roll(ids, -1, dims=1))
    out.loss.backward()
    assert bp.q_proj.weight.grad is not None and bp.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("bad", [-1, 129])
def test_boundary_dim_out_of_range_is_refused(bad):
    problems = dataclasses.replace(SPIDER_FLAVORS["debug"], boundary_dim=bad).validate()
    assert any(p.startswith("boundary_dim:") for p in problems), problems
