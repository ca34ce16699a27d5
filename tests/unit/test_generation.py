"""Test-time depth at generation (generation.effective_loops): loops past the trained count whose
calibrated gain is 0 are left out, and the output stays bit for bit that of every requested loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spider_titan import generation, registry
from spider_titan.generation import effective_loops, generate, model_spec, uses_cache
from spider_titan.models.spider import Spider
from spider_titan.models.spider.decode import decode, new_cache
from tests.unit.test_decode_cache import TEXT, _model


def _calibrated(gains: list[float], **overrides) -> Spider:
    """The debug Spider (2 loops trained, 4 at most) with ``gains`` for loops 3 and 4, as the
    end-of-run calibration leaves them."""
    model = _model(**overrides)
    model.core.extra_loop_gain[2:] = torch.tensor(gains)
    return model


def _count_loops(model: Spider) -> list[int]:
    """Calls of the core's first block (one per loop and forward), counted as they happen."""
    calls = [0]
    model.core.layers[0].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize(
    ("gains", "asked", "runs"),
    [
        ([0.0, 0.0], 4, 2),
        ([0.0, 0.0], 3, 2),
        ([0.5, 0.0], 4, 3),
        ([0.0, 0.5], 4, 4),  # loop 3 hands on its input, but loop 4 runs after it: both must run
        ([0.5, 0.25], 4, 4),
        ([0.0, 0.0], 2, 2),
        ([0.0, 0.0], 1, 1),
        ([0.0, 0.0], None, None),
        ([0.0, 0.0], 5, 5),  # past max_loops: the model's own error names the range
    ],
)
def test_effective_loops(gains, asked, runs):
    assert effective_loops(_calibrated(gains), asked) == runs


def test_training_mode_and_models_without_the_rule_keep_the_count():
    """A model in training mode (which does not apply the gains) runs every loop asked for, and so
    does a model whose spec has no ``effective_loops`` (asked through the spec, not its class)."""
    assert effective_loops(_calibrated([0.0, 0.0]).train(), 4) == 4
    spec = registry.get("model", "dense")
    dense = spec.build_on_meta(spec.build_args("debug"))
    assert model_spec(dense) is spec and spec.recurrence is None and effective_loops(dense, 4) == 4
    assert model_spec(_calibrated([0.0, 0.0])) is registry.get("model", "spider")


def test_generation_decodes_with_the_decoder_its_spec_names(monkeypatch):
    """The cached path is the spec's decoder (``Inference.decoder``): a spec without one recomputes
    the context for every byte, with the same bytes."""
    model = _calibrated([0.5, 0.5])
    spider = registry.get("model", "spider")
    assert spider.cached_decoder().decode is decode and uses_cache(model, 64)
    kw = dict(max_new_bytes=16, temperature=0.0)
    cached = generate(model, b"def ", **kw)
    monkeypatch.setattr(generation, "model_spec", lambda m: dataclasses.replace(spider, inference=None))
    assert not uses_cache(model, 64) and generate(model, b"def ", **kw) == cached


@pytest.mark.parametrize("use_cache", [True, False])
def test_zero_gain_loops_left_out_give_the_same_bytes_with_fewer_loops(monkeypatch, use_cache):
    """Greedy bytes at 4 loops (loops 3 and 4 calibrated to 0) equal those when all 4 run (the
    reference: effective_loops patched to run what is asked), cached and recomputed, with half the
    core's work; the logits of the full forward and of the cached decoder are equal bit for bit."""
    model = _calibrated([0.0, 0.0])
    ids = torch.tensor([[257, *TEXT[:100]]])
    full = model(ids, n_loops=4).logits
    assert torch.equal(model(ids, n_loops=2).logits, full)
    cached = {}
    for n in (2, 4):
        cache = new_cache(model, 1, n_loops=n)
        cached[n] = decode(model, ids, cache)
    assert torch.equal(cached[2], cached[4])
    kw = dict(max_new_bytes=48, temperature=0.0, n_loops=4, use_cache=use_cache)
    calls = _count_loops(model)
    skipped = generate(model, b"def ", **kw)
    fewer = calls[0]
    monkeypatch.setattr(generation, "effective_loops", lambda m, n: n)
    calls[0] = 0
    assert generate(model, b"def ", **kw) == skipped
    assert fewer * 2 == calls[0]


def test_a_loop_with_a_gain_changes_the_output():
    """The check above means something: with loop 3's gain at 1 its output differs."""
    ids = torch.tensor([[257, *TEXT[:100]]])
    model = _calibrated([1.0, 0.0])
    assert not torch.equal(model(ids, n_loops=3).logits, model(ids, n_loops=2).logits)
