"""AOT-compile every MoE Triton kernel the backend can launch at the 1B shapes, for sm_90 and sm_100,
and fail on any register spill or compile error (issue 22: 32 x 256 tiles spilled on H100).

No GPU is needed: Triton lowers to PTX on the CPU, and the ptxas that ships in the Triton wheel
reports registers and spills (``ptxas -v``). The compile runs in one child process per session
(Triton's interpreter, which other MoE tests switch on in this process, replaces the kernels'
compiled form). The launches come from ``launch.launch_plan``, the same tables the launchers read.
Run with ``-s`` to see the register table (recorded in docs/benchmarks.md).

Dtypes: the data-path kernels move bf16 rows (the 1B runs' activations) with fp32 gate weights; fp32
rows are compiled too (fp32 runs and tests). No kernel takes fp8: fp8 quantization happens inside
torchao's grouped GEMM, after expand and before reduce.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from spider_titan.models.spider.args import SPIDER_FLAVORS

ARCHS = (90, 100)
ROW_DTYPES = ("bf16", "fp32")

# Child-process source: ``ptxas_report(ptx, arch)``, ptxas -v run on a kernel's PTX the way Triton runs it:
# its registers and spill bytes. Shared with tests/unit/test_float8_scale_kernel.py.
PTXAS_REPORT = textwrap.dedent(
    """
    import re, subprocess, tempfile
    from triton.backends.nvidia.compiler import get_ptxas

    def ptxas_report(ptx, arch):
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:  # removed on close
            f.write(ptx)
            f.flush()
            out = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", f"-arch=sm_{arch}a", f.name,
                                  "-o", "/dev/null"], capture_output=True, text=True)
        log = out.stderr + out.stdout
        if out.returncode:
            raise RuntimeError(log)
        stores, loads = re.search(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", log).groups()
        registers = int(re.search(r"Used (\\d+) registers", log).group(1))
        return dict(registers=registers, spill_stores=int(stores), spill_loads=int(loads))
    """
)

# Ask the child to compile ``plan`` (KernelLaunch fields as JSON) for each arch and row dtype, run
# ptxas -v the way Triton does, and print one JSON line per compile.
_CHILD = PTXAS_REPORT + textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from spider_titan.moe.kernels import expand, reduce, routing_map
    from spider_titan.moe.kernels.launch import launch_plan

    KERNELS = {name: getattr(mod, name) for mod in (expand, reduce, routing_map)
               for name in dir(mod) if name.startswith("_") and name.endswith("_kernel")}

    def signature(name, dt):
        sig = {
            "_expand_kernel": dict(x_ptr=f"*{dt}", pos_to_token_ptr="*i64", w_ptr="*fp32", slot_to_pos_ptr="*i64",
                                   out_ptr=f"*{dt}", R="i32", D="i32"),
            "_reduce_kernel": dict(y_exp_ptr=f"*{dt}", slot_to_pos_ptr="*i64", w_ptr="*fp32", out_ptr=f"*{dt}",
                                   T="i32", D="i32"),
            "_weight_grad_kernel": dict(y_exp_ptr=f"*{dt}", dy_ptr=f"*{dt}", slot_to_pos_ptr="*i64",
                                        dw_ptr="*fp32", T="i32", D="i32"),
            "_block_histogram_kernel": dict(idx_ptr="*i64", hist_ptr="*i32", N="i32", E="i32"),
            "_segment_offsets_kernel": dict(hist_ptr="*i32", block_base_ptr="*i32", counts_ptr="*i64",
                                            seg_start_ptr="*i32", offs_ptr="*i32", n_blocks="i32", E="i32",
                                            align="i32"),
            "_scatter_positions_kernel": dict(idx_ptr="*i64", block_base_ptr="*i32", seg_start_ptr="*i32",
                                              slot_to_pos_ptr="*i64", pos_to_token_ptr="*i64", N="i32", E="i32"),
        }[name]
        return sig

    (d, n_experts, top_k), archs, dtypes, aligns = json.loads(sys.argv[1])
    plan = [vars(p) for p in launch_plan(d, n_experts, top_k)]
    for launch in plan:
        fn = KERNELS[launch["kernel"]]
        for dt in (dtypes if launch["kernel"] in ("_expand_kernel", "_reduce_kernel", "_weight_grad_kernel")
                   else ["-"]):
            for aligned in aligns:
                sig = signature(launch["kernel"], dt)
                # Triton specializes pointers and ints divisible by 16 (tt.divisibility): 16-aligned tensors and
                # row counts are the usual launch, none aligned the worst case (most registers).
                attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig} if aligned else {}
                sig.update({c: "constexpr" for c in launch["constexprs"]})
                for arch in archs:
                    row = dict(kernel=launch["kernel"], constexprs=launch["constexprs"], num_warps=launch["num_warps"],
                               dtype=dt, arch=arch, aligned=aligned)
                    try:
                        src = ASTSource(fn, sig, launch["constexprs"], attrs)
                        ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                             options={"num_warps": launch["num_warps"]}).asm["ptx"]
                        row.update(ptxas_report(ptx, arch))
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {e}"[:2000]
                    print(json.dumps(row), flush=True)
    """
)


