"""torchao's weight-gradient scale kernel, as the float8 converter leaves it (``tune_scale_kernel_once``):
autotuned once however the row count moves, over configs that do not spill on sm_90.

torchao defines the kernel only where ``torch.utils._triton.has_triton()`` (a GPU), so a child process
claims one and runs the kernel in Triton's interpreter; each autotune miss is counted and served by
the first config, so nothing is benchmarked. The compile half lowers the kept configs for sm_90 on the CPU
and reads ptxas's spill count with tests/unit/test_triton_aot.py's ``ptxas_report``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.unit.test_triton_aot import PTXAS_REPORT, _ptxas_available

_PRELUDE = """
import json, os, sys
import torch
import torch.utils._triton as _triton_util
_triton_util.has_triton = lambda: True  # torchao defines its Triton kernels only where a GPU is
import triton.runtime.autotuner as _autotuner
_init = _autotuner.Autotuner.__init__
def _known_keys_only(self, fn, arg_names, configs, key, *a, **k):  # torchao 0.18 keys one kernel on a name
    return _init(self, fn, arg_names, configs, [n for n in key if n in arg_names], *a, **k)  # Triton 3.9 rejects
_autotuner.Autotuner.__init__ = _known_keys_only
from torchao.prototype.moe_training.kernels import jagged_float8_scales as J
from spider_titan.quantization.float8 import tune_scale_kernel_once
kernel = J._triton_fp8_per_group_colwise_scales_dual_kernel
"""

_MISSES = """
misses = []
def first_config(kwargs, *a):  # an autotune miss: counted, and one config, so nothing is benchmarked
    misses.append(1)
    return kernel.configs[:1]
kernel.prune_configs = first_config
def run(row_counts):  # the rows of the segments routed to the experts, step by step
    misses.clear()
    for rows in row_counts:
        a, b = torch.randn(rows, 32, dtype=torch.bfloat16), torch.randn(rows, 16, dtype=torch.bfloat16)
        offs = torch.tensor([rows // 2, rows], dtype=torch.int32)
        J.triton_fp8_per_group_colwise_scales_dual(a, b, offs, torch.float8_e4m3fn, round_scales_to_power_of_2=True)
    return len(misses)
as_torchao_keys_it = run((64, 96, 64, 128))
tune_scale_kernel_once()
print(json.dumps([as_torchao_keys_it, run((80, 112, 80, 144))]))
"""

_SPILLS = """
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
all_configs = list(kernel.configs)
kept = tune_scale_kernel_once()
dropped = next(c for c in all_configs if c not in kept and c.num_warps == 4 and c.kwargs["BLOCK_SIZE_ITER"] == 128)
sig = dict(input_ptr_1="*bf16", out_ptr_1="*fp8e4nv", scales_ptr_1="*fp32", N1="i64", stride_input_row_1="i64",
           stride_output_col_1="i64", input_ptr_2="*bf16", out_ptr_2="*fp8e4nv", scales_ptr_2="*fp32", N2="i64",
           stride_input_row_2="i64", stride_output_col_2="i64", offsets_ptr="*i32", K="i64", N_GROUPS="i64")
consts = dict(fp8_dtype_min=-448.0, fp8_dtype_max=448.0, input_dtype_1=tl.bfloat16, input_dtype_2=tl.bfloat16,
              output_dtype=tl.float8e4nv, round_scales_to_power_of_2=True, EPS=1e-12, STRIDE_INPUT_COL_1=1,
              STRIDE_OUTPUT_ROW_1=1, STRIDE_INPUT_COL_2=1, STRIDE_OUTPUT_ROW_2=1)
rows = []
tiles = {}  # one config per tile and warp count: the stage count left the registers equal on every config
for cfg in kept:
    tiles.setdefault((cfg.kwargs["BLOCK_SIZE"], cfg.kwargs["BLOCK_SIZE_ITER"], cfg.num_warps), cfg)
for cfg in [*tiles.values(), dropped]:
    c = dict(consts, **cfg.kwargs)
    src = ASTSource(kernel.fn, dict(sig, **{k: "constexpr" for k in c}), c, {})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}).asm["ptx"]
    rows.append(dict(config=str(cfg), kept=cfg in kept, spill_stores=ptxas_report(ptx, 90)["spill_stores"]))
print(json.dumps(dict(total=len(all_configs), rows=rows)))
"""


def _child(body: str, interpret: bool) -> object:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    compile_half = "" if interpret else "import triton\n" + PTXAS_REPORT
    code = textwrap.dedent(_PRELUDE) + compile_half + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_autotunes_once_as_the_row_count_moves():
    torchao_key, converter_key = _child(_MISSES, interpret=True)
    assert torchao_key == 3  # the negative control: one autotune per new row count
    assert converter_key == 1


@pytest.mark.slow
def test_kept_configs_do_not_spill_on_sm90():
    ok, why = _ptxas_available()
    if not ok:
        pytest.skip(why)
    report = _child(_SPILLS, interpret=False)
    kept = [r for r in report["rows"] if r["kept"]]
    assert report["total"] == 36 and 1 <= len(kept) <= 4, report
    assert all(r["spill_stores"] == 0 for r in kept), report
    assert [r["spill_stores"] > 0 for r in report["rows"] if not r["kept"]] == [True], report  # the control spills


@pytest.mark.gpu
def test_the_fp8_grouped_gemm_backward_tunes_its_scale_kernel_once_on_a_gpu():
    """On a GPU with fp8 grouped GEMMs: three backwards of torchao's fp8 grouped GEMM at three row counts
    (as the segment count moves) autotune the weight-gradient scale kernel once, and its gradients
    follow the bf16 grouped GEMM's."""
    from spider_titan.quantization.float8 import fp8_grouped_mm_supported, tune_scale_kernel_once

    ok, why = fp8_grouped_mm_supported()
    if not ok:
        pytest.skip(why)
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
    from torchao.prototype.moe_training.kernels import jagged_float8_scales as J

    assert tune_scale_kernel_once()
    kernel = J._triton_fp8_per_group_colwise_scales_dual_kernel
    misses, prune = [], kernel.prune_configs
    kernel.prune_configs = lambda *a, **k: misses.append(1) or prune(*a, **k)
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16, generator=gen)  # (E, out, in)
        for rows in (256, 384, 512):
            x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
            offs = torch.arange(1, 5, device="cuda", dtype=torch.int32) * (rows // 4)
            weight = w.clone().requires_grad_(True)
            _to_fp8_rowwise_then_scaled_grouped_mm(
                x, weight.transpose(-2, -1), offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
            ).float().square().sum().backward()
            ref_x, ref_w = x.detach().clone().requires_grad_(True), w.clone().requires_grad_(True)
            torch._grouped_mm(ref_x, ref_w.transpose(-2, -1), offs=offs).float().square().sum().backward()
            for got, ref in ((x.grad, ref_x.grad), (weight.grad, ref_w.grad)):
                rel = (got.float() - ref.float()).norm() / ref.float().norm()
                assert rel < 0.2, (rows, float(rel))  # e4m3 rounding (~5 %), not a wrong scale or layout (~100 %)
    finally:
        kernel.prune_configs = prune
    assert len(misses) == 1
