"""The float8 converter: torchao Float8Linear for linears, torchao's fp8 grouped GEMM for experts.

Applied by the builder right after the model is built on the meta device (``model.converters``
contains ``"float8"``, the one switch for fp8 training):

- Linears whose FQN contains none of the model's own skip list (``Acceleration.float8_skip_fqns``: the
  parts fp8 hurts or does not speed up) nor of ``float8.filter_fqns``, and whose shapes fp8 matmuls
  accept, become ``torchao.float8.Float8Linear`` (recipe ``tensorwise`` or ``rowwise``). ``_scaled_mm``
  needs both matmul dims multiples of 16: the inner dim can be padded (``pad_inner_dim``), the
  output dim cannot; such a linear stays high precision (``fallback = "warn"``) or stops the run
  (``fallback = "error"``).
- The MoE experts' ``_grouped_mm`` is swapped for torchao's rowwise fp8 grouped GEMM where it
  runs (CUDA capability 9.0 or 10.0), with the MoE mapping padding every expert group to 16 rows.
  Elsewhere one line says why and the experts stay in high precision.
- With ``enable_fsdp_float8_all_gather`` (tensorwise only) FSDP2 all-gathers the fp8 weights, and
  :func:`build_float8_post_step_hook` precomputes every weight's scale in one fused step after
  each optimizer step.

torchao's float8 runs on CPU too (``torch._scaled_mm`` has a CPU kernel), so this path is tested
without a GPU; fp8 is only *faster* on GPUs with fp8 tensor cores (capability >= 8.9).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MethodType

import torch
from torch import nn

from spider_titan.job_config import Float8
from spider_titan.protocol import ModelSpec
from spider_titan.quantization.weight_only import quiet_torchao_import

logger = logging.getLogger("spider_titan")

FP8_GROUPED_MM_CAPABILITIES = ((9, 0), (10, 0))
FP8_ALIGN = 16


@dataclass
class Float8Report:
    """What the converter did (logged at start-up)."""

    converted: list[str] = field(default_factory=list)
    skipped_by_filter: list[str] = field(default_factory=list)
    skipped_by_shape: list[str] = field(default_factory=list)
    fp8_experts: int = 0


def torchao_float8_available() -> tuple[bool, str]:
    """(available, reason when not)."""
    try:
        with quiet_torchao_import():
            import torchao.float8  # noqa: F401
    except Exception as e:  # torchao missing or broken against this torch
        return False, f"torchao.float8 is not importable ({type(e).__name__}: {e})"
    return True, ""


def fp8_grouped_mm_supported() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "needs a CUDA device with capability 9.0 or 10.0 (this run is on CPU)"
    cap = torch.cuda.get_device_capability()
    if cap not in FP8_GROUPED_MM_CAPABILITIES:
        return False, f"needs CUDA capability 9.0 or 10.0, this GPU is {cap[0]}.{cap[1]}"
    return True, ""


def check_fp8_capability() -> None:
    """Stop at start-up when fp8 is asked of a CUDA GPU without fp8 tensor cores (below SM 8.9), where
    ``torch._scaled_mm`` would fail mid-step; on CPU fp8 is emulated and allowed (tests, debugging)."""
    if not torch.cuda.is_available():
        return
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        raise ValueError(
            f'model.converters = ["float8"]: {torch.cuda.get_device_name()} has CUDA capability '
            f'{cap[0]}.{cap[1]}, fp8 needs 8.9 or newer (Ada, Hopper, Blackwell); remove "float8" from '
            "model.converters to train in bf16"
        )


def _shape_ok(mod: nn.Linear, pad_inner_dim: bool) -> bool:
    return mod.out_features % 16 == 0 and (pad_inner_dim or mod.in_features % 16 == 0)


def apply_float8(model: nn.Module, spec: ModelSpec, cfg: Float8) -> list[Callable[[], None]]:
    """Convert ``model`` (built from ``spec``) in place as the module docstring describes; returns the
    post-step hooks (the fp8 all-gather's scale precompute, when on) for the builder to run after every
    optimizer step."""
    ok, why = torchao_float8_available()
    if not ok:
        if cfg.fallback == "error":
            raise ValueError(f'float8: {why}; install torchao or set float8.fallback = "warn"')
        logger.warning("float8 disabled: %s; training stays in high precision", why)
        return []
    check_fp8_capability()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    skip = list(dict.fromkeys([*spec.acceleration.float8_skip_fqns, *cfg.filter_fqns]))
    report = Float8Report()
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        if any(f in fqn for f in skip):
            report.skipped_by_filter.append(fqn)
        elif not _shape_ok(mod, cfg.pad_inner_dim):
            report.skipped_by_shape.append(f"{fqn} ({mod.in_features}->{mod.out_features})")
        else:
            report.converted.append(fqn)
    if report.skipped_by_shape and cfg.fallback == "error":
        raise ValueError(
            f"float8: {len(report.skipped_by_shape)} linear(s) have an output dim that is not a multiple of 16 "
            f"and cannot be padded: {', '.join(report.skipped_by_shape[:4])}; change the model dims, add them to "
            'float8.filter_fqns, or set float8.fallback = "warn"'
        )

    if cfg.enable_fsdp_float8_all_gather and cfg.recipe != "tensorwise":
        raise ValueError('float8.enable_fsdp_float8_all_gather: needs float8.recipe = "tensorwise"')
    # pad_inner_dim for every recipe: the shape filter above let unaligned inner dims through on
    # that promise (CPU kernels accept them, GPU _scaled_mm does not).
    fp8_config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(cfg.recipe),
        enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather,
        pad_inner_dim=cfg.pad_inner_dim,
    )
    converted = set(report.converted)
    convert_to_float8_training(model, config=fp8_config, module_filter_fn=lambda mod, fqn: fqn in converted)

    report.fp8_experts = _apply_fp8_experts(model, cfg)
    logger.info(
        "float8 (%s): converted %d linears, skipped %d by filter (%s)%s, fp8 experts in %d MoE layers",
        cfg.recipe,
        len(report.converted),
        len(report.skipped_by_filter),
        ", ".join(sorted({f for f in skip if any(f in s for s in report.skipped_by_filter)})),
        f", {len(report.skipped_by_shape)} by shape: {', '.join(report.skipped_by_shape)}"
        if report.skipped_by_shape
        else "",
        report.fp8_experts,
    )
    hook = build_float8_post_step_hook(model, cfg)
    return [hook] if hook is not None else []


def _fp8_grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, filled: bool = False) -> torch.Tensor:
    """Rowwise fp8 grouped GEMM (torchao); groups 16-aligned. ``b`` arrives per-group column-major, the
    layout torchao requires, because the experts store (E, out, in) and pass it transposed
    (``GroupedExperts``): no copy of the weights here, only their fp8 quantization. ``filled`` is
    never true here (16-aligned groups pad the map)."""
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(
        a.to(torch.bfloat16),
        b.to(torch.bfloat16),
        offs,
        out_dtype=a.dtype,
        pad_token_groups_for_grouped_mm=False,
    )


def _apply_fp8_experts(model: nn.Module, cfg: Float8) -> int:
    """Swap every MoE layer's grouped GEMM for torchao's fp8 one where the GPU supports it."""
    from spider_titan.moe.layer import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers or not cfg.moe_experts:
        return 0
    ok, why = fp8_grouped_mm_supported()
    if not ok:
        logger.info("fp8 grouped experts off: %s; experts stay bf16", why)
        return 0
    for layer in layers:
        layer.align = FP8_ALIGN  # fp8 grouped GEMM needs every group size a multiple of 16
        layer.experts._grouped_mm = MethodType(_fp8_grouped_mm, layer.experts)
    tune_scale_kernel_once()
    return len(layers)


# Elements of each operand's tile per thread in torchao's dual scale kernel: every config past 16
# spilled registers at sm_90 (ptxas -v), every config within it did not.
_DUAL_ELEMENTS_PER_THREAD = 16


def tune_scale_kernel_once() -> list:
    """Make torchao's weight-gradient scale kernel (the fp8 grouped GEMM's backward) autotune once per run.

    It autotunes over 36 configs keyed on its row count, which follows the segment count: every new count
    benchmarked all 36 again mid-step, and compiling them for sm_90 took 87 s of a 2-core CPU's time, most of it
    configs that spill. Keyed on the group count alone, over the configs that do not spill. Returns the
    configs kept ([] where the kernel is not defined: no GPU Triton, another torchao)."""
    try:
        from torchao.prototype.moe_training.kernels import jagged_float8_scales
    except Exception as e:  # noqa: BLE001 (an unimportable kernel module leaves the grouped GEMM as torchao made it)
        logger.info("fp8 scale kernel left as torchao tunes it: %s: %s", type(e).__name__, e)
        return []
    kernel = getattr(jagged_float8_scales, "_triton_fp8_per_group_colwise_scales_dual_kernel", None)
    if kernel is None or not hasattr(kernel, "configs"):
        return []
    kernel.keys = [k for k in kernel.keys if k != "K"]  # K is the row count here
    kept = [
        c
        for c in kernel.configs
        if c.kwargs["BLOCK_SIZE"] * c.kwargs["BLOCK_SIZE_ITER"] <= _DUAL_ELEMENTS_PER_THREAD * 32 * c.num_warps
    ]
    kernel.configs = kept or kernel.configs
    kernel.cache.clear()
    return kernel.configs


def build_float8_post_step_hook(model: nn.Module, cfg: Float8) -> Callable[[], None] | None:
    """The post-optimizer hook for fp8 all-gather (None when it is not needed)."""
    if not (cfg.enable_fsdp_float8_all_gather and cfg.precompute_float8_dynamic_scale_for_fsdp):
        return None
    if not any(type(m).__name__ == "Float8Linear" for m in model.modules()):
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)
