"""The per-loop LoRA of a core block folded into the weight (``attention.adapted_linear``): the same
outputs and gradients as the two rank-r passes over the rows, without those passes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spider_titan.models.spider.attention import LoRA, adapted_linear, folded_linear_flops

ROWS, IN, OUT, RANK = 48, 24, 40, 4


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(IN, OUT, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(OUT, IN, generator=g) / IN**0.5)
    a = (torch.randn(IN, RANK, generator=g) / IN**0.5).requires_grad_()
    b = (0.1 * torch.randn(RANK, OUT, generator=g)).requires_grad_()
    x = torch.randn(2, ROWS // 2, IN, generator=g).requires_grad_()
    return linear, LoRA(a, b), x


def _run(fold: bool):
    linear, lora, x = _inputs()
    y = adapted_linear(linear, x, lora, fold)
    (y * torch.linspace(-1, 1, OUT)).sum().backward()
    return y.detach(), [t.grad for t in (x, linear.weight, lora.a, lora.b)]


def test_the_folded_update_computes_what_the_rank_r_passes_compute():
    y_fold, g_fold = _run(fold=True)
    y_rows, g_rows = _run(fold=False)
    linear, _, x = _inputs()
    assert (y_rows - linear(x).detach()).abs().max() > 1e-2  # the update is not vacuous
    torch.testing.assert_close(y_fold, y_rows, atol=1e-5, rtol=1e-5)
    for got, want in zip(g_fold, g_rows):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fold", [True, False])
def test_folding_replaces_the_passes_over_the_rows(fold):
    """Matmul FLOPs, forward: folded, the one GEMM over the rows and the (out x r) @ (r x in) fold;
    not folded, the GEMM plus the two rank-r passes over every row. (Imported here: the FLOP counter
    imports Triton, which must not load before tests/unit/test_moe_triton.py sets its interpreter.)"""
    from torch.utils.flop_counter import FlopCounterMode

    linear, lora, x = _inputs()
    with FlopCounterMode(display=False, custom_mapping=folded_linear_flops()) as counter:
        adapted_linear(linear, x, lora, fold)
    gemm = 2 * ROWS * IN * OUT
    expected = gemm + (2 * OUT * RANK * IN if fold else 2 * ROWS * RANK * (IN + OUT))
    assert counter.get_total_flops() == expected


def test_a_linear_with_its_own_forward_is_not_folded():
    """A subclass of nn.Linear (torchao's float8 linear is one) runs its own GEMM: the update is added
    to its output."""
    calls = []

    class OwnGemm(nn.Linear):
        def forward(self, x):
            calls.append(x.shape)
            return super().forward(x)

    linear, lora, x = _inputs()
    own = OwnGemm(IN, OUT, bias=False)
    own.load_state_dict(linear.state_dict())
    y = adapted_linear(own, x, lora, fold=True)
    assert calls == [x.shape]
    torch.testing.assert_close(y, adapted_linear(linear, x, lora, fold=False))


def test_a_partitioned_backward_keeps_the_weight_not_a_folded_copy():
    """Under AOT autograd's min-cut partitioner, with the weight an input of the graph as the planner
    traces a block (plan.py ``CompiledSaves``), the forward hands the backward the weight itself, which
    is alive anyway, and no new (out, in) tensor: the partitioner would otherwise move the backward's
    fold into the forward and save a folded weight per call (0.7 GiB for a 1B step without
    checkpointing, 36 core block calls). The gradients equal eager's."""
    from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition

    saved = []

    def forward_compiler(gm, _):
        saved.extend(gm.graph.output_node().args[0])
        return make_boxed_func(gm)

    linear, lora, x = _inputs()
    params = (x, linear.weight, lora.a, lora.b)

    def _step(x, w, a, b):
        with torch.nn.utils.stateless._reparametrize_module(linear, {"weight": w}):
            return adapted_linear(linear, x, LoRA(a, b), fold=True).relu()

    compiled = aot_function(
        _step,
        fw_compiler=forward_compiler,
        bw_compiler=lambda gm, _: make_boxed_func(gm),
        partition_fn=min_cut_rematerialization_partition,
    )
    compiled(*params).sum().backward()
    got = [t.grad.clone() for t in params]
    weights = [n for n in saved if tuple(n.meta["val"].shape) == (OUT, IN)]
    assert len(weights) == 1 and weights[0].op == "placeholder", saved  # the weight, an input of the graph
    for t in params:
        t.grad = None
    _step(*params).sum().backward()
    for g, t in zip(got, params):
        torch.testing.assert_close(g, t.grad)
