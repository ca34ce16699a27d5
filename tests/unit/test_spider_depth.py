"""Sampled loop counts and truncated backprop through the recurrent core (recurrence.py, item 6).

Debug flavor, CPU, fp32: full backprop and fixed loops equal the plain model exactly; truncated
backprop equals a hand-written core that detaches the state; the loop count is a pure function of
the step (so every rank and micro-batch of a step agrees), and FLOPs count what ran.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from spider_titan.models.common import rope_frequencies
from spider_titan.models.spider import SPIDER_FLAVORS, spider_flops_per_byte
from spider_titan.models.spider.recurrence import initial_state, sample_loops
from tests.unit.test_spider_model import DEBUG, build, sample_ids


def loss_and_grads(model, ids, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=torch.roll(ids, -1, dims=1), **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def test_fixed_sampling_and_full_backprop_equal_the_plain_model():
    """backprop_loops = n_loops (and a step passed under fixed sampling) changes nothing: same loss
    and the same gradient on every parameter, bit for bit."""
    ids = sample_ids(0)
    plain_loss, plain = loss_and_grads(build(n_loops=3), ids)
    for overrides, kwargs in (({"backprop_loops": 3}, {}), ({"loop_sampling": "fixed"}, {"step": 7})):
        loss, grads = loss_and_grads(build(n_loops=3, **overrides), ids, **kwargs)
        assert torch.equal(loss, plain_loss)
        assert grads.keys() == plain.keys()
        for name in plain:
            assert torch.equal(grads[name], plain[name]), name


def core_inputs(model, B: int = 2, S: int = 9):
    a = model.args
    g = torch.Generator().manual_seed(3)
    s = torch.randn(B, S, a.dim, generator=g, requires_grad=True)
    freqs = rope_frequencies(a.qk_rope_head_dim, S, a.rope_theta)
    bucket_ids = torch.randint(0, a.engram_buckets, (B, S, 2), generator=g)
    seg_real = torch.ones(B, S, dtype=torch.bool)
    seg_real[1, -2:] = False
    return s, freqs, bucket_ids, seg_real, torch.randn(B, S, a.dim, generator=g)


def reference_core(core, s, freqs, bucket_ids, seg_real, n_loops: int, k: int) -> torch.Tensor:
    """The core written out by hand: the state is detached before the last k loops, the Engrams'
    keys and values are computed in every loop, and the MoE balancing loss is the mean over the last k
    loops' block calls; returns (output, aux)."""
    injected = core.inject(s)
    decay = torch.exp(-F.softplus(core.decay_lambda.float()))
    h, aux = None, []
    for i in range(n_loops):
        if i == n_loops - k and h is not None:
            h = h.detach()
        h = injected if i == 0 else decay * h + injected
        if core.loop_embedding is not None:
            h = h + core.loop_embedding.weight[i]
        loop = torch.tensor(i)
        memory = core.engram_memory(bucket_ids, s.dtype)  # again every loop, as the core computed it once did
        for block, block_memory in zip(core.layers, memory, strict=True):
            h, block_aux, _ = block(h, loop, freqs, block_memory, seg_real)
            if i >= n_loops - k:
                aux.append(block_aux)
    return core.norm(h), torch.stack(aux).mean()


def test_time_invariant_loops_iterate_one_map():
    """loop_embedding = false with loop_lora = false: no loop-specific parameter exists and the core
    at 5 loops is the hand reference without loop embeddings (the same map each loop); with a
    (non-zero) loop embedding it differs (negative control)."""
    model = build(n_loops=2, max_loops=5, loop_embedding=False, loop_lora=False).eval()
    assert not [n for n, _ in model.named_parameters() if "loop_embedding" in n or "lora" in n]
    core = model.core
    s, freqs, bucket_ids, seg_real, _ = core_inputs(model)
    with torch.no_grad():
        out = core(s, n_loops=5, freqs=freqs, bucket_ids=bucket_ids, seg_real=seg_real)
        want, _ = reference_core(core, s, freqs, bucket_ids, seg_real, 5, 5)
        torch.testing.assert_close(out.output, want, rtol=1e-5, atol=1e-6)
        other = build(n_loops=2, max_loops=5, loop_lora=False).eval()
        other.load_state_dict(model.state_dict(), strict=False)
        torch.nn.init.normal_(other.core.loop_embedding.weight, std=0.1)
        control = other.core(s, n_loops=5, freqs=freqs, bucket_ids=bucket_ids, seg_real=seg_real)
    assert not torch.allclose(control.output, want, atol=1e-3)


