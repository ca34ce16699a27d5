"""End-to-end runs on a CUDA device (skipped without one): bf16, the compiled Triton MoE backend,
fp8 with its grouped experts, and NCCL FSDP when two GPUs are present."""

from __future__ import annotations

import pytest
import torch

from tests.utils import check_ok, run_train, tiny_run, train_losses

pytestmark = pytest.mark.gpu

# the debug config's batch of 8 and its end-of-run export kept (None: the TOML's value)
BASE = tiny_run(
    training__steps=20,
    training__seq_len=256,
    training__local_batch_size=None,
    checkpoint__export_at_end=None,
    training__device="cuda",
)


@pytest.mark.parametrize(
    "extra",
    [[], ["--moe.backend", "triton"], ["--model.converters", "float8"], ["--training.compile", "true"]],
    ids=["bf16", "triton", "fp8", "compile"],
)
def test_cuda_training_runs_and_learns(extra, tmp_path):
    proc = run_train(BASE + extra + ["--job.dump_folder", str(tmp_path)], env={"TRITON_INTERPRET": "0"})
    check_ok(proc)
    losses = train_losses(tmp_path)
    assert losses[20] < 0.8 * losses[1], losses


def test_triton_matches_torch_backend_on_cuda(tmp_path):
    runs = {}
    for backend in ("torch", "triton"):
        dump = tmp_path / backend
        check_ok(
            run_train(
                BASE
                + [
                    "--moe.backend",
                    backend,
                    "--training.steps",
                    "3",
                    "--training.mixed_precision_param",
                    "float32",
                    "--job.dump_folder",
                    str(dump),
                ],
                env={"TRITON_INTERPRET": "0"},
            )
        )
        runs[backend] = train_losses(dump)
    for step in runs["torch"]:
        assert runs["triton"][step] == pytest.approx(runs["torch"][step], rel=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_fsdp_two_gpus(tmp_path):
    check_ok(run_train(BASE + ["--job.dump_folder", str(tmp_path)], nprocs=2))
