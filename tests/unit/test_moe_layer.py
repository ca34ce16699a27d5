"""The torch MoE backend and the MoE layer, checked against the seed's Python-loop MoE."""

from __future__ import annotations

import inspect

import pytest
import torch

from spider_titan import registry
from spider_titan.moe.base import MoEBackend, max_rows
from spider_titan.moe.layer import GroupedExperts, MoE
from spider_titan.moe.python_loop import python_loop_moe
from spider_titan.moe.torch_backend import TorchMoEBackend

DIM, INTER = 16, 32


def make_moe(n_experts=4, top_k=2, align=1, seed=0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(DIM, n_experts, top_k, INTER, align=align)
    moe.init_weights(0.3, 0.3)
    return moe


def reference(moe: MoE, x: torch.Tensor, topk_idx: torch.Tensor | None = None) -> torch.Tensor:
    """An independent router (or forced experts) followed by the Python-loop experts."""
    x2 = x.reshape(-1, DIM)
    scores = torch.softmax(x2.float() @ moe.router.weight.float().t(), dim=-1)  # (T, E)
    idx = topk_idx if topk_idx is not None else (scores + moe.expert_bias).topk(moe.top_k, dim=-1).indices
    w = scores.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    e = moe.experts
    return python_loop_moe(x2, idx, w, e.w1, e.w3, e.w2).reshape(x.shape)


def grads(moe: MoE, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad, moe.router.weight.grad, moe.experts.w1.grad, moe.experts.w3.grad, moe.experts.w2.grad]


def force_experts(moe: MoE, monkeypatch, topk_idx: torch.Tensor) -> None:
    """Make the layer route to ``topk_idx`` (gate weights still come from the router)."""
    route = moe.route

    def forced(x):
        scores, _, _ = route(x)
        w = scores.gather(1, topk_idx)
        return scores, topk_idx, w / (w.sum(-1, keepdim=True) + 1e-20)

    monkeypatch.setattr(moe, "route", forced)


# ---- routing map -------------------------------------------------------------------------------


@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("T,k,E", [(1, 1, 3), (7, 2, 4), (33, 2, 8), (20, 3, 5)])
def test_map_invariants(T, k, E, align):
    g = torch.Generator().manual_seed(T * 100 + E)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # (T, k) distinct per row
    rmap = TorchMoEBackend().build_map(idx, E, align)
    R = max_rows(T, k, E, align)
    assert rmap.num_rows == R and rmap.token_slot_to_pos.shape == (T, k)
    assert R % align == 0 and R >= T * k + E * (align - 1)  # fp8 weight-gradient stride (max_rows)
    assert torch.equal(rmap.counts, torch.bincount(idx.flatten(), minlength=E))
    padded = (rmap.counts + align - 1) // align * align
    assert torch.equal(rmap.offs.long(), torch.cumsum(padded, 0)) and rmap.offs.dtype == torch.int32
    assert (rmap.offs % align == 0).all()

    pos = rmap.token_slot_to_pos
    assert pos.flatten().unique().numel() == T * k  # one row per (token, slot)
    tokens = torch.arange(T).unsqueeze(1).expand(T, k)
    assert torch.equal(rmap.pos_to_token[pos], tokens)
    assert (rmap.pos_to_token == -1).sum() == R - T * k  # every other row is padding
    starts = torch.cat([torch.zeros(1, dtype=torch.long), rmap.offs.long()[:-1]])
    for e in range(E):
        seg = rmap.pos_to_token[starts[e] : rmap.offs[e]]
        n = int(rmap.counts[e])
        assert torch.equal(seg[:n], (idx == e).any(1).nonzero().flatten())  # stable: token order
        assert (seg[n:] == -1).all()


def test_map_empty_and_single_expert():
    idx = torch.full((5, 1), 2)
    rmap = TorchMoEBackend().build_map(idx, 4, 16)
    assert rmap.counts.tolist() == [0, 0, 5, 0]
    assert rmap.offs.tolist() == [0, 0, 16, 16]
    assert rmap.token_slot_to_pos.flatten().tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "idx,E,msg",
    [
        (torch.tensor([[0, 4]]), 4, "in \\[0, 4\\)"),
        (torch.tensor([[-1, 0]]), 4, "in \\[0, 4\\)"),
        (torch.tensor([0, 1]), 4, "integer \\(T, k\\)"),
        (torch.tensor([[0.0, 1.0]]), 4, "integer \\(T, k\\)"),
    ],
)
def test_map_bad_inputs(idx, E, msg):
    with pytest.raises(ValueError, match=msg):
        TorchMoEBackend().build_map(idx, E, 1)


