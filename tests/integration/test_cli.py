"""The CLI end to end: a table of runs (overrides, world size). Bad input: test_hostile.py."""

from __future__ import annotations

import pytest

from tests.utils import DEBUG_DENSE, check_ok, read_metrics, run_train, tiny_run, train_losses


@pytest.mark.slow
def test_help_exits_zero():
    proc = run_train(["--help"], timeout=600)
    check_ok(proc)
    assert "--training.seq_len" in proc.stdout


# (overrides, id, nprocs): the feature table, each run a few steps of the debug model on mock data.
FEATURES = [
    ([], "dense", 1),
    (["--model.name", "spider"], "spider", 1),
    (["--model.name", "spider", "--moe.load_balance", "aux_free"], "spider-aux-free", 1),
    (["--model.name", "spider", "--activation_checkpoint.mode", "recurrent"], "spider-ac-recurrent", 1),
    (["--model.name", "spider"], "spider-fsdp2", 2),
    (["--training.gradient_accumulation_steps", "2"], "grad-accum", 1),
    (["--lr_scheduler.decay_type", "wsd"], "wsd", 1),
    (["--optimizer.name", "Muon"], "muon", 1),
    (["--validation.enable", "true", "--validation.freq", "2", "--metrics.enable_tensorboard", "true"], "val-tb", 1),
]
# Dense under FSDP2 (validation, TensorBoard, export kept) is tests/distributed/test_fsdp_parity.py's run,
# checked there against one process; HSDP is test_parallelism.py's hsdp2x2, also against one process.


@pytest.mark.slow
@pytest.mark.parametrize("overrides, name, nprocs", FEATURES, ids=[f[1] for f in FEATURES])
def test_feature_runs(overrides, name, nprocs, tmp_path):
    dump = tmp_path / name
    proc = run_train(
        # the debug config's validation, TensorBoard and end-of-run export kept: each feature runs them too
        tiny_run(
            job__config_file=DEBUG_DENSE,
            training__steps=4,
            validation__enable=True,
            metrics__enable_tensorboard=True,
            checkpoint__export_at_end=True,
            job__dump_folder=dump,
        )
        + overrides,
        nprocs=nprocs,
    )
    check_ok(proc)
    losses = train_losses(dump)
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(0 < v < 10 for v in losses.values())
    assert (dump / "config.toml").is_file()
    if "val-tb" == name:
        assert any("val_bpb" in row for row in read_metrics(dump))
        assert list((dump / "tb").glob("events.out.tfevents.*"))
