"""Every scenario of lab/bench/benchmark.py once at tiny size (``--reduced``: the same code paths at tiny
shapes and single repeats), so a bench cannot break unnoticed, each checked for a property its figures
must have; and the benches with tests of their own measure (fp8 all-gather bytes, the quantized exports'
table) at small sizes."""

from __future__ import annotations

import argparse
import json

import pytest

from lab.bench import benchmark
from lab.overrides import trainer_flags
from spider_titan import registry
from spider_titan.models.spider.args import SPIDER_FLAVORS

# the suite's tiny run: one timed step, no warm-up, one 64-byte row
TINY = ["--reduced", "--steps", "1", "--warmup", "0", "--set", "training.seq_len=64"]
TINY += ["--set", "training.local_batch_size=1"]


def check_checkpoint_io(result: dict) -> None:
    assert result["probe"]["write_mb_s"] > 0
    for name in registry.names("model"):
        debug, big = result[name]["debug"], result[name]["1B"]
        # weights and two AdamW moments: ~3x the fp32 export (rounded to 0.01 MB, and the export's header carries
        # the config, so 3x itself is within rounding: 13.37 against 4.46), well above the 2x of one moment
        assert (
            debug["save_s"] > 0 and debug["load_s"] > 0 and debug["checkpoint_mb"] > 2.5 * debug["export_fp32_mb"] > 0
        )
        # fp32 weights + two AdamW moments: 12 bytes per parameter
        assert big["estimated"] and big["checkpoint_gb"] == pytest.approx(12e-3 * big["params_m"], rel=0.01)
        assert big["save_s"] > 0 and big["load_s"] > 0


def check_moe_layer(result: dict) -> None:
    row = result["tokens_16"]
    assert {"python_loop", "torch"} <= set(row) and all(row[b]["fwd_bwd"]["ms"] > 0 for b in ("python_loop", "torch"))
    assert result["shapes"].startswith(f"dim {SPIDER_FLAVORS['debug'].dim},")  # the debug flavor under --reduced


def check_attention(result: dict) -> None:
    row = result["seq_16"]
    assert "ms_fwd_bwd" in row["math"] and "ms_fwd_bwd" in row["priority"], row  # math runs every shape


def check_pooling_memory(result: dict) -> None:
    assert result["dense_live_mib"] > result["scatter_live_mib"] > 0, result  # (B, S, T) matrices weigh more


def check_ac_memory(result: dict) -> None:
    flavor = result["debug_flavor_B4_T512"]["n_loops_2"]
    assert flavor["full"] < flavor["none"] and flavor["recurrent"] < flavor["none"], flavor
    block = result["debug_core_block_S64"]
    assert block["full"] < block["selective_op"] < block["none"], block


def check_generate(result: dict) -> None:
    row = result["contexts"]["16"]
    assert row["cached_bytes_per_s"] > 0 and row["recompute_bytes_per_s"] > 0 and row["timed_bytes"]["cached"] == 4
    script = result["generate_py"]
    assert script["cached"]["reported_bytes_per_s"] > 0 and script["no_cache"]["reported_bytes_per_s"] > 0, script


def check_eager_bytes(result: dict) -> None:
    assert result["config"].endswith("debug_model.toml") and result["gb_per_step"] >= 0 and result["ops_per_step"] > 0


def check_packed_rows(result: dict) -> None:
    assert result["ms_fwd_bwd"] > 0 and result["shapes"].startswith("2 rows x 20 slots")  # 1.3 x 16 segments


def check_comm(result: dict) -> None:
    loops = result["n_loops"]["n_loops_2"]
    assert loops["core_all_gather"] > 0 and loops["per_block_units_core_all_gather"] > 0, loops
    assert result["expert_parallel"]["all_to_all"] > 0 and result["float8_linears"]["fp8_all_gather"] > 0
    assert result["grad_accum"]["after"]["total"] < result["grad_accum"]["before"]["total"], result["grad_accum"]


def check_ep_capacity(result: dict) -> None:
    rows = result["results"]
    assert set(rows) == {"dynamic", "capacity_1.25"} and rows["dynamic"]["bytes_vs_dynamic"] == 1.0, rows
    assert all(r["all_to_all_bytes_per_step"] > 0 for r in rows.values()), rows


def check_kernel_bytes(result: dict) -> None:
    params = result["params"]
    assert params["mib_per_step"].get("generated", 0) > 0 and params["graph_calls"] > 0, params


def check_training(result: dict) -> None:
    assert result["tokens_per_step"] == 64 and result["tokens_per_s"] > 0, result  # --set reached the trainer


CHECKS = {
    "checkpoint_io": check_checkpoint_io,
    "moe_layer": check_moe_layer,
    "attention": check_attention,
    "pooling_memory": check_pooling_memory,
    "ac_memory": check_ac_memory,
    "generate": check_generate,
    "eager_bytes": check_eager_bytes,
    "packed_rows": check_packed_rows,
    "comm": check_comm,
    "ep_capacity": check_ep_capacity,
    "kernel_bytes": check_kernel_bytes,
}
# several processes each (gloo ranks, torchrun, generate.py twice) or an inductor compile: the full suite runs
# them, a fast lane need not
SLOW = {"comm", "ep_capacity", "kernel_bytes", "generate"}