def test_reduce_bad_inputs():
    b = TorchMoEBackend()
    rmap = b.build_map(torch.tensor([[0, 1], [1, 2]]), 3, 1)
    y_exp = torch.randn(rmap.num_rows, 8)
    with pytest.raises(ValueError, match="weights must be"):
        b.reduce(y_exp, torch.rand(2, 3), rmap)
    with pytest.raises(ValueError, match="weights dtype"):
        b.reduce(y_exp, torch.rand(2, 2, dtype=torch.float64), rmap)
    with pytest.raises(ValueError, match="y_exp must be"):
        b.reduce(y_exp[:-1], torch.rand(2, 2), rmap)
    with pytest.raises(ValueError, match="x must be"):
        b.expand(torch.randn(3, 8), rmap)


# ---- layer vs the Python loop ------------------------------------------------------------------


def layer_and_reference(moe: MoE, x: torch.Tensor, topk_idx=None):
    """Outputs and gradients (x, router, w1, w3, w2) of the layer and of the Python loop, same cotangent."""
    out = []
    for fn in (lambda xx: moe(xx)[0], lambda xx: reference(moe, xx, topk_idx)):
        xx = x.detach().clone().requires_grad_()
        moe.zero_grad()
        y = fn(xx)
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        out.append((y.detach(), [g.clone() for g in grads(moe, xx)]))
    return out


def assert_layer_matches(moe: MoE, x: torch.Tensor, topk_idx=None, tol=1e-5):
    (y, g), (y_ref, g_ref) = layer_and_reference(moe, x, topk_idx)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    for name, a, b in zip(["x", "router", "w1", "w3", "w2"], g, g_ref):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("top_k", [1, 2])
def test_layer_matches_python_loop(align, top_k):
    moe = make_moe(top_k=top_k, align=align)
    assert_layer_matches(moe, torch.randn(3, 7, DIM))


def test_a_map_without_alignment_padding_is_filled_and_skips_the_masks(monkeypatch):
    """With align 1 the map has T k rows, all inside a group (offs[-1] = R), so the layer runs the
    experts without zeroing rows past the end, forward or backward, and gets what the masked experts
    give, bit for bit."""
    from spider_titan.moe import layer as layer_mod

    moe = make_moe(n_experts=5, top_k=2, align=1)
    x = torch.randn(3, 7, DIM)
    _, topk_idx, _ = moe.route(x.reshape(-1, DIM))
    rmap = moe.backend.build_map(topk_idx, moe.n_experts, moe.align)
    assert int(rmap.offs[-1]) == rmap.pos_to_token.shape[0] == 21 * 2
    masks = []
    real = layer_mod._zero_rows_past_end

    def spy(t, offs, filled=False):
        if not filled:
            masks.append(t.shape)
        return real(t, offs, filled)

    monkeypatch.setattr(layer_mod, "_zero_rows_past_end", spy)
    y, _ = moe(x)
    y.sum().backward()
    assert masks == []  # filled: no mask ran, forward or backward
    x_exp = torch.randn(rmap.pos_to_token.shape[0], DIM)
    e = moe.experts
    assert torch.equal(e(x_exp, rmap.offs, filled=True), e(x_exp, rmap.offs))
    assert len(masks) == 3  # the control: the default masks every product
    moe16 = make_moe(n_experts=5, top_k=2, align=16)
    moe16(x)
    assert len(masks) == 6  # align 16 pads the map: its products are masked


@pytest.mark.parametrize("align", [1, 16])
def test_all_tokens_to_one_expert(align, monkeypatch):
    """Every token to experts 1 and 3: experts 0 and 2 are empty and get exactly zero, finite grads."""
    moe = make_moe(n_experts=4, top_k=2, align=align)
    T = 9
    idx = torch.tensor([[1, 3]]).expand(T, 2).contiguous()
    force_experts(moe, monkeypatch, idx)
    x = torch.randn(T, DIM)
    assert_layer_matches(moe, x, idx)
    (y, g), _ = layer_and_reference(moe, x, idx)
    assert all(torch.isfinite(t).all() for t in [y, *g])
    for w in g[2:]:
        assert (w[[0, 2]] == 0).all() and (w[[1, 3]] != 0).any()