@pytest.mark.parametrize("k", [1, 2])
def test_truncated_backprop_equals_a_detached_reference(k):
    """k of 3 loops with a graph: the gradients of every core parameter (the loop-shared blocks,
    inject, decay, loop embeddings, LoRA) and of the input equal the hand reference's; full backprop
    gives different ones (negative control)."""
    model = build(n_loops=3, backprop_loops=k).train()
    core = model.core
    s, freqs, bucket_ids, seg_real, w = core_inputs(model)

    def grads(fn) -> dict[str, torch.Tensor]:
        core.zero_grad(set_to_none=True)
        s.grad = None
        out, aux = fn()
        ((out * w).sum() + aux).backward()
        found = {n: p.grad.clone() for n, p in core.named_parameters() if p.grad is not None}
        return found | {"input": s.grad.clone()}

    def run(backprop_loops: int):
        out = core(
            s,
            n_loops=3,
            freqs=freqs,
            bucket_ids=bucket_ids,
            seg_real=seg_real,
            backprop_loops=backprop_loops,
        )
        assert out.loops_run == 3 and out.backprop_loops == (backprop_loops or 3)
        return out.output, out.moe_aux_loss

    got = grads(lambda: run(k))
    want = grads(lambda: reference_core(core, s, freqs, bucket_ids, seg_real, 3, k))
    full = grads(lambda: run(0))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    # LoRA adapters of the no-grad loops get exactly zero gradient; with full backprop they do not.
    lora = "layers.0.lora.wq_b"  # B (A gets no gradient while B is zero at init)
    assert got[lora][: 3 - k].abs().max() == 0 < full[lora][: 3 - k].abs().max()
    assert not torch.allclose(got["inject.weight"], full["inject.weight"])


def test_sampled_loop_count_is_a_function_of_the_step():
    """Every rank and micro-batch of a step computes the same count from (args, step) alone; counts
    vary over steps, stay in [1, max_loops] and average n_loops (the cap at max_loops far away)."""
    args = dataclasses.replace(SPIDER_FLAVORS["debug"], n_loops=3, max_loops=12, loop_sampling="poisson_lognormal")
    counts = [sample_loops(args, step) for step in range(4000)]
    assert counts == [sample_loops(args, step) for step in range(4000)]
    assert min(counts) == 1 and max(counts) <= 12 and len(set(counts)) >= 6
    assert abs(sum(counts) / len(counts) - 3.0) < 0.1
    debug = dataclasses.replace(DEBUG, loop_sampling="poisson_lognormal")
    capped = [sample_loops(debug, step) for step in range(4000)]
    assert max(capped) == debug.max_loops and 1.8 < sum(capped) / len(capped) <= 2.0
    one = dataclasses.replace(args, n_loops=1)
    assert {sample_loops(one, step) for step in range(100)} == {1}


def test_training_forward_runs_the_sampled_count_and_counts_its_flops():
    """In training the step's sampled count runs (eval runs n_loops whatever the step), and
    aux["flops_per_byte"] charges the no-grad loops their forward only (FlopCounterMode checks the
    formula itself: test_spider_params_flops, case "truncated")."""
    ids = sample_ids(0)
    T = ids.shape[1]
    per_byte = {}
    for k in (1, 0):
        model = build(loop_sampling="poisson_lognormal", backprop_loops=k).train()
        step = next(s for s in range(100) if sample_loops(model.args, s) == 3)
        out = model(ids, labels=torch.roll(ids, -1, dims=1), step=step)
        assert out.aux["loops_run"] == 3
        per_byte[k] = out.aux["flops_per_byte"].item()
    a = model.args
    full = spider_flops_per_byte(a, T, n_loops=3, backprop_loops=3, bytes_per_segment=4.0)
    trunc = spider_flops_per_byte(a, T, n_loops=3, backprop_loops=1, bytes_per_segment=4.0)
    one = spider_flops_per_byte(a, T, n_loops=1, backprop_loops=1, bytes_per_segment=4.0)
    assert trunc - one == pytest.approx((full - one) / 3)  # two forward-only loops: a third of two full ones
    assert per_byte[1] < per_byte[0]  # the same segmentation (same weights), fewer backward loops
    model.eval()
    with torch.no_grad():
        assert model(ids, step=step).aux["loops_run"] == a.n_loops


def all_problems(args) -> list[str]:
    """Every problem of Spider args, as the config reports them (declared ranges, then the rules between fields)."""
    from spider_titan.config.validate import model_args_problems
    from spider_titan.models.spider.model import SPIDER_SPEC

    return model_args_problems(SPIDER_SPEC, args)


def test_bad_depth_args_are_reported():
    bad = dataclasses.replace(SPIDER_FLAVORS["debug"], backprop_loops=-1, loop_sampling="uniform")
    problems = " ".join(all_problems(bad))
    assert "model.backprop_loops = -1 is not allowed" in problems, problems
    assert "model.loop_sampling = 'uniform' is not one of" in problems, problems


