"""End to end: the Triton MoE backend trains exactly like the torch backend (interpreter on CPU)."""

from __future__ import annotations

import pytest

from tests.utils import check_ok, run_train, tiny_run, train_losses

COMMON = tiny_run(training__steps=3)


@pytest.mark.slow
def test_triton_backend_losses_match_torch_backend(tmp_path):
    torch_run = run_train(COMMON + ["--moe.backend", "torch", "--job.dump_folder", str(tmp_path / "torch")])
    check_ok(torch_run)
    # No TRITON_INTERPRET in the environment: the builder must switch the interpreter on for CPU.
    triton_run = run_train(
        COMMON + ["--moe.backend", "triton", "--job.dump_folder", str(tmp_path / "triton")],
        env={"TRITON_INTERPRET": ""},
    )
    check_ok(triton_run)
    assert "interpreter" in triton_run.stdout
    ref, got = train_losses(tmp_path / "torch"), train_losses(tmp_path / "triton")
    assert sorted(ref) == sorted(got) == [1, 2, 3]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), (step, ref, got)
    assert ref[3] != ref[1]
