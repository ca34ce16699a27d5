"""The Triton MoE backend against the torch reference backend.

Without CUDA the kernels run in Triton's CPU interpreter. Triton reads ``TRITON_INTERPRET`` when a
kernel is defined, so the switch is set at the top of this module, before anything imports Triton
(our kernels are imported lazily, when a ``TritonMoEBackend`` is built). ``torch`` is imported
first only to ask whether CUDA exists; importing torch does not import Triton. ``setdefault``
keeps a value the caller chose. On a CUDA machine the same tests run the compiled kernels on the
GPU, and the ``gpu``-marked ones add larger shapes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from spider_titan.moe.layer import MoE  # noqa: E402
from spider_titan.moe.torch_backend import TorchMoEBackend  # noqa: E402
from spider_titan.moe.triton_backend import TritonMoEBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH, TRITON = TorchMoEBackend(), TritonMoEBackend()
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_topk(T: int, k: int, E: int, seed: int, device=DEVICE) -> torch.Tensor:
    """(T, k) distinct experts per token, like a router's top-k."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)


# (T, k, E): T = 1, random, more experts than slots (empty experts), top-1 and top-2, odd E.
SHAPES = [(1, 1, 4), (1, 2, 4), (13, 1, 4), (29, 2, 8), (6, 2, 16), (40, 3, 5)]


def cases():
    for align in (1, 16):
        for T, k, E in SHAPES:
            yield pytest.param(random_topk(T, k, E, seed=T * 31 + E), E, align, id=f"T{T}-k{k}-E{E}-a{align}")
        for k in (1, 2):  # every token to the same expert(s): the others are empty
            idx = torch.arange(k, device=DEVICE).add(1).expand(11, k).contiguous()
            yield pytest.param(idx, 4, align, id=f"one-expert-k{k}-a{align}")


