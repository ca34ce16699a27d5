"""lab/bench/benchmark.py gpu_1b (lab/bench/gpu.py), the GPU harness of Spider 1B against dense 1B: its
reduced-width dry run on CPU takes the same code path end to end at tiny shapes and writes its table."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from lab.bench import gpu as bench_gpu
from tests.utils import REPO


def test_the_help_describes_the_harness():
    proc = subprocess.run(
        [sys.executable, "-m", "lab.bench.benchmark", "gpu_1b", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "Spider 1B against dense 1B" in proc.stdout and "--budget_s" in proc.stdout and "--reduced" in proc.stdout


def test_the_reduced_dry_run_writes_its_table(tmp_path, in_process, monkeypatch):
    # the fp8 row is the spider row with the float8 converter: left out here for the suite's time
    argv = [
        "--reduced",
        "--compile",
        "false",
        "--batch",
        "1",
        "--seq",
        "64",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--no_fp8",
        "--variant",
        "no_ac=activation_checkpoint.mode=none",
    ]
    # spider_1b_shipped is left out of the run: on a CPU it is the planned row (the same 16 rows and
    # shapes, recurrent checkpointing, no graph); its flags are checked below
    ran = "dense_1b,spider_1b,spider_1b_static,spider_1b_packed,spider_1b_planned,no_ac"
    assert bench_gpu.main([*argv, "--rows", ran, "--out", str(tmp_path)]) == 0
    # the rows profile their kernels on a CPU, and leave inductor's config as it was for what runs next
    assert torch._inductor.config.cpp.enable_kernel_profile is False
    report = json.loads((tmp_path / "gpu_1b.json").read_text())
    table = (tmp_path / "gpu_1b.md").read_text()
    rows = report["rows"]
    assert set(rows) == set(ran.split(","))
    # the shipped row keeps the config's shapes and micro-batch whatever --batch says
    flags = dict(bench_gpu.rows(bench_gpu.parse_args([*argv, "--out", str(tmp_path)])))["spider_1b_shipped"]
    assert flags["training.local_batch_size"] == 16 and str(flags["job.config_file"]).endswith("spider_1b.toml")
    assert not any("capacity" in key for key in flags), flags  # the file's slots and packed positions
    # the planned row takes spider_1b_1gpu.toml's; without a GPU the planner is not asked
    planned = (tmp_path / "spider_1b_planned" / "config.toml").read_text()
    assert "local_batch_size = 16" in planned and 'mode = "recurrent"' in planned, planned
    assert rows["spider_1b_planned"]["planner"].startswith("the planner runs for a GPU only")
    # a variant is spider_1b_static with its flags
    variant = (tmp_path / "no_ac" / "config.toml").read_text()
    assert 'mode = "none"' in variant and "segment_capacity = 1.5" in variant, variant
    for name in rows:
        row = rows[name]
        assert row["bytes_per_s"] > 0 and row["tflops"] > 0 and row["profile"]["launched"] > 0, (name, row)
        assert f"| {name} | {row['bytes_per_s']} |" in table
        assert row["compile_events"]["triton_compiles"] >= 0, row  # what step 1 compiled, beside its time
        assert row["run_ahead_bytes_per_s"] > 0, row  # the steps back to back, beside the timed ones
    spider = rows["spider_1b"]
    # the router warmed to the target rate (4 +- 5 %): steady-state shapes from the first timed step
    assert 3.8 <= spider["warm_bytes_per_segment"] <= 4.2, spider
    ranges = spider["profile"]["ranges_ms"]
    assert {"spider.byte_blocks", "spider.segmentation", "spider.core", "spider.dechunk_head", "optimizer"} <= set(
        ranges
    ), ranges
    assert abs(sum(spider["flops_share"].values()) - 1.0) < 0.02, spider["flops_share"]
    assert report["spider_over_dense_bytes_per_s"] > 0
    assert set(report["over_dense_bytes_per_s"]) == set(rows) - {"dense_1b"}
    assert "spider_1b_static / dense_1b bytes/s:" in table
    # static shapes: at steady state (4 bytes per segment) capacity 1.5 drops nothing
    assert rows["spider_1b_static"]["segments_dropped"] == 0.0 and "segments_dropped" not in spider
    # --packed: the core charged (and computed) on fewer positions than 1.5 slots per row
    packed = rows["spider_1b_packed"]
    assert packed["flops_per_byte"] < rows["spider_1b_static"]["flops_per_byte"], packed
    assert 0.0 <= packed["segments_dropped"] < 0.1, packed


def test_the_run_stops_at_its_total_budget(tmp_path, in_process, monkeypatch):
    """--total_s bounds the whole run: a row gets at most the time left, and none starts with under
    20 s left (here: the first row takes the 21 s given, and the others are skipped and say why)."""
    budgets = []

    def row(name, overrides, args, budget):
        budgets.append(budget)
        time.sleep(1.5)  # a row that takes the time it is given down to under MIN_ROW_S
        return {"bytes_per_s": 1.0}

    monkeypatch.setattr(bench_gpu, "run_row", row)
    argv = ["--reduced", "--no_fp8", "--total_s", "21", "--out", str(tmp_path)]
    assert bench_gpu.main(argv) == 0
    rows = json.loads((tmp_path / "gpu_1b.json").read_text())["rows"]
    assert len(budgets) == 1 and 20 < budgets[0] <= 21 and rows["dense_1b"] == {"bytes_per_s": 1.0}
    skipped = [name for name, r in rows.items() if "--total_s" in r.get("skipped", "")]
    assert skipped == [name for name in rows if name != "dense_1b"] and len(skipped) == 5, rows


def test_the_planned_row_drops_checkpointing_only_when_the_planner_says_so(monkeypatch):
    """spider_1b_planned reads the planner's checkpointing lines (plan.checkpointing_line): none when
    the micro-batch fits without, the memory budget's flags when one fits, the config's otherwise."""
    from spider_titan.plan import CHECKPOINTING_NOT_NEEDED, MEMORY_BUDGET_FITS

    def planner(line):
        return subprocess.Popen([sys.executable, "-c", f"print({line!r})"], stdout=subprocess.PIPE, text=True)

    flags, said = bench_gpu.planned_checkpointing(planner(f"{CHECKPOINTING_NOT_NEEDED}: without it 100.7 GiB"), 60)
    assert flags == {"activation_checkpoint.mode": "none"} and said.startswith(CHECKPOINTING_NOT_NEEDED)
    flags, said = bench_gpu.planned_checkpointing(planner("checkpointing  needed at that micro-batch: 103.8 GiB"), 60)
    assert flags == {} and "needed" in said
    needed = "checkpointing  needed at that micro-batch: without it 100.7 GiB planned"
    budget = f"{MEMORY_BUDGET_FITS}: 0.4 of them, 63.1 GiB planned: --activation_checkpoint.mode memory_budget "
    flags, said = bench_gpu.planned_checkpointing(
        planner(f"{needed}\n{budget}--activation_checkpoint.memory_budget 0.4"), 60
    )
    assert flags == {"activation_checkpoint.mode": "memory_budget", "activation_checkpoint.memory_budget": "0.4"}
    assert said.startswith(needed) and MEMORY_BUDGET_FITS in said
    assert bench_gpu.planned_checkpointing(None, 60)[0] == {}


def test_a_slow_step_is_named_by_what_happened_during_it(monkeypatch):
    """A step over 2x the median is reported with the recompiles and Triton JIT compiles that ran in it."""
    log = bench_gpu._Recompiles()
    watch = bench_gpu.StepEvents(log, cuda=False)
    try:
        events = []
        for step in range(4):
            if step == 2:  # what a stall looks like: a dynamo recompile and a new kernel specialisation
                log.messages.append("Recompiling function forward in block.py")
                watch._on_compile()
            events.append(watch.take())
    finally:
        watch.close()
    assert [e["recompiles"] for e in events] == [0, 0, 1, 0]
    assert [e["triton_compiles"] for e in events] == [0, 0, 1, 0]
    slow = bench_gpu.slow_steps([0.1, 0.1, 0.5, 0.1], events, first_step=4)
    assert slow == [{"step": 6, "over_median": 5.0, "recompiles": 1, "triton_compiles": 1}]


def test_the_launch_count_skips_views_and_counts_copies(monkeypatch):
    """lab.bench.launches.count_launches on an eager trace: views, allocations and a no-op ``to`` launch
    nothing; a ``to`` that casts and a ``reshape`` that must copy launch one kernel each."""
    from lab.bench.launches import count_launches, host_events

    x = torch.randn(8, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = x.view(64).view(8, 8).t().unsqueeze(0).detach()  # views: 0
        z = x.to(torch.float32).reshape(64)  # a no-op to and a view-able reshape: 0
        w = x.to(torch.float64), y.reshape(64), x @ x, z + 1, torch.empty(3)  # cast, copy, mm, add: 4
    assert count_launches(host_events(prof))[0] == {"launched": 4, "outside": 4, "inside": 0, "regions": 0}, w


def test_kernels_are_summed_by_kind(monkeypatch):
    """bench_gpu.kernel_kinds on kernel names an H200 step launched (run B of docs/benchmarks.md):
    the grouped expert GEMM is told from the dense GEMMs, and the short kernels are counted again
    as the tail."""
    from lab.bench.gpu import kernel_kinds

    grouped = "void at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<>>>"
    kernels = [
        (grouped, 2_000_000),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 1_000_000),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x192_1x", 500_000),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 300_000),
        ("triton_poi_fused__to_copy__unsafe_view_add_cat_expand_mul", 4_000),
        ("triton_per_fused__fused_rms_norm__fused_rms_norm_backward", 20_000),
        ("_expand_kernel", 6_000),
        ("void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda>", 3_000),
        ("ncclDevKernel_AllGather_RING_LL", 50_000),
    ]
    kinds = kernel_kinds(kernels)
    assert {k: v["n"] for k, v in kinds.items()} == {
        "grouped_gemm": 1,
        "gemm": 1,
        "attention": 1,
        "optimizer": 1,
        "inductor_pointwise": 1,
        "inductor_reduction": 1,
        "moe_triton": 1,
        "copy_fill": 1,
        "other": 1,
        "small": 3,
    }
    assert kinds["grouped_gemm"]["ms"] == 2.0 and kinds["small"]["ms"] == 0.013
    assert list(kinds)[0] == "grouped_gemm"  # by time, largest first
    assert kinds["other"]["top"] == [["ncclDevKernel_AllGather_RING_LL", 0.05, 1]]
    assert [name for name, _, _ in kinds["small"]["top"]] == [  # each short kernel, longest first
        "_expand_kernel",
        "triton_poi_fused__to_copy__unsafe_view_add_cat_expand_mul",
        "void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda>",
    ]
