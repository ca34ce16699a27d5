"""FSDP2 over 2 gloo ranks vs one process: same global batch and seed give the same losses."""

from __future__ import annotations

import pytest

from tests.utils import check_ok, run_train, train_losses

COMMON = [
    "--job.config_file", "train_configs/debug_dense.toml",
    "--training.dataset", "mock", "--training.steps", "5", "--training.seq_len", "64",
    "--metrics.log_freq", "1", "--training.deterministic", "true",
]


@pytest.mark.parametrize(
    "multi",
    [
        ["--training.local_batch_size", "2"],  # FSDP: 2 ranks x 2 samples
        ["--training.local_batch_size", "1", "--training.gradient_accumulation_steps", "2"],  # + accumulation
    ],
    ids=["fsdp", "fsdp-accum"],
)
def test_fsdp_two_ranks_match_single_process(multi, tmp_path):
    single = run_train(COMMON + ["--training.local_batch_size", "4", "--job.dump_folder", str(tmp_path / "one")])
    check_ok(single)
    sharded = run_train(COMMON + multi + ["--job.dump_folder", str(tmp_path / "two")], nprocs=2)
    check_ok(sharded)
    ref, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(ref) == sorted(got) == [1, 2, 3, 4, 5]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (step, ref, got)
    # the losses must move, or equality would prove nothing
    assert ref[5] < ref[1]