@pytest.mark.parametrize("align", [1, 16])
def test_top1_single_expert(align, monkeypatch):
    moe = make_moe(n_experts=4, top_k=1, align=align)
    idx = torch.full((5, 1), 2)
    force_experts(moe, monkeypatch, idx)
    (y, g), (y_ref, g_ref) = layer_and_reference(moe, torch.randn(5, DIM), idx)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for w, w_ref in zip(g[2:], g_ref[2:]):
        torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)
        assert (w[[0, 1, 3]] == 0).all() and torch.isfinite(w).all()


def test_stride0_gradient():
    """``out.sum().backward()`` hands _grouped_mm an expanded (stride-0) gradient."""
    moe = make_moe(align=16)
    x = torch.randn(6, DIM, requires_grad=True)
    y, _ = moe(x)
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and moe.experts.w2.grad.abs().sum() > 0

    experts = GroupedExperts(3, DIM, INTER)
    experts.init_weights(0.3, 0.3)
    x_exp = torch.randn(20, DIM, requires_grad=True)
    offs = torch.tensor([4, 4, 12], dtype=torch.int32)
    out = experts(x_exp, offs)
    out.sum().backward()
    assert (out[12:] == 0).all(), "rows past offs[-1] must be zero"
    assert (x_exp.grad[12:] == 0).all() and torch.isfinite(x_exp.grad).all()
    assert (experts.w1.grad[1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_loop(dtype):
    experts = GroupedExperts(3, DIM, INTER).to(dtype)
    experts.init_weights(0.3, 0.3)
    offs = torch.tensor([5, 5, 16], dtype=torch.int32)
    x_exp = torch.randn(24, DIM, dtype=dtype)
    out = experts(x_exp, offs)
    starts = [0, 5, 5]
    for e in range(3):
        xe = x_exp[starts[e] : offs[e]].float()
        w1, w3, w2 = (w[e].float().T for w in (experts.w1, experts.w3, experts.w2))  # stored (out, in)
        ref = (torch.nn.functional.silu(xe @ w1) * (xe @ w3)) @ w2
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[starts[e] : offs[e]].float(), ref, atol=tol, rtol=tol)
    assert (out[16:] == 0).all()


# ---- statistics and balancing ------------------------------------------------------------------


def test_aux_stats_respect_token_mask():
    moe = make_moe(n_experts=4, top_k=2)
    x = torch.randn(2, 6, DIM)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 3:] = False
    y, stats = moe(x, token_mask=mask)
    y_real, stats_real = moe(x[mask])
    # Masked tokens still get an output (dropless), but are invisible to the statistics.
    torch.testing.assert_close(y[mask], y_real)
    assert torch.isfinite(y[~mask]).all() and (y[~mask] != 0).any()
    torch.testing.assert_close(stats.counts, stats_real.counts)
    torch.testing.assert_close(stats.aux_loss, stats_real.aux_loss)
    assert stats.counts.sum() == 2 * int(mask.sum()) and not stats.counts.requires_grad

    # The aux loss trains the router only, through P (f has no gradient).
    stats.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0 and moe.experts.w1.grad is None

    _, stats_all = moe(x)
    assert stats_all.counts.sum() == 2 * x[..., 0].numel()


def test_aux_loss_formula():
    moe = make_moe(n_experts=4, top_k=2)
    x = torch.randn(10, DIM)
    _, stats = moe(x)
    scores, idx, _ = moe.route(x)
    f = torch.bincount(idx.flatten(), minlength=4).float() / idx.numel()
    torch.testing.assert_close(stats.aux_loss, 4 * (f * scores.mean(0)).sum())


def test_update_expert_bias_direction():
    moe = make_moe(n_experts=4)
    counts = torch.tensor([10.0, 2.0, 5.0, 3.0])  # mean 5
    moe.update_expert_bias(counts, 0.1)
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.1]))
    # The bias changes selection only, never the gate weights' source.
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))
    x = torch.randn(5, DIM)
    scores, idx, w = moe.route(x)
    assert (idx == 3).any(1).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    torch.testing.assert_close(w, scores.gather(1, idx) / scores.gather(1, idx).sum(-1, keepdim=True))


def test_layer_bf16_runs_and_is_close():
    moe = make_moe(align=16)
    x = torch.randn(4, 5, DIM)
    y32, _ = moe(x)
    moe16 = make_moe(align=16).to(torch.bfloat16)
    y16, _ = moe16(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y32, atol=5e-2, rtol=5e-2)


@pytest.mark.slow
def test_compiles_fp32():
    """torch.compile traces the layer in fp32 (torch's _grouped_mm meta kernel alone allows only bf16)."""
    moe = make_moe(align=16)
    x = torch.randn(2, 5, DIM, requires_grad=True)
    y_ref, _ = moe(x)
    y, stats = torch.compile(moe, backend="aot_eager", fullgraph=True)(x)
    (y.sum() + stats.aux_loss).backward()
    torch.testing.assert_close(y, y_ref)
    assert torch.isfinite(x.grad).all()


