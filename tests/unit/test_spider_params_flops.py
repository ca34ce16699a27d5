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
from spider_titan.models.spider.attention import folded_linear_flops
from spider_titan.moe.layer import grouped_mm_flop, grouped_mm_ops


def test_1b_parameter_count():
    with torch.device("meta"):
        model = Spider(SPIDER_FLAVORS["1B"])
    parts = parameter_breakdown(model)
    print("\nSpider 1B parameters by part:")
    for k, v in parts.items():
        print(f"  {k:>13}: {v / 1e6:9.3f} M")
    assert abs(parts["total"] - 996e6) <= 0.01 * 996e6
    assert parts["total"] == sum(p.numel() for p in model.parameters())
    # docs/model.md's breakdown: 4 dense blocks 193 M, 6 core blocks 706 M, two engrams 75 M, LoRA 5 M,
    # rest 22 M (the H-Net cosine boundary predictor's two dim x dim projections, the residual_proj)
    for key, want in (("dense blocks", 193e6), ("core blocks", 706e6), ("engram", 75e6), ("lora", 5e6), ("rest", 22e6)):
        assert abs(parts[key] - want) < 1e6, key


def test_debug_parameter_count():
    with torch.device("meta"):
        model = Spider(SPIDER_FLAVORS["debug"])
    assert sum(p.numel() for p in model.parameters()) < 3e6


def _causal_sdpa_flop(q_shape, k_shape, v_shape, *args, **kwargs) -> int:
    """CPU flash attention (fwd), which this CPU build's FlopCounterMode does not count: QK^T and
    PV, causal-halved (the convention of both models' FLOPs helpers)."""
    b, h, tq, d = q_shape
    tk, dv = k_shape[-2], v_shape[-1]
    return (2 * b * h * tq * tk * d + 2 * b * h * tq * tk * dv) // 2


def _causal_sdpa_backward_flop(grad_shape, q_shape, k_shape, v_shape, *args, **kwargs) -> int:
    """Its backward: dQ, dK, dV and dP, twice the forward's matmuls."""
    return 2 * _causal_sdpa_flop(q_shape, k_shape, v_shape)


def _causal_math_sdpa_bmm_flop(a_shape, b_shape, *args, **kwargs) -> int:
    """MLA's query/key and value head widths differ, so CPU SDPA runs its math kernel: QK^T and
    PV as full T x T bmm (masked afterwards). Spider has no other bmm (pooling is a scatter/gather,
    LoRA is mm), so every bmm here is causal attention: count half, the helpers' convention."""
    b, m, k = a_shape
    return b * m * k * b_shape[-1]  # 2*b*m*k*n / 2