def test_every_scenario_is_checked_here():
    """Each scenario is run by a test: the ones below, dense_debug with spider_debug (compared), and
    spider_debug_compiled, which is spider_debug's run with one flag (checked without running it)."""
    trained = {"dense_debug", "spider_debug", "spider_debug_compiled"}
    assert set(CHECKS) | trained == set(benchmark.SCENARIOS) | set(benchmark.TRAIN_SCENARIOS)


def test_the_compiled_scenario_is_spider_debug_with_compile_on(tmp_path):
    """spider_debug_compiled runs the same code as spider_debug (run_training, tested below) with
    ``training.compile`` on, which the trainer's parser takes. Compiling the debug model costs about 100
    CPU-seconds, so the compiled step is proven once, by tests/integration/test_precision_compile.py and
    test_recompiles.py, not again here."""
    from spider_titan.config.manager import parse_args

    config, overrides = benchmark.TRAIN_SCENARIOS["spider_debug_compiled"]
    base_config, base_overrides = benchmark.TRAIN_SCENARIOS["spider_debug"]
    assert config == base_config and overrides == {**base_overrides, "training.compile": True}
    argv = trainer_flags({"job.config_file": config, "job.dump_folder": tmp_path, **overrides})
    assert parse_args(argv, env={}).training.compile is True


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CHECKS])
def test_each_scenario_runs_at_tiny_size(name, tmp_path, in_process):
    args = benchmark.parse_args([name, *TINY, "--dump_folder", str(tmp_path)])
    if name in benchmark.TRAIN_SCENARIOS:
        result = benchmark.run_training(*benchmark.TRAIN_SCENARIOS[name], args)
    else:
        result = benchmark.SCENARIOS[name](args)
    CHECKS[name](json.loads(json.dumps(result)))  # as the report prints it


def test_two_training_scenarios_are_compared_and_appended(tmp_path, in_process, capsys):
    """dense_debug against spider_debug in one process: both rows, their tokens/s ratio, and the markdown
    file appended to (the text before it kept), written whole."""
    md = tmp_path / "bench.md"
    md.write_text("# before\n")
    argv = ["dense_debug", "spider_debug", *TINY, "--dump_folder", str(tmp_path / "runs"), "--markdown", str(md)]
    assert benchmark.main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index('{\n  "machine"') :])  # the report, after the trainers' log lines
    for name in ("dense_debug", "spider_debug"):
        check_training(report["results"][name])
    assert report["ratio_tokens_per_s"]["dense_debug/spider_debug"] > 0
    text = md.read_text()
    assert text.startswith("# before\n") and "### `python -m lab.bench.benchmark dense_debug spider_debug" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.md", "runs"]


def test_fp8_all_gather_halves_bf16_bytes():
    """Measured with bf16 parameters (the GPU setting) on converted linears alone, one FSDP unit
    each (all-float8 units: the payload crosses gloo as uint8): half the bytes of bf16."""
    pytest.importorskip("torchao")
    from lab.bench.comm import benchmark_comm

    args = argparse.Namespace(comm_scenarios="float8_linears", comm_world_size=2, comm_steps=2)
    result = benchmark_comm(args)["float8_linears"]
    assert result["fp8_all_gather"] > 0 and result["ratio"] == pytest.approx(0.5, abs=1e-3), result


def test_the_quantize_benchmark_pairs_its_four_formats_with_bf16(tmp_path, capsys):
    """``python -m lab.bench.benchmark quantize`` end to end on a small val split: every format written, loaded,
    scored on the same windows (bf16 against itself: 0) and timed."""
    pytest.importorskip("torchao")
    import numpy as np

    from lab.bench import quantize as bench
    from spider_titan.data.shards import write_shard
    from tests.unit.test_weight_only import _export

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        write_shard(tmp_path / "data" / split / "part_0.bin", rng.integers(0, 256, 4 * 64 + 1).astype(np.uint16))
    fp32 = _export("spider", tmp_path / "fp32")
    argv = ["--model", str(fp32), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out")]
    assert bench.main([*argv, "--seq_len", "64", "--batch", "2", "--loads", "1", "--context", "16", "--new", "4"]) == 0
    report = json.loads((tmp_path / "out" / "quantize.json").read_text())
    rows = report["rows"]
    assert list(rows) == ["fp32", "bf16", "int8", "int4"]
    assert rows["bf16"][str(tmp_path / "data")]["diff"] == 0
    assert rows["int4"]["file_mb"] < rows["int8"]["file_mb"] < rows["bf16"]["file_mb"] < rows["fp32"]["file_mb"]
    assert all(row["load_s"] > 0 and row["decode_bytes_per_s"] > 0 for row in rows.values())
    assert "| int4 | " in capsys.readouterr().out