# ---- compute dtype under autocast --------------------------------------------------------------


def _spy_grouped_mm(monkeypatch) -> list[tuple[torch.dtype, torch.dtype]]:
    """Record the (a, b) dtypes of every grouped GEMM call (forward and backward)."""
    from spider_titan.moe import layer as layer_mod

    seen: list[tuple[torch.dtype, torch.dtype]] = []
    real = layer_mod._raw_grouped_mm

    def spy(a, b, offs):
        seen.append((a.dtype, b.dtype))
        return real(a, b, offs)

    monkeypatch.setattr(layer_mod, "_raw_grouped_mm", spy)
    return seen


@pytest.mark.parametrize("device, align", [("cpu", 1), ("cpu", 16), pytest.param("cuda", 16, marks=pytest.mark.gpu)])
def test_experts_run_in_autocast_dtype(device, align, monkeypatch):
    """Under autocast the grouped GEMM gets bf16 tokens and weights (fp32 parameters, fp32 inputs
    as RMSNorm hands them over), forward and backward, and the layer still matches the fp32 run
    within bf16 tolerance. On CUDA a non-bf16 grouped GEMM would fall back to a host-synchronising
    loop over experts."""
    moe = make_moe(align=align).to(device)
    x = torch.randn(3, 7, DIM, device=device)
    y_ref, _ = moe(x)
    seen = _spy_grouped_mm(monkeypatch)
    xx = x.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        y, stats = moe(xx)
    (y.float().sum() + stats.aux_loss).backward()
    assert len(seen) == 9  # 3 in forward, 2 per GEMM in backward
    assert all(d == (torch.bfloat16, torch.bfloat16) for d in seen), seen
    assert y.dtype == torch.float32 and moe.experts.w1.grad.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, atol=5e-2, rtol=5e-2)  # as the bf16-weights test above
    assert torch.isfinite(xx.grad).all()


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_router_stays_fp32_under_autocast(compiled):
    """The router's scores under bf16 autocast are the fp32 scores to the bit, eager and compiled
    (autocast runs a linear of fp32 inputs in bf16: the control, a plain router under autocast, differs)."""
    moe = make_moe(n_experts=8)
    x = torch.randn(64, DIM)
    scores_ref, idx_ref, _ = moe.route(x)
    route = torch.compile(moe.route, backend="aot_eager", fullgraph=True) if compiled else moe.route
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores, idx, weights = route(x)
        control = torch.softmax(torch.nn.functional.linear(x.float(), moe.router.weight.float()), dim=-1)
    assert scores.dtype == weights.dtype == torch.float32
    assert torch.equal(scores, scores_ref) and torch.equal(idx, idx_ref)
    assert not torch.equal(control, scores_ref)


def test_experts_stay_fp32_without_autocast(monkeypatch):
    moe = make_moe()
    seen = _spy_grouped_mm(monkeypatch)
    moe(torch.randn(2, 5, DIM))
    assert seen and all(d == (torch.float32, torch.float32) for d in seen), seen


def test_python_loop_runs_in_autocast_dtype(monkeypatch):
    moe = make_moe()
    x = torch.randn(11, DIM)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(11)])  # (T, k)
    w = torch.rand(11, 2)
    e = moe.experts
    ref = python_loop_moe(x, idx, w, e.w1, e.w3, e.w2)
    seen = []
    real_silu = torch.nn.functional.silu
    monkeypatch.setattr(torch.nn.functional, "silu", lambda t: seen.append(t.dtype) or real_silu(t))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = python_loop_moe(x, idx, w, e.w1, e.w3, e.w2)
    assert seen and set(seen) == {torch.bfloat16} and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("name", registry.names("moe_backend"))
def test_every_registered_backend_has_what_the_protocol_names(name):
    """The registry's moe_backend entries implement moe.base.MoEBackend, the static ``prepare`` the
    builder calls on the class included."""
    cls = registry.get("moe_backend", name)
    members = {m for m in vars(MoEBackend) if not m.startswith("_")} | set(MoEBackend.__annotations__)
    assert members >= {"name", "prepare", "build_map", "expand", "reduce"}
    assert sorted(m for m in members if not hasattr(cls, m)) == []
    assert isinstance(inspect.getattr_static(cls, "prepare"), staticmethod)