def test_random_initial_state_is_keyed_by_sample():
    """loop_init_std: h_0 ~ N(0, std^2), a function of the sample key (the same sample in another
    row or batch starts from the same state), different across samples; training only."""
    keys = torch.tensor([11, 12, 11])
    h0 = initial_state(keys, 40, 64, 0.5)
    assert h0.shape == (3, 40, 64)
    assert torch.equal(h0[0], h0[2]) and not torch.equal(h0[0], h0[1])
    assert torch.equal(initial_state(torch.tensor([12]), 40, 64, 0.5)[0], h0[1])
    assert abs(h0.mean().item()) < 0.02 and abs(h0.std().item() - 0.5) < 0.02
    assert initial_state(keys, 40, 64, 0.0) is None and initial_state(None, 40, 64, 0.5) is None

    ids = sample_ids(0)
    noisy, plain = build(loop_init_std=0.5), build()
    rows = torch.tensor([5, 6])
    with torch.no_grad():
        assert torch.equal(noisy.eval()(ids, sample_ids=rows).logits, plain.eval()(ids).logits)  # eval: h_0 = 0
        a = noisy.train()(ids, sample_ids=rows).logits
        b = noisy.train()(ids.flip(0), sample_ids=rows.flip(0)).logits.flip(0)  # the rows swapped
        assert not torch.allclose(a, plain.train()(ids, sample_ids=rows).logits)
    torch.testing.assert_close(a, b)


def test_tail_sampling_trains_the_deep_count_at_a_mean_of_n_loops():
    """loop_sampling = "tail": counts in {1, n_loops, deep = min(2 n_loops, max_loops)} with shares
    loop_tail * (deep - n) / (n - 1), 1 - the others, loop_tail; the mean is n_loops; a function of the step."""
    for n, max_loops, q in ((2, 4, 0.1), (3, 12, 0.2), (3, 5, 0.3)):
        args = dataclasses.replace(
            SPIDER_FLAVORS["debug"], n_loops=n, max_loops=max_loops, loop_sampling="tail", loop_tail=q
        )
        assert args.validate() == []
        counts = [sample_loops(args, step) for step in range(20000)]
        assert counts == [sample_loops(args, step) for step in range(20000)]
        deep = min(2 * n, max_loops)
        assert set(counts) == {1, n, deep}
        share = {c: counts.count(c) / len(counts) for c in (1, deep)}
        assert share[deep] == pytest.approx(q, abs=0.01)
        assert share[1] == pytest.approx(q * (deep - n) / (n - 1), abs=0.01)
        assert sum(counts) / len(counts) == pytest.approx(n, abs=0.03)
    for overrides, needle in (
        ({"n_loops": 1}, "loop_sampling: 'tail' needs n_loops >= 2"),
        ({"n_loops": 4, "max_loops": 4}, "loop_sampling: 'tail' needs n_loops >= 2"),
        ({"loop_tail": 0.4}, "loop_tail: 0.4 must be in (0, 0.3333]"),
        ({"loop_tail": 0.0}, "loop_tail = 0.0 is not allowed; use a finite number > 0"),  # its declared range
    ):
        bad = dataclasses.replace(DEBUG, loop_sampling="tail", **overrides)
        problems = [p.removeprefix("model.") for p in all_problems(bad)]
        assert any(p.startswith(needle) for p in problems), (overrides, problems)


def test_loop_step_sizes_scale_each_loops_move():
    """loop_step_size: at g = 1 (init) the model is the plain one, bit for bit; g_i = 0 makes loop i
    hand on the state it received (eval at 4 loops with g_3 = g_4 = 0 is eval at 2); in training with
    truncated backprop only the loops with a graph give their step size a gradient."""
    ids = sample_ids(0)
    plain, stepped = build().eval(), build(loop_step_size=True).eval()
    with torch.no_grad():
        assert torch.equal(stepped(ids).logits, plain(ids).logits)
        stepped.core.loop_step.copy_(torch.tensor([0.0, 0.0, -0.1, -0.1]))  # g = (1, 1, 0, 0)
        assert torch.equal(stepped.core.step_sizes(), torch.tensor([1.0, 1.0, 0.0, 0.0]))
        at2, at4 = stepped(ids, n_loops=2), stepped(ids, n_loops=4)
        assert torch.equal(at4.logits, at2.logits) and at4.aux["loops_run"] == 4
        assert at4.aux["loop_step_3"] == 0 and at4.aux["loop_step_1"] == 1
        stepped.core.loop_step.copy_(torch.tensor([0.0, 0.0, -0.05, -0.1]))  # g_3 = 1/2 moves it
        assert not torch.allclose(stepped(ids, n_loops=4).logits, at2.logits)
    model = build(loop_step_size=True, backprop_loops=2).train()
    out = model(ids, labels=torch.roll(ids, -1, dims=1), n_loops=4)
    out.loss.backward()
    grad = model.core.loop_step.grad
    assert torch.equal(grad[:2], torch.zeros(2)) and bool((grad[2:] != 0).all()), grad
