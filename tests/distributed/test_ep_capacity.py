"""Expert parallel's fixed-capacity dispatch (parallel/expert_parallel.py): the layout against a loop,
and one MoE layer on 2 gloo ranks against the dynamic dispatch and a single-process reference."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from spider_titan.parallel.expert_parallel import CAPACITY_ALIGN, capacity_layout, capacity_rows
from spider_titan.parallel.mesh import destroy_process_groups


def _reference_layout(offs: list[int], capacity: int, rows: int, real: list[bool]) -> tuple[list[int], list[int]]:
    send, back = [], [len(offs) * capacity] * rows
    start = 0
    for e, end in enumerate(offs):
        members = [r for r in range(start, end) if real[r]] + [r for r in range(start, end) if not real[r]]
        for slot in range(capacity):
            send.append(members[slot] if slot < len(members) else rows)
            if slot < len(members):
                back[members[slot]] = e * capacity + slot
        start = end
    return send, back


@pytest.mark.parametrize("seed", range(6))
def test_capacity_layout_matches_a_loop(seed):
    """Each expert's slots go to its real rows first, then its padding rows, each in buffer order."""
    g = torch.Generator().manual_seed(seed)
    E, capacity = 6, int(torch.randint(1, 6, (), generator=g))
    counts = torch.randint(0, 9, (E,), generator=g)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = int(offs[-1]) + int(torch.randint(0, 4, (), generator=g))  # padding rows past the last expert
    real = torch.rand(rows, generator=g) < (0.7 if seed % 2 else 1.0)
    send, back = capacity_layout(offs, capacity, rows, real)
    ref_send, ref_back = _reference_layout(offs.tolist(), capacity, rows, real.tolist())
    assert send.tolist() == ref_send and back.tolist() == ref_back
    if seed % 2 == 0:  # all real: the same layout as no mask at all
        plain = capacity_layout(offs, capacity, rows)
        assert torch.equal(plain[0], send) and torch.equal(plain[1], back)


def test_capacity_rows_rounds_the_balanced_share_up():
    assert capacity_rows(1.25, 4096, 2, 32) == 320  # the 1B flavor: 4 x 4096 bytes / 4 per segment
    assert capacity_rows(1.0, 32, 2, 8) == CAPACITY_ALIGN  # share 8, at least one aligned block
    assert capacity_rows(1.0, 100, 2, 8) == 32  # share 25 -> 32


# ----------------------------------------------------------------- one MoE layer, 2 ranks

DIM, E, TOP_K, INTER, T = 16, 4, 2, 16, 24


def _layer():
    from spider_titan.moe.layer import MoE

    torch.manual_seed(0)
    moe = MoE(dim=DIM, n_experts=E, top_k=TOP_K, inter_dim=INTER)
    moe.init_weights(0.5, 0.5)
    return moe


def _tokens(rank: int) -> torch.Tensor:
    # A skewed batch (a shared offset), so some experts overflow a small capacity.
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(T, DIM, generator=g) + 1.5


def _kept(topk_idx: torch.Tensor, capacity: int) -> torch.Tensor:
    """(T, k) bool: the (token, slot) pairs within their expert's first ``capacity`` in buffer order
    (expert-major, then token, then slot: the routing map's stable order)."""
    seen = [0] * E
    kept = torch.zeros_like(topk_idx, dtype=torch.bool)
    for t in range(topk_idx.shape[0]):
        for j in range(topk_idx.shape[1]):
            e = int(topk_idx[t, j])
            kept[t, j] = seen[e] < capacity
            seen[e] += 1
    return kept


def _worker(rank: int, world_size: int, store: str, out: str, factors: tuple[float, ...]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        for factor in factors:
            torch.save(_one_factor(rank, mesh, factor), f"{out}.{factor}.{rank}")
    finally:
        destroy_process_groups()


def _one_factor(rank: int, mesh, factor: float) -> dict:
    """Dynamic then capacity dispatch of this rank's tokens: outputs, gradients, C, dropped fraction."""
    from torch.distributed.tensor import DTensor

    from spider_titan.parallel.expert_parallel import apply_expert_parallel, dropped_pairs_report

    results = {}
    for dispatch in ("dynamic", "capacity"):
        moe = _layer()
        apply_expert_parallel(moe, mesh, dispatch=dispatch, capacity_factor=factor, capacity_tokens=T)
        moe.train()
        x = _tokens(rank).requires_grad_()
        y, _ = moe(x)
        (y * torch.linspace(-1, 1, DIM)).sum().backward()
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in moe.named_parameters()}
        results[dispatch] = {"y": y.detach(), "x_grad": x.grad, "grads": grads}
    results["capacity_rows"] = moe.experts.capacity
    results["dropped_frac"] = dropped_pairs_report(moe)()["moe_dropped_frac"]
    return results


def _run(factors: tuple[float, ...]) -> dict[float, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        torch.multiprocessing.spawn(_worker, args=(2, str(Path(tmp) / "store"), out, factors), nprocs=2)
        return {f: [torch.load(f"{out}.{f}.{r}") for r in range(2)] for f in factors}


@pytest.mark.slow
def test_capacity_dispatch_equals_dynamic_without_overflow_and_drops_exactly_past_capacity():
    """Factor 4 (C = 48 = T * k, nothing can overflow): capacity equals dynamic dispatch, outputs and
    every gradient within 1e-6. Factor 0.5 (C = 16): each rank's output equals the single-process MoE
    with the pairs past their expert's capacity given weight 0, and the logged fraction is theirs."""
    from spider_titan.moe.python_loop import python_loop_moe

    runs = _run((4.0, 0.5))
    for res in runs[4.0]:
        assert res["capacity_rows"] == 48 and float(res["dropped_frac"]) == 0.0
        cap, dyn = res["capacity"], res["dynamic"]
        torch.testing.assert_close(cap["y"], dyn["y"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(cap["x_grad"], dyn["x_grad"], rtol=1e-6, atol=1e-6)
        assert sorted(cap["grads"]) == sorted(dyn["grads"])
        for name, g in dyn["grads"].items():
            torch.testing.assert_close(cap["grads"][name], g, rtol=1e-6, atol=1e-6, msg=name)

    moe = _layer()
    dropped = []
    for rank, res in enumerate(runs[0.5]):
        assert res["capacity_rows"] == 16
        x = _tokens(rank)
        with torch.no_grad():
            _, topk_idx, weights = moe.route(x)
            kept = _kept(topk_idx, 16)
            ref = python_loop_moe(x, topk_idx, weights * kept, moe.experts.w1, moe.experts.w3, moe.experts.w2)
        torch.testing.assert_close(res["capacity"]["y"], ref, rtol=1e-5, atol=1e-6)
        frac = float((~kept).sum()) / kept.numel()
        assert float(res["dropped_frac"]) == pytest.approx(frac)
        dropped.append(frac)
    assert max(dropped) > 0.05, dropped  # the case really drops
