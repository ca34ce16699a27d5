"""Spider's parameter count (1B flavor on meta, debug) and the FLOPs helper against
torch.utils.flop_counter.FlopCounterMode (run with -s to see the breakdowns)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from spider_titan.models.spider import (
    SPIDER_FLAVORS,
    SPIDER_SPEC,
    Spider,
    parameter_breakdown,
    spider_flops_breakdown,
    spider_flops_per_byte,
)


def test_1b_parameter_count():
    with torch.device("meta"):
        model = Spider(SPIDER_FLAVORS["1B"])
    parts = parameter_breakdown(model)
    print("\nSpider 1B parameters by part:")
    for k, v in parts.items():
        print(f"  {k:>13}: {v / 1e6:9.3f} M")
    assert abs(parts["total"] - 996e6) <= 0.01 * 996e6
    assert parts["total"] == sum(p.numel() for p in model.parameters())
    # MODEL.md's breakdown: 4 dense blocks 193 M, 6 core blocks 706 M, two engrams 75 M, LoRA 5 M, rest 14 M
    for key, want in (("dense blocks", 193e6), ("core blocks", 706e6), ("engram", 75e6), ("lora", 5e6), ("rest", 14e6)):
        assert abs(parts[key] - want) < 1e6, key


def test_debug_parameter_count():
    with torch.device("meta"):
        model = Spider(SPIDER_FLAVORS["debug"])
    assert sum(p.numel() for p in model.parameters()) < 3e6


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FlopCounterMode has no formula for torch._grouped_mm: 2*M*K*N over all groups."""
    if len(out_shape) == 2:  # (M, K) x (E, K, N) -> (M, N)
        return 2 * a_shape[0] * a_shape[1] * out_shape[1]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (K, M) x (M, N) -> (E, K, N): the weight gradient
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    raise NotImplementedError(f"grouped mm {a_shape} x {b_shape} -> {out_shape}")


def _grouped_mm_ops() -> list:
    """The grouped-GEMM ops the MoE layer may dispatch: torch's, and the MoE layer's opaque wrapper
    (``spider_titan::grouped_mm``, used for dtypes torch.compile cannot trace natively)."""
    ops = [torch.ops.aten._grouped_mm]
    try:
        ops.append(torch.ops.spider_titan.grouped_mm)
    except (AttributeError, RuntimeError):
        pass
    return ops


def measured_train_flops(model: Spider, ids: torch.Tensor) -> tuple[float, dict]:
    model.train()
    counter = FlopCounterMode(display=False, custom_mapping={op: _grouped_mm_flop for op in _grouped_mm_ops()})
    torch.manual_seed(0)
    with counter:
        out = model(ids, labels=torch.roll(ids, -1, dims=1))
        out.loss.backward()
    return counter.get_total_flops(), out.aux


@pytest.mark.parametrize(
    "T, n_loops, boundary",
    [(256, None, None), (256, 4, None), (128, 3, 20.0), (192, 2, -20.0)],
    ids=["default", "4_loops", "every_byte", "forced_only"],
)
def test_flops_helper_matches_flop_counter(T, n_loops, boundary):
    args = SPIDER_FLAVORS["debug"]
    if n_loops is not None:
        args = dataclasses.replace(args, n_loops=n_loops)
    with torch.device("meta"):
        model = Spider(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    if boundary is not None:  # a constant boundary logit, through the predictor's own matmuls
        with torch.no_grad():
            model.boundary_predictor.out.weight.zero_()
            model.boundary_predictor.out.bias.fill_(boundary)
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
    measured, aux = measured_train_flops(model, ids)
    bps, loops = aux["bytes_per_segment"].item(), aux["loops_run"].item()
    predicted = spider_flops_per_byte(args, T, n_loops=loops, bytes_per_segment=bps) * T
    print(f"\nT={T} loops={loops:.0f} bytes/segment={bps:.2f}: FlopCounterMode {measured / 1e9:.4f} GFLOP, "
          f"helper {predicted / 1e9:.4f} GFLOP, ratio {predicted / measured:.4f}")
    assert abs(predicted / measured - 1) < 0.05


def test_flops_helper_is_the_spec_formula_and_scales():
    args = SPIDER_FLAVORS["1B"]
    per_byte = spider_flops_per_byte(args, 4096)
    assert SPIDER_SPEC.flops_per_token(args, 4096) == per_byte
    parts = spider_flops_breakdown(args, 4096)
    print(f"\nSpider 1B training FLOPs per byte at seq_len 4096: {per_byte / 1e9:.3f} GFLOP")
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {k:>22}: {v / 1e9:8.4f} GFLOP ({100 * v / per_byte:5.1f} %)")
    # More loops and less compression cost more; the byte-level part does not depend on either.
    assert spider_flops_per_byte(args, 4096, n_loops=12) > per_byte
    assert spider_flops_per_byte(args, 4096, bytes_per_segment=2.0) > per_byte
    assert parts["byte_blocks"] == spider_flops_breakdown(args, 4096, n_loops=12, bytes_per_segment=2.0)["byte_blocks"]