def assert_maps_equal(a, b):
    for field in ("token_slot_to_pos", "pos_to_token", "counts", "offs"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and torch.equal(x, y), field


@pytest.mark.parametrize("topk_idx,E,align", list(cases()))
def test_maps_equal(topk_idx, E, align):
    assert_maps_equal(TORCH.build_map(topk_idx, E, align), TRITON.build_map(topk_idx, E, align))


def expand_reduce(backend, x, y_exp, w, rmap, stride0: bool):
    """Forward outputs and input gradients of expand and reduce, with one fixed cotangent."""
    x, y_exp, w = (t.detach().clone().requires_grad_() for t in (x, y_exp, w))
    x_exp = backend.expand(x, rmap)
    y = backend.reduce(y_exp, w, rmap)
    if stride0:
        (x_exp.sum() + y.sum()).backward()
    else:
        g_exp, g = (torch.linspace(-3, 2, t.numel(), device=t.device).reshape(t.shape).to(t.dtype) for t in (x_exp, y))
        ((x_exp * g_exp).sum() + (y * g).sum()).backward()
    return [x_exp, y, x.grad, y_exp.grad, w.grad]


@pytest.mark.parametrize("stride0", [False, True], ids=["dense-grad", "stride0-grad"])
@pytest.mark.parametrize("topk_idx,E,align", list(cases()))
def test_expand_reduce_fp32(topk_idx, E, align, stride0):
    T, k = topk_idx.shape
    rmap = TORCH.build_map(topk_idx, E, align)
    torch.manual_seed(0)
    x = torch.randn(T, 24, device=DEVICE)
    y_exp = torch.randn(rmap.num_rows, 24, device=DEVICE)
    w = torch.rand(T, k, device=DEVICE)
    ref = expand_reduce(TORCH, x, y_exp, w, rmap, stride0)
    got = expand_reduce(TRITON, x, y_exp, w, rmap, stride0)
    for name, a, b in zip(["x_exp", "y", "dx", "dy_exp", "dw"], got, ref):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    assert (got[0][rmap.pos_to_token < 0] == 0).all() and (got[3][rmap.pos_to_token < 0] == 0).all()


@pytest.mark.parametrize("align", [1, 16])
def test_expand_reduce_bf16(align):
    topk_idx = random_topk(21, 2, 6, seed=3)
    rmap = TORCH.build_map(topk_idx, 6, align)
    torch.manual_seed(0)
    x = torch.randn(21, 40, device=DEVICE, dtype=torch.bfloat16)
    y_exp = torch.randn(rmap.num_rows, 40, device=DEVICE, dtype=torch.bfloat16)
    for w_dtype in (torch.float32, torch.bfloat16):
        w = torch.rand(21, 2, device=DEVICE, dtype=w_dtype)
        ref = expand_reduce(TORCH, x, y_exp, w, rmap, stride0=False)
        got = expand_reduce(TRITON, x, y_exp, w, rmap, stride0=False)
        for name, a, b in zip(["x_exp", "y", "dx", "dy_exp", "dw"], got, ref):
            assert a.dtype == b.dtype, name
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")
        # dx sums two bf16 rows exactly in fp32, so only the final rounding can differ: it must be
        # round-to-nearest-even like torch's (the interpreter's own bf16 cast truncates).
        assert torch.equal(got[2], ref[2])


def test_deterministic():
    topk_idx = random_topk(50, 2, 4, seed=1)
    rmap = TRITON.build_map(topk_idx, 4, 16)
    x, w = torch.randn(50, 32, device=DEVICE), torch.rand(50, 2, device=DEVICE)
    y_exp = torch.randn(rmap.num_rows, 32, device=DEVICE)
    first, second = (expand_reduce(TRITON, x, y_exp, w, rmap, stride0=False) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_non_contiguous_inputs():
    topk_idx = random_topk(9, 2, 4, seed=2)
    rmap = TRITON.build_map(topk_idx.t().contiguous().t(), 4, 1)
    assert_maps_equal(rmap, TORCH.build_map(topk_idx, 4, 1))
    x = torch.randn(16, 9, device=DEVICE).t()  # (9, 16), column-major
    y_exp = torch.randn(16, rmap.num_rows, device=DEVICE).t()
    w = torch.rand(2, 9, device=DEVICE).t()
    torch.testing.assert_close(TRITON.expand(x, rmap), TORCH.expand(x, rmap))
    torch.testing.assert_close(TRITON.reduce(y_exp, w, rmap), TORCH.reduce(y_exp, w, rmap), atol=1e-5, rtol=1e-5)


# ---- the whole layer with the backend swapped --------------------------------------------------


def layer_outputs(moe: MoE, backend, x: torch.Tensor, stride0: bool):
    moe.backend = backend
    moe.zero_grad()
    xx = x.detach().clone().requires_grad_()
    y, stats = moe(xx)
    if stride0:
        (y.sum() + stats.aux_loss).backward()
    else:
        g = torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape).to(y.dtype)
        ((y * g).sum() + stats.aux_loss).backward()
    params = [moe.router.weight, moe.experts.w1, moe.experts.w3, moe.experts.w2]
    return [y, stats.counts, xx.grad] + [p.grad.clone() for p in params]


NAMES = ["y", "counts", "dx", "d_router", "d_w1", "d_w3", "d_w2"]


@pytest.mark.parametrize("stride0", [False, True], ids=["dense-grad", "stride0-grad"])
@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("top_k", [1, 2])
def test_layer_matches_torch_backend(top_k, align, stride0):
    torch.manual_seed(0)
    moe = MoE(16, 4, top_k, 32, align=align).to(DEVICE)
    moe.init_weights(0.3, 0.3)
    x = torch.randn(2, 7, 16, device=DEVICE)
    ref = layer_outputs(moe, TORCH, x, stride0)
    got = layer_outputs(moe, TRITON, x, stride0)
    for name, a, b in zip(NAMES, got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("align", [1, 16])
def test_layer_all_tokens_to_one_expert(align, monkeypatch):
    torch.manual_seed(0)
    moe = MoE(16, 4, 2, 32, align=align).to(DEVICE)
    moe.init_weights(0.3, 0.3)
    with torch.no_grad():  # expert 2 and 3 win every token by a wide margin
        moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 10.0]))
    x = torch.randn(9, 16, device=DEVICE)
    ref = layer_outputs(moe, TORCH, x, stride0=False)
    got = layer_outputs(moe, TRITON, x, stride0=False)
    for name, a, b in zip(NAMES, got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    for dw in got[4:]:
        assert (dw[:2] == 0).all() and torch.isfinite(dw).all()


def test_layer_bf16():
    torch.manual_seed(0)
    moe = MoE(16, 4, 2, 32, align=16).to(DEVICE, torch.bfloat16)
    moe.init_weights(0.3, 0.3)
    x = torch.randn(3, 5, 16, device=DEVICE, dtype=torch.bfloat16)
    ref = layer_outputs(moe, TORCH, x, stride0=False)
    got = layer_outputs(moe, TRITON, x, stride0=False)
    assert got[0].dtype == torch.bfloat16
    for name, a, b in zip(NAMES, got, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", [TORCH, TRITON], ids=["torch", "triton"])
def test_layer_compiles_fullgraph(backend):
    """torch.compile(fullgraph=True) traces the whole layer, forward and backward, with either
    backend (the Triton kernels are custom ops with fake kernels), and matches eager within 1e-5."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    moe = MoE(16, 4, 2, 32, align=16).to(DEVICE)
    moe.init_weights(0.3, 0.3)
    moe.count_load = True  # aux-free balancing's in-forward counting compiles too
    x = torch.randn(2, 7, 16, device=DEVICE)
    ref = layer_outputs(moe, backend, x, stride0=False) + [moe.step_counts.clone()]
    moe.step_counts.zero_()
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    got = layer_outputs(compiled, backend, x, stride0=False) + [moe.step_counts.clone()]
    assert got[-1].sum() == 2 * 14
    for name, a, b in zip([*NAMES, "step_counts"], got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_layer_under_autocast_computes_in_bf16(monkeypatch):
    """Under autocast (fp32 weights and inputs) the Triton path expands bf16 tokens and the grouped
    GEMM gets bf16; the result equals the torch backend's under the same autocast."""
    from spider_titan.moe import layer as layer_mod
    from spider_titan.moe import triton_backend

    seen = {"expand": [], "mm": []}
    real_expand, real_mm = triton_backend._expand, layer_mod._raw_grouped_mm
    monkeypatch.setattr(triton_backend, "_expand", lambda x, *a: seen["expand"].append(x.dtype) or real_expand(x, *a))
    monkeypatch.setattr(
        layer_mod, "_raw_grouped_mm", lambda a, b, o: seen["mm"].append((a.dtype, b.dtype)) or real_mm(a, b, o)
    )
    torch.manual_seed(0)
    moe = MoE(16, 4, 2, 32, align=16).to(DEVICE)
    moe.init_weights(0.3, 0.3)
    x = torch.randn(3, 5, 16, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        ref = layer_outputs(moe, TORCH, x, stride0=False)
        got = layer_outputs(moe, TRITON, x, stride0=False)
    assert seen["expand"] == [torch.bfloat16]
    assert seen["mm"] and set(seen["mm"]) == {(torch.bfloat16, torch.bfloat16)}
    for name, a, b in zip(NAMES, got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# ---- input validation and the import guard -----------------------------------------------------


def test_bad_inputs_raise():
    rmap = TRITON.build_map(random_topk(4, 2, 3, seed=0), 3, 1)
    y_exp = torch.randn(rmap.num_rows, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"in \[0, 3\)"):
        TRITON.build_map(torch.tensor([[0, 3]]), 3, 1)
    with pytest.raises(ValueError, match=r"in \[0, 3\)"):
        TRITON.build_map(torch.tensor([[-1, 0]]), 3, 1)
    with pytest.raises(ValueError, match="integer"):
        TRITON.build_map(torch.tensor([0, 1]), 3, 1)
    with pytest.raises(ValueError, match="align"):
        TRITON.build_map(torch.tensor([[0, 1]]), 3, 0)
    with pytest.raises(ValueError, match="x must be"):
        TRITON.expand(torch.randn(5, 8, device=DEVICE), rmap)
    with pytest.raises(ValueError, match="x must be"):
        TRITON.expand(torch.randn(4, 2, 4, device=DEVICE), rmap)
    with pytest.raises(ValueError, match="weights must be"):
        TRITON.reduce(y_exp, torch.rand(4, 1, device=DEVICE), rmap)
    with pytest.raises(ValueError, match="weights dtype"):
        TRITON.reduce(y_exp.bfloat16(), torch.rand(4, 2, device=DEVICE, dtype=torch.float16), rmap)
    with pytest.raises(ValueError, match="y_exp must be"):
        TRITON.reduce(y_exp[1:], torch.rand(4, 2, device=DEVICE), rmap)


@pytest.mark.slow
def test_import_without_triton_fails_only_on_construction():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import spider_titan.moe.triton_backend as tb\n"
        "try:\n    tb.TritonMoEBackend()\n"
        "except ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("ERR MoE backend 'triton' needs a working Triton") and 'backend = "torch"' in out


# ---- CUDA only ---------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("align", [1, 16])
def test_gpu_large_bf16_layer(align):
    torch.manual_seed(0)
    moe = MoE(256, 32, 2, 128, align=align).to("cuda", torch.bfloat16)
    moe.init_weights(0.02, 0.02)
    x = torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16)
    topk_idx = moe.route(x.reshape(-1, 256))[1]
    assert_maps_equal(TORCH.build_map(topk_idx, 32, align), TRITON.build_map(topk_idx, 32, align))
    ref = layer_outputs(moe, TORCH, x, stride0=False)
    got = layer_outputs(moe, TRITON, x, stride0=False)
    for name, a, b in zip(NAMES, got, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@gpu
def test_gpu_device_mismatch_raises():
    rmap = TRITON.build_map(random_topk(4, 2, 3, seed=0), 3, 1)
    y_exp = torch.randn(rmap.num_rows, 8, device="cuda")
    with pytest.raises(ValueError, match="one device"):
        TRITON.reduce(y_exp, torch.rand(4, 2), rmap)
    with pytest.raises(ValueError, match="x is on"):
        TRITON.expand(torch.randn(4, 8), rmap)
