"""[profiling]: a profiled debug run writes a Chrome/TensorBoard trace of its window; bad windows are config errors."""

from __future__ import annotations

import json

import pytest

from spider_titan.config.manager import ConfigError, parse_args
from tests.utils import DEBUG_SPIDER, REPO, check_ok, run_train, tiny_run


@pytest.mark.slow
def test_profiled_run_writes_a_trace_of_its_window(tmp_path):
    dump = tmp_path / "run"
    proc = run_train(
        [
            *tiny_run(job__config_file=REPO / DEBUG_SPIDER, job__dump_folder=dump, training__steps=3),
            "--profiling.enable_profiling",
            "true",
            "--profiling.start_step",
            "2",
            "--profiling.active_steps",
            "1",
            "--profiling.enable_memory_snapshot",
            "true",  # CPU: skipped with a log line, not an error
        ]
    )
    check_ok(proc)
    traces = list((dump / "profile_traces").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1, list((dump / "profile_traces").iterdir())
    events = json.loads(traces[0].read_text())["traceEvents"]
    ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    assert "aten::mm" in ops or "aten::addmm" in ops  # the model's matmuls are in the window
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#1"}  # one active step, after one warm-up step
    assert not list((dump / "profile_traces").glob("*.pickle"))  # memory snapshots are CUDA only


@pytest.mark.parametrize("key", ["start_step", "active_steps", "memory_snapshot_step"])
def test_profiling_window_is_checked_at_config_time(key):
    with pytest.raises(ConfigError) as e:
        parse_args([f"--profiling.{key}", "0"], env={})
    assert e.value.problems == [f"profiling.{key} = 0 is not allowed; use an integer >= 1"]
