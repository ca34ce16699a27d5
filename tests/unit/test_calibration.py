"""Test-time depth calibration: the eval-time gains of the loops past n_loops (models/spider/calibration.py)
and the end-of-run calibrator that scores them on the batches training would read next
(training/calibration.py)."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch

from spider_titan import registry
from spider_titan.data.loader import ByteDataLoader
from spider_titan.job_config import Calibration
from spider_titan.models.spider.calibration import GAINS, calibrate_extra_loops
from spider_titan.models.spider.model import SPIDER_SPEC
from spider_titan.protocol import window_cross_entropy
from tests.unit.test_spider_model import build, sample_ids


def test_extra_loop_gains_apply_at_eval_past_n_loops_only():
    """Gain 0 on loops 3 and 4 makes eval at 4 loops the 2-loop model bit for bit; gain 1 is the plain
    loop (the same weights trained at 4 loops, where loops 3 and 4 are trained ones and no gain
    applies); a half gain lands in between; the trained loops and the training forward ignore the gains."""
    model = build().eval()
    x = sample_ids(1)
    gains = model.core.extra_loop_gain
    assert gains.tolist() == [1.0, 1.0, 1.0, 1.0]  # init: every loop as trained
    plain = build(n_loops=4).eval()
    plain.load_state_dict(model.state_dict())
    plain.core.extra_loop_gain.zero_()  # would change loops 3 and 4 if it applied to them
    with torch.no_grad():
        at2, at4 = model(x, n_loops=2).logits, model(x, n_loops=4).logits
        torch.testing.assert_close(at4, plain(x, n_loops=4).logits, rtol=1e-5, atol=1e-5)
        assert not torch.equal(at4, at2)  # the further loops do change the output
        gains[2:] = 0.0
        assert torch.equal(model(x, n_loops=4).logits, at2)
        gains[2] = 0.5
        half = model(x, n_loops=3).logits
        gains[2] = 1.0
        full = model(x, n_loops=3).logits
        assert 0 < (half - at2).abs().mean() < (full - at2).abs().mean()
        gains[:2] = 0.0  # loops below n_loops are the trained ones
        assert torch.equal(model(x, n_loops=2).logits, at2)
        model.train()
        gains[:] = 0.0
        assert not torch.equal(model(x, n_loops=4).logits, model(x, n_loops=2).logits)


class _Stub(torch.nn.Module):
    """A model with Spider's gain buffer whose per-window loss the test sets by hand."""

    def __init__(self, max_loops: int):
        super().__init__()
        self.core = torch.nn.Module()
        self.core.register_buffer("extra_loop_gain", torch.ones(max_loops))
        self.core.inert_loops = lambda: [False] * max_loops  # every loop scored


def _scorer(model: _Stub, n: int, effects, windows: int = 400, labels: float = 200.0):
    """ce per window = base + sum over the extra loops run of effect_i(gain_i, window noise)."""
    g = torch.Generator().manual_seed(0)
    base = 300.0 + 10.0 * torch.rand(windows, generator=g, dtype=torch.float64)
    noise = torch.randn(len(effects), windows, generator=g, dtype=torch.float64)
    count = torch.full((windows,), labels, dtype=torch.float64)
    calls = []

    def score(kwargs):
        k = kwargs["n_loops"]
        calls.append(k)
        ce = base.clone()
        for i in range(n, k):
            ce += effects[i - n](float(model.core.extra_loop_gain[i]), noise[i - n])
        return ce, count

    return score, calls


def test_calibration_keeps_a_loop_that_helps_and_leaves_out_the_others():
    """Loop 3 helps most at gain 0.5 (kept), loop 4 only hurts (left out), loop 5 helps by far less
    than the noise (left out): the loss on the calibration windows never rises with the loops."""
    args = SPIDER_SPEC.build_args("debug", {"n_loops": 2, "max_loops": 5})
    model = _Stub(5)
    effects = [
        lambda gain, z: 4.0 * ((gain - 0.5) ** 2 - 0.25) + 0.5 * gain * z,  # -1 nat per window at 0.5
        lambda gain, z: 3.0 * gain + 0.5 * gain * z,  # worse at every gain
        lambda gain, z: 0.004 * ((gain - 1.0) ** 2 - 1.0) + 2.0 * gain * z,  # -0.004 +- 0.1 per window
    ]
    score, calls = _scorer(model, 2, effects)
    figures = calibrate_extra_loops(model, args, score)
    assert model.core.extra_loop_gain.tolist() == [1.0, 1.0, 0.5, 0.0, 0.0]
    assert calls == [2] + [3] * len(GAINS) + [4] * len(GAINS) + [5] * len(GAINS)
    assert figures["loop_gain_3"] == 0.5 and figures["loop_gain_4"] == 0.0 and figures["loop_gain_5"] == 0.0
    assert figures["calib_gain_bpb"] == pytest.approx(-1.0 / 200.0 / math.log(2), rel=0.05)
    assert figures["calib_diff_bpb_4"] > 0  # the best gain of loop 4 was still worse than leaving it out


