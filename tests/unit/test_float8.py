"""The float8 converter: which linears convert, fallbacks, and the precision switch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spider_titan.components.builder import build_model
from spider_titan.config.manager import ConfigError, parse_args
from spider_titan.quantization import float8


def linears(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("model_name", ["dense", "spider"])
def test_converted_modules_follow_the_filter(model_name):
    cfg = parse_args(["--model.name", model_name], env={})
    spec, _, plain = build_model(cfg)
    skip = (*spec.acceleration.float8_skip_fqns, *cfg.float8.filter_fqns)
    expected = {n for n, m in linears(plain).items() if not any(f in n for f in skip)}
    assert expected, "the filter must leave something to convert"

    cfg = parse_args(["--model.name", model_name, "--model.converters", "float8"], env={})
    _, _, model = build_model(cfg)
    from torchao.float8.float8_linear import Float8Linear

    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == expected
    # every filtered name stays a plain nn.Linear
    for name in linears(plain).keys() - expected:
        assert type(model.get_submodule(name)) is nn.Linear


def test_custom_filter_skips_more():
    cfg = parse_args(
        ["--model.name", "dense", "--model.converters", "float8", "--float8.filter_fqns", "lm_head,wq"], env={}
    )
    _, _, model = build_model(cfg)
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert all(k == "Linear" for n, k in kinds.items() if "wq" in n or "lm_head" in n)
    assert any(k == "Float8Linear" for k in kinds.values())


def test_the_models_own_skip_list_holds_with_an_empty_filter():
    """``Acceleration.float8_skip_fqns`` is the model's; ``float8.filter_fqns`` only adds to it."""
    cfg = parse_args(["--model.name", "dense", "--model.converters", "float8", "--float8.filter_fqns", ""], env={})
    assert cfg.float8.filter_fqns == []
    spec, _, model = build_model(cfg)
    assert spec.acceleration.float8_skip_fqns == ("lm_head",)
    assert type(model.get_submodule("lm_head")) is nn.Linear
    assert type(model.get_submodule("layers.0.attention.wq")).__name__ == "Float8Linear"


def test_unpaddable_dim_errors_or_skips_as_configured():
    # dim 120: wq/wo/w2 outputs are not multiples of 16
    base = [
        "--model.name",
        "dense",
        "--model.dim",
        "120",
        "--model.n_heads",
        "4",
        "--model.n_kv_heads",
        "2",
        "--model.converters",
        "float8",
    ]
    with pytest.raises(ValueError, match="multiple of 16"):
        build_model(parse_args(base + ["--float8.fallback", "error"], env={}))
    _, _, model = build_model(parse_args(base + ["--float8.fallback", "warn"], env={}))
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds["layers.0.attention.wo"] == "Linear"  # 120 outputs: skipped
    assert kinds["layers.0.feed_forward.w1"] == "Float8Linear"  # 352 outputs, inner 120 padded


def test_missing_torchao_falls_back_or_errors(monkeypatch):
    monkeypatch.setattr(float8, "torchao_float8_available", lambda: (False, "torchao.float8 is not importable (test)"))
    cfg = parse_args(["--model.name", "dense", "--model.converters", "float8"], env={})
    _, _, model = build_model(cfg)
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())
    cfg.float8.fallback = "error"
    with pytest.raises(ValueError, match="not importable"):
        build_model(cfg)


def test_float8_is_chosen_by_one_list():
    """model.converters is the one switch; the old second key is refused with its replacement."""
    _, _, model = build_model(parse_args(["--model.converters", "float8"], env={}))
    assert any(type(m).__name__ == "Float8Linear" for m in model.modules())
    _, _, model = build_model(parse_args([], env={}))
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())
    renamed = {
        ("--training.precision", "fp8"): 'model.converters = ["float8"]',
        ("--parallelism.fsdp_enabled", "auto"): "renamed to parallelism.fsdp",
    }
    for old, replacement in renamed.items():
        with pytest.raises(ConfigError) as e:
            parse_args(list(old), env={})
        assert len(e.value.problems) == 1 and replacement in e.value.problems[0], e.value.problems


def test_fp8_experts_only_where_supported():
    cfg = parse_args(["--model.name", "spider", "--model.converters", "float8"], env={})
    _, _, model = build_model(cfg)
    from spider_titan.moe.layer import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    supported, _ = float8.fp8_grouped_mm_supported()
    assert layers and all(layer.align == (16 if supported else 1) for layer in layers)