def flop_counter(halve_bmm: bool = False) -> FlopCounterMode:
    """FlopCounterMode plus what this CPU build does not count (grouped GEMM, CPU flash
    attention), by formula; ``halve_bmm`` counts math-kernel attention causal-halved (Spider)."""
    mapping = {op: grouped_mm_flop for op in grouped_mm_ops()}
    mapping.update(folded_linear_flops())  # opaque ops: their matmuls by formula
    if halve_bmm:
        mapping[torch.ops.aten.bmm] = _causal_math_sdpa_bmm_flop
    mapping[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _causal_sdpa_flop
    mapping[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward] = _causal_sdpa_backward_flop
    return FlopCounterMode(display=False, custom_mapping=mapping)


def measured_train_flops(model, ids: torch.Tensor) -> tuple[float, dict]:
    model.train()
    counter = flop_counter(halve_bmm=isinstance(model, Spider))
    torch.manual_seed(0)
    with counter:
        out = model(ids, labels=torch.roll(ids, -1, dims=1))
        out.loss.backward()
    return counter.get_total_flops(), out.aux


@pytest.mark.parametrize(
    "B, T, overrides, threshold",
    [
        (2, 256, {}, None),
        (1, 256, {"n_loops": 4}, None),
        (1, 128, {}, -1e3),
        (1, 192, {}, 1e3),
        (2, 128, {"boundary_predictor": "fixed", "engram_layers": []}, None),
        (2, 256, {"chunk_convention": "mean"}, None),
        (2, 256, {"boundary_dim": 0}, None),
        (2, 256, {"byte_ngram_orders": [2, 3, 4]}, None),
    ],
    ids=[
        "default",
        "4_loops",
        "every_byte",
        "forced_only",
        "fixed_no_engram",
        "mean_convention",
        "full_width_predictor",
        "byte_ngrams",  # table lookups: no FLOPs in either count
    ],
)
def test_flops_per_byte_matches_flop_counter(B, T, overrides, threshold):
    """aux["flops_per_byte"] of a training forward (the step's real segment count and loops) agrees
    with FlopCounterMode over forward + backward within 5 %. ``threshold``: the cosine predictor's,
    so far off that every byte ends a segment (-1e3) or only the forced boundaries do (1e3)."""
    args = dataclasses.replace(SPIDER_FLAVORS["debug"], **overrides)
    with torch.device("meta"):
        model = Spider(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    if threshold is not None:  # a constant boundary decision, through the predictor's own matmuls
        with torch.no_grad():
            model.boundary_predictor.threshold.fill_(threshold)
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    measured, aux = measured_train_flops(model, ids)
    predicted = aux["flops_per_byte"].item() * B * T
    print(
        f"\nB={B} T={T} loops={aux['loops_run'].item():.0f} bytes/segment={aux['bytes_per_segment'].item():.2f}: "
        f"FlopCounterMode {measured / 1e9:.4f} GFLOP, aux {predicted / 1e9:.4f} GFLOP, ratio {predicted / measured:.4f}"
    )
    assert abs(predicted / measured - 1) < 0.05


def test_boundary_dim_saving_matches_flop_counter():
    """The predictor is ~5 % of the FLOPs, inside the 5 % above: so the saving of a narrow predictor is
    checked on its own. A cosine predictor whose threshold no score reaches places only the forced
    boundaries, so it segments alike at any width; the difference of FlopCounterMode's totals between
    full width and boundary_dim 16 is the formula's difference within 1 %."""
    totals = {}
    for width in (0, 16):
        args = dataclasses.replace(SPIDER_FLAVORS["debug"], boundary_dim=width)
        torch.manual_seed(0)
        model = Spider(args)
        model.init_weights()
        with torch.no_grad():
            model.boundary_predictor.threshold.fill_(1e3)
        ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
        measured, aux = measured_train_flops(model, ids)
        totals[width] = measured, aux["flops_per_byte"].item() * ids.numel()
    saved, predicted = totals[0][0] - totals[16][0], totals[0][1] - totals[16][1]
    assert saved > 0.02 * totals[0][0]  # not vacuous: the predictor's share is a few per cent
    assert abs(predicted / saved - 1) < 0.01, (saved, predicted)


@pytest.mark.parametrize("T", [128, 512])
def test_dense_flops_match_flop_counter(T):
    """The dense baseline's formula, same convention (causal attention halved), within 5 %."""
    from spider_titan.models.dense.model import (
        DENSE_FLAVORS,
        DenseModel,
        dense_flops_per_token,
    )

    args = DENSE_FLAVORS["debug"]
    torch.manual_seed(0)
    model = DenseModel(args)
    model.init_weights()
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(0))
    measured, _ = measured_train_flops(model, ids)
    predicted = dense_flops_per_token(args, T) * 2 * T
    print(
        f"\ndense T={T}: FlopCounterMode {measured / 1e9:.4f} GFLOP, formula {predicted / 1e9:.4f}, "
        f"ratio {predicted / measured:.4f}"
    )
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


def test_small_flavors_cost_at_least_four_times_debug_per_byte():
    """The quality study's second scale (docs/benchmarks.md) doubles every width: >= 4x debug's FLOPs per
    byte at the same bytes per segment and loops, for Spider and its dense partner alike (at the debug
    configs' seq 256). Spider `small` trains at 6 bytes per segment and one core loop, each of which spends
    less than 4 bytes and 2 loops (compared here, debug's own figures until it too trained one loop). The two
    `small` flavors read the same byte n-grams (their tables are most of their parameters)."""
    from spider_titan.models.dense.model import DENSE_FLAVORS, dense_flops_per_token

    spider = [
        spider_flops_per_byte(SPIDER_FLAVORS[f], 256, n_loops=2, bytes_per_segment=4.0) for f in ("debug", "small")
    ]
    dense = [dense_flops_per_token(DENSE_FLAVORS[f], 256) for f in ("debug", "small")]
    assert 4.0 <= spider[1] / spider[0] < 5.0 and 4.0 <= dense[1] / dense[0] < 5.0, (spider, dense)
    small = SPIDER_FLAVORS["small"]
    shipped = spider_flops_per_byte(small, 256)
    assert shipped < spider_flops_per_byte(small, 256, bytes_per_segment=4.0) < spider[1]
    assert shipped < spider_flops_per_byte(small, 256, n_loops=2)
    for key in ("byte_ngram_orders", "byte_ngram_buckets", "byte_ngram_lr"):
        assert getattr(SPIDER_FLAVORS["small"], key) == getattr(DENSE_FLAVORS["small"], key), key


def test_engram_is_computed_once_for_every_loop():
    """The Engrams' keys and values read the segments' bytes, not the state, so the core computes them
    once per forward (``Engram.memory``), not once per loop: FlopCounterMode's difference between the
    model with and without its Engrams is the same at 1 and 4 loops (per loop it would grow 4x), and
    the formula's difference matches it within 1 %."""
    spent, predicted = {}, {}
    for n_loops in (1, 4):
        totals = []
        for layers in ([0, 1], []):
            args = dataclasses.replace(
                SPIDER_FLAVORS["debug"],
                n_loops=n_loops,
                boundary_predictor="fixed",
                engram_layers=layers,
            )
            torch.manual_seed(0)
            model = Spider(args)
            model.init_weights()
            ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
            measured, aux = measured_train_flops(model, ids)
            totals.append((measured, aux["flops_per_byte"].item() * ids.numel()))
        (with_measured, with_predicted), (without_measured, without_predicted) = totals
        spent[n_loops], predicted[n_loops] = with_measured - without_measured, with_predicted - without_predicted
        assert spent[n_loops] > 0.005 * with_measured  # not vacuous
        assert abs(predicted[n_loops] / spent[n_loops] - 1) < 0.01, (n_loops, spent, predicted)
    assert abs(spent[4] / spent[1] - 1) < 0.01, spent
