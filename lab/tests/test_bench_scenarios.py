"""The benches of lab/bench at small sizes: checkpoint I/O, the fp8 all-gather bytes and the quantized
exports' table, each checked against what the model's sizes say it must find."""

from __future__ import annotations

import argparse
import json

import pytest

from spider_titan import registry


def test_checkpoint_io_benchmark_reports_debug_and_1b(tmp_path, monkeypatch):
    from lab.bench import checkpoint as bench

    monkeypatch.setattr(bench, "PROBE_MIB", 16)
    monkeypatch.setattr(bench, "REPEATS", 1)
    result = bench.benchmark_checkpoint_io(argparse.Namespace(dump_folder=str(tmp_path)))
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
    assert not (tmp_path / "checkpoint_io").exists()


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