def test_fp8_matmul_close_to_high_precision():
    """A converted linear computes what the original does, to fp8 accuracy."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    fp8 = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    fp8.load_state_dict(ref.state_dict())
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(fp8)
    x = torch.randn(32, 64)
    y_ref, y = ref(x), fp8(x)
    rel = (y - y_ref).norm() / y_ref.norm()
    assert 0 < rel < 0.1  # fp8 is not exact, but close


@pytest.mark.gpu
def test_fp8_grouped_experts_close_to_bf16_on_hopper():
    """On SM 9.0/10.0 the experts' fp8 grouped GEMM tracks the bf16 one (forward and gradients)."""
    supported, why = float8.fp8_grouped_mm_supported()
    if not supported:
        pytest.skip(why)
    from types import SimpleNamespace

    from spider_titan.moe.layer import MoE

    torch.manual_seed(0)
    ref = MoE(256, 8, 2, 256).cuda().bfloat16()
    ref.init_weights(0.02, 0.02)
    fp8 = MoE(256, 8, 2, 256).cuda().bfloat16()
    fp8.load_state_dict(ref.state_dict())
    model = nn.Sequential(fp8)
    assert float8._apply_fp8_experts(model, SimpleNamespace(moe_experts=True)) == 1
    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y_ref, _ = ref(x)
    y, _ = fp8(x)
    assert (y.float() - y_ref.float()).norm() / y_ref.float().norm() < 0.1
    y.float().square().mean().backward()
    assert torch.isfinite(fp8.experts.w1.grad).all()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_every_recipe_gets_pad_inner_dim(recipe):
    """The shape filter converts linears with unaligned inner dims only because they get padded."""
    cfg = parse_args(
        [
            "--model.name",
            "dense",
            "--model.dim",
            "120",
            "--model.n_heads",
            "4",
            "--model.n_kv_heads",
            "2",
            "--model.converters",
            "float8",
            "--float8.recipe",
            recipe,
        ],
        env={},
    )
    _, _, model = build_model(cfg)
    w1 = model.get_submodule("layers.0.feed_forward.w1")  # 120 -> 352: inner dim 120 needs padding
    assert type(w1).__name__ == "Float8Linear" and w1.config.pad_inner_dim


def _pretend_gpu(monkeypatch, cap: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")


@pytest.mark.parametrize(
    "cap, fails", [((7, 5), True), ((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)]
)
def test_fp8_capability_check(monkeypatch, cap, fails):
    """fp8 on a GPU below SM 8.9 fails naming the GPU, its capability, what fp8 needs and the fix."""
    _pretend_gpu(monkeypatch, cap)
    if not fails:
        float8.check_fp8_capability()
        return
    with pytest.raises(ValueError) as e:
        float8.check_fp8_capability()
    msg = str(e.value)
    assert "\n" not in msg and "NVIDIA A100-SXM4-80GB" in msg and f"capability {cap[0]}.{cap[1]}" in msg
    assert "needs 8.9" in msg and 'remove "float8" from model.converters' in msg


def test_fp8_on_an_a100_stops_the_trainer_with_one_line(monkeypatch, capsys, in_process, tmp_path):
    """Through the command line: one line on stderr, exit code 2, no traceback, nothing written."""
    from spider_titan.train import main

    _pretend_gpu(monkeypatch, (8, 0))
    dump = tmp_path / "run"
    code = main(
        [
            "--model.converters",
            "float8",
            "--training.device",
            "cpu",
            "--training.steps",
            "1",
            "--job.dump_folder",
            str(dump),
        ]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "NVIDIA A100-SXM4-80GB" in err[0] and "8.0" in err[0] and "fp8 needs 8.9" in err[0]
    assert not any(dump.rglob("*.pt")) and not any(dump.rglob("*.safetensors"))


def test_fp8_experts_copy_no_weight_per_call(monkeypatch):
    """The fp8 expert path hands torchao its weights without a weight-sized copy (forward + backward).

    torchao's fp8 grouped GEMM needs a GPU, so it is replaced by a stand-in that makes torchao's own
    layout checks (A row-major, B per-group column-major) and multiplies in bf16. Every aten op that
    writes a weight-sized tensor copy (clone, copy_, _to_copy) is counted; the former layout, which
    transposed each weight with ``.contiguous()``, made 3 per forward (one per expert weight).
    """
    from types import MethodType

    from torch.utils._python_dispatch import TorchDispatchMode
    from torchao.prototype.moe_training import fp8_grouped_mm
    from torchao.prototype.moe_training.utils import _is_column_major

    from spider_titan.moe.layer import GroupedExperts, _GroupedMM

    def stand_in(A, B_t, offs, out_dtype, pad_token_groups_for_grouped_mm):
        assert not _is_column_major(A) and _is_column_major(B_t)  # torchao's asserts
        return _GroupedMM.apply(A, B_t, offs).to(out_dtype)

    monkeypatch.setattr(fp8_grouped_mm, "_to_fp8_rowwise_then_scaled_grouped_mm", stand_in)
    E, dim, inter = 4, 64, 48
    experts = GroupedExperts(E, dim, inter).bfloat16()
    experts.init_weights(0.02, 0.02)
    experts._grouped_mm = MethodType(float8._fp8_grouped_mm, experts)
    x = torch.randn(64, dim, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    weight_numel = E * dim * inter
    copy_ops = {torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}

    class CountWeightCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.copies: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in copy_ops and isinstance(out, torch.Tensor) and out.numel() >= weight_numel:
                self.copies.append(str(func))
            return out

    with CountWeightCopies() as mode:
        experts(x, offs).float().square().sum().backward()
    assert mode.copies == []
    assert all(w.grad is not None and w.grad.is_contiguous() for w in (experts.w1, experts.w3, experts.w2))