def _ptxas_available() -> tuple[bool, str]:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        paths = {get_ptxas(a).path for a in ARCHS}
    except (ImportError, AttributeError, RuntimeError) as e:  # no NVIDIA backend in this Triton
        return False, f"Triton's NVIDIA backend has no ptxas ({type(e).__name__}: {e})"
    missing = [p for p in paths if not (p and os.path.exists(p))]
    return (not missing), f"ptxas not found: {missing}"


def compile_report(shape: tuple[int, int, int], archs=ARCHS, dtypes=ROW_DTYPES, aligns=(True, False)) -> list[dict]:
    """Compile ``launch_plan(*shape)`` (d, n_experts, top_k) in a child process (this one may run Triton's
    interpreter); one dict per (launch, row dtype, alignment, arch)."""
    payload = json.dumps([list(shape), list(archs), list(dtypes), list(aligns)])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, said out loud to silence its warning
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, payload], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def format_table(rows: list[dict]) -> str:
    head = ("kernel", "constexprs", "warps", "dtype", "align", "sm", "regs", "spill st/ld")
    lines = ["{:<28}{:<48}{:>6}{:>6}{:>6}{:>5}{:>6}{:>13}".format(*head)]
    for r in rows:
        c = ",".join(f"{k}={v}" for k, v in r["constexprs"].items())
        tail = f"{r['registers']:>6}{r['spill_stores']:>7}/{r['spill_loads']:<5}" if "error" not in r else "  ERROR"
        align = "16" if r["aligned"] else "-"
        lines.append(f"{r['kernel']:<28}{c:<48}{r['num_warps']:>6}{r['dtype']:>6}{align:>6}{r['arch']:>5}{tail}")
    return "\n".join(lines)


@pytest.fixture(scope="session")
def aot_1b_rows() -> list[dict]:
    ok, why = _ptxas_available()
    if not ok:
        pytest.skip(why)
    a = SPIDER_FLAVORS["1B"]
    return compile_report((a.dim, a.n_experts, a.top_k))


@pytest.mark.slow  # AOT-compiles every MoE kernel at the 1B shapes
def test_moe_kernels_compile_without_spills_at_1b_shapes(aot_1b_rows):
    print("\n" + format_table(aot_1b_rows))
    # 3 routing-map kernels (no row dtype) + 5 data-path variants per row dtype, each aligned and not, per arch
    assert len(aot_1b_rows) == (3 + 5 * len(ROW_DTYPES)) * 2 * len(ARCHS)
    assert {r["kernel"] for r in aot_1b_rows} >= {"_expand_kernel", "_reduce_kernel", "_weight_grad_kernel"}
    errors = [f"{r['kernel']} sm_{r['arch']} {r['dtype']}: {r['error']}" for r in aot_1b_rows if "error" in r]
    assert not errors, "\n".join(errors)
    spills = [r for r in aot_1b_rows if r["spill_stores"] or r["spill_loads"]]
    assert not spills, "register spills:\n" + format_table(spills)