def test_an_untrained_loop_after_a_left_out_one_is_not_scored_again():
    """Loops whose own parameters are at their init compute the same map of the state, so after an
    untrained loop left out the next is left out unscored, with the same figures as scoring it gives;
    a loop whose LoRA trained (a negative control) is scored."""
    model = build(n_loops=1).eval()
    x = sample_ids(1, B=8)
    y = torch.roll(x, -1, dims=1)

    def calibrate(every_loop: bool):
        calls = []

        def score(kwargs):
            calls.append(kwargs["n_loops"])
            return window_cross_entropy(model(x, **kwargs).logits, y)

        if every_loop:
            model.core.inert_loops = lambda: [False] * 4
        model.core.extra_loop_gain.fill_(1.0)
        figures = calibrate_extra_loops(model, model.args, score)
        model.core.__dict__.pop("inert_loops", None)
        return figures, model.core.extra_loop_gain.tolist(), calls

    assert model.core.inert_loops() == [True] * 4
    skipped, gains, calls = calibrate(every_loop=False)
    assert gains == [1.0, 0.0, 0.0, 0.0]  # loop 2 left out, so loops 3 and 4 follow unscored
    assert calls == [1] + [2] * len(GAINS)
    assert (skipped, gains) == calibrate(every_loop=True)[:2]  # what scoring them gives, exactly
    with torch.no_grad():
        model.core.layers[0].lora.wo_b[2].normal_(std=0.05)  # loop 3's adapter trained
    assert model.core.inert_loops() == [True, True, False, True]
    figures, _, calls = calibrate(every_loop=False)
    assert calls == [1] + [2] * len(GAINS) + [3] * len(GAINS) + [4] * len(GAINS)
    assert figures["calib_diff_bpb_3"] != figures["calib_diff_bpb_2"]


def test_calibration_skips_models_without_extra_loops():
    score = lambda kwargs: pytest.fail("nothing to score")  # noqa: E731
    none = build(n_loops=4, max_loops=4)
    assert calibrate_extra_loops(none, none.args, score) == {}
    assert none.core.extra_loop_gain.tolist() == [1.0, 1.0, 1.0, 1.0]


class _Stop:
    """A StopSignal stand-in: a stop is requested at the ``at``-th check."""

    def __init__(self, at: int | None):
        self.at, self.checks = at, 0

    def requested(self) -> bool:
        self.checks += 1
        return self.at is not None and self.checks >= self.at


def _calibrator(model, stop, steps: int = 3, max_batches: int | None = None):
    from spider_titan.training.calibration import Calibrator

    loader = ByteDataLoader(
        registry.get("dataset", "mock")(None, split="train", seed=0),
        seq_len=48,
        local_batch_size=2,
        dp_rank=0,
        dp_world_size=1,
        seed=0,
    )
    loader.samples_consumed = 10
    cal = Calibrator(
        model,
        SPIDER_SPEC,
        model.args,
        loader,
        Calibration(steps=steps),
        device=torch.device("cpu"),
        autocast=nullcontext,
        stop=stop,
        max_batches=max_batches,
    )
    return cal, loader


def test_calibrator_scores_the_next_batches_without_consuming_them():
    """The real model and scorer: the loader's position does not move, the model is back in training
    mode, and on the calibration batches the loss at max_loops is no higher than at n_loops (the
    guarantee the greedy fit gives), while the plain further loops (gain 1) change it."""
    model = build().train()
    cal, loader = _calibrator(model, _Stop(None))
    batches = loader.upcoming(3)
    figures = cal()
    assert loader.samples_consumed == 10 and model.training
    gains = model.core.extra_loop_gain.tolist()
    assert gains[:2] == [1.0, 1.0] and all(g in (0.0, *GAINS) for g in gains[2:])
    assert figures["loop_gain_3"] == gains[2] and figures["loop_gain_4"] == gains[3]

    def total(n_loops):  # (summed cross-entropy in nats, labels) over the calibration batches
        with torch.no_grad():
            both = [window_cross_entropy(model.eval()(x, n_loops=n_loops).logits, y) for x, y in batches]
        return sum(float(ce.sum()) for ce, _ in both), sum(float(n.sum()) for _, n in both)

    (at2, labels), (at4, _) = total(2), total(4)
    assert at4 <= at2 + 1e-6 * abs(at2)
    assert figures["calib_gain_bpb"] == pytest.approx((at4 - at2) / math.log(2) / labels, abs=1e-6)
    model.core.extra_loop_gain[2:] = 1.0
    assert total(4)[0] != pytest.approx(at2, rel=1e-6)


def test_a_stop_during_calibration_applies_nothing():
    """A stop before the third scoring pass: nothing applied, nothing consumed. A run that trained on
    fewer micro-batches than ``calibration.steps`` calibrates on that many."""
    model = build()
    assert _calibrator(model, _Stop(None), steps=32, max_batches=5)[0].n_batches == 5
    assert _calibrator(model, _Stop(None), steps=32, max_batches=500)[0].n_batches == 32
    cal, loader = _calibrator(model, _Stop(at=3))
    assert cal() is None
    assert model.core.extra_loop_gain.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert loader.samples_consumed == 10 and model.training
