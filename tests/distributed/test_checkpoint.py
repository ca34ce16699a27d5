"""DCP checkpoints through the CLI: exact resume, 2 -> 1 rank resharding, crashes mid-save, async
saves and the one-line errors for missing, partial or mismatched checkpoints.

References are uninterrupted runs of the same config. The schedule is warmup then a constant LR
(``min_lr_factor = 1``) so a run cut at step 6 and a 12-step run follow the same LR at every step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from spider_titan.checkpoint.export import load_export_tensors, read_checkpoint_tensors
from spider_titan.config.manager import parse_args
from spider_titan.data.loader import ByteDataLoader, build_mock_dataset
from spider_titan.train import Trainer, main
from tests.utils import DEBUG_DENSE, REPO, check_ok, run_train, tiny_run, train_losses

pytestmark = pytest.mark.slow

# the debug config's batch of 8 and its end-of-run export kept (None: the TOML's value)
COMMON = tiny_run(
    job__config_file=DEBUG_DENSE,
    training__local_batch_size=None,
    training__deterministic=True,
    checkpoint__export_at_end=None,
    lr_scheduler__warmup_steps=3,
    lr_scheduler__min_lr_factor=1.0,
)
CKPT = ["--checkpoint.enable", "true", "--checkpoint.last_save_model_only", "false"]


def args(dump: Path, steps: int, *extra: str) -> list[str]:
    return COMMON + ["--training.steps", str(steps), "--job.dump_folder", str(dump), *extra]


def step_folders(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoint").iterdir())


# ---------------------------------------------------------------- two ranks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """12 steps straight; 6 steps with checkpoints (kept aside at step 6); resumed to 12, async."""
    root = tmp_path_factory.mktemp("two_ranks")
    batch = ["--training.local_batch_size", "2"]
    check_ok(run_train(args(root / "straight", 12, *batch), nprocs=2))
    check_ok(run_train(args(root / "resumed", 6, *batch, *CKPT, "--checkpoint.interval", "3"), nprocs=2))
    shutil.copytree(root / "resumed", root / "at_step_6")
    proc = run_train(
        args(
            root / "resumed",
            12,
            *batch,
            *CKPT,
            "--checkpoint.interval",
            "3",
            "--checkpoint.keep_latest_k",
            "2",
            "--checkpoint.async_mode",
            "async",
            "--checkpoint.export_at_end",
            "true",
        ),
        nprocs=2,
    )
    check_ok(proc)
    return root, proc


def test_exact_resume_two_ranks(two_ranks):
    root, proc = two_ranks
    assert "checkpoint: loaded model+optimizer+lr_scheduler+dataloader+train_state+rng" in proc.stdout
    assert "step-6 (step 6)" in proc.stdout
    ref, got = train_losses(root / "straight"), train_losses(root / "resumed")
    assert sorted(ref) == sorted(got) == list(range(1, 13))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-6), (step, ref, got)
    assert ref[12] < ref[1]
    # keep_latest_k = 2: step-3 and step-6 pruned as the async step-9 and the (full) step-12 landed
    assert step_folders(root / "resumed") == ["step-12", "step-9"]
    meta = json.loads((root / "resumed" / "checkpoint" / "step-12" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["samples_per_step"] == 4 and not meta["model_only"]


def test_export_at_end_gathers_fsdp_shards(two_ranks):
    root, _ = two_ranks
    exported = load_export_tensors(root / "resumed" / "export")
    saved, _ = read_checkpoint_tensors(root / "resumed" / "checkpoint" / "step-12", "model.")
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


def test_resume_two_ranks_on_one(two_ranks, tmp_path):
    """Same global batch on one rank: the run continues within FSDP-vs-single-process tolerance."""
    root, _ = two_ranks
    shutil.copytree(root / "at_step_6", tmp_path / "one")
    proc = run_train(args(tmp_path / "one", 12, "--training.local_batch_size", "4", *CKPT))
    check_ok(proc)
    assert "rng: saved by 2 ranks, this run has 1" in proc.stdout
    ref, got = train_losses(root / "straight"), train_losses(tmp_path / "one")
    for step in range(7, 13):
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (step, ref, got)


def test_two_ranks_fall_back_past_a_changed_file_only_one_rank_checks(two_ranks, tmp_path):
    """Bytes changed inside rank 0's data file of step-6 (same size): only rank 1 reads that file for
    its CRC-32 share, and both ranks must agree to resume from step-3; the result is the straight run."""
    root, _ = two_ranks
    shutil.copytree(root / "at_step_6", tmp_path / "run")
    step6 = tmp_path / "run" / "checkpoint" / "step-6"
    with open(step6 / "__0_0.distcp", "r+b") as f:
        f.seek(f.seek(0, 2) // 2)
        f.write(b"\x7f\xff\xff\xff")
    older = {p.name: p.read_bytes() for p in (tmp_path / "run" / "checkpoint" / "step-3").iterdir()}
    proc = run_train(
        args(tmp_path / "run", 8, "--training.local_batch_size", "2", *CKPT, "--checkpoint.interval", "100"), nprocs=2
    )
    check_ok(proc)
    assert f"skipping {step6}: {step6 / '__0_0.distcp'}: its contents changed" in proc.stdout, proc.stdout[-3000:]
    assert "step-3 (step 3)" in proc.stdout
    ref, got = train_losses(root / "straight"), train_losses(tmp_path / "run")
    for step in range(4, 9):
        assert got[step] == pytest.approx(ref[step], abs=1e-6), (step, ref, got)
    assert {p.name: p.read_bytes() for p in (tmp_path / "run" / "checkpoint" / "step-3").iterdir()} == older


def test_two_rank_checkpoint_loads_in_one_process(two_ranks, tmp_path, in_process):
    """Model, optimizer and data position of the 2-rank step-6 checkpoint, loaded by one process."""
    root, _ = two_ranks
    ckpt = root / "at_step_6" / "checkpoint"
    cfg = parse_args(
        args(tmp_path, 12, "--training.local_batch_size", "4", "--checkpoint.initial_load_path", str(ckpt / "step-6"))
    )
    with torch.random.fork_rng():
        trainer = Trainer(cfg)
    try:
        run = trainer.run
        assert trainer.state.step == 6
        saved_model, _ = read_checkpoint_tensors(ckpt / "step-6", "model.")
        for fqn, value in run.model.state_dict().items():
            assert torch.equal(value, saved_model[fqn]), fqn
        saved_optim, _ = read_checkpoint_tensors(ckpt / "step-6", "optimizer.state.")
        live = get_optimizer_state_dict(run.model, run.optimizer)["state"]
        assert len(saved_optim) == sum(len(v) for v in live.values()) > 0
        for fqn, state in live.items():
            for key, value in state.items():
                assert torch.equal(value, saved_optim[f"{fqn}.{key}"]), (fqn, key)
        # the data order: the next batch is global batch 6 of an uninterrupted stream
        assert run.train_loader.samples_consumed == 6 * 4
        fresh = ByteDataLoader(
            build_mock_dataset(None, split="train", seed=0),
            seq_len=64,
            local_batch_size=4,
            dp_rank=0,
            dp_world_size=1,
            seed=0,
        )
        it = iter(fresh)
        for _ in range(6):
            next(it)
        expected, got = next(it), next(trainer.data_iter)
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    finally:
        trainer.close()


# ---------------------------------------------------------------- one rank: crashes, async


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """6 uninterrupted steps with a synchronous checkpoint every 2 steps."""
    dump = tmp_path_factory.mktemp("one_rank") / "straight"
    check_ok(run_train(args(dump, 6, "--training.local_batch_size", "2", *CKPT, "--checkpoint.interval", "2")))
    return dump


# Runs the trainer with dcp.save replaced: the second save dies (os._exit, as a kill would) either
# half-way through writing its files or after writing them but before the commit.
CRASHING_TRAINER = """
import os, sys
import torch.distributed.checkpoint as dcp
from spider_titan import train

mode, real_save, calls = sys.argv[1], dcp.save, []

def save(state_dict, *, checkpoint_id, **kwargs):
    calls.append(checkpoint_id)
    if len(calls) == 2:
        if mode == "mid-write":
            os.makedirs(checkpoint_id, exist_ok=True)
            with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as f:
                f.write(b"half a shard")
        else:
            real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)
        os._exit(9)
    return real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)

dcp.save = save
sys.exit(train.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("mode", ["mid-write", "before-commit"])
def test_killed_during_save_resumes_from_previous(mode, one_rank, tmp_path):
    dump = tmp_path / "crashed"
    run_args = args(
        dump,
        6,
        "--training.local_batch_size",
        "2",
        *CKPT,
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "1",
    )
    crashed = subprocess.run(
        [sys.executable, "-c", CRASHING_TRAINER, mode, *run_args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert crashed.returncode == 9, crashed.stderr[-3000:]
    names = step_folders(dump)
    assert names[0] == "step-2" and len(names) == 2 and names[1].startswith("step-4.tmp-"), names

    proc = run_train(run_args)
    check_ok(proc)
    assert "left by an interrupted save" in proc.stdout
    assert "step-2 (step 2)" in proc.stdout
    assert step_folders(dump) == ["step-6"]  # keep_latest_k = 1
    ref, got = train_losses(one_rank), train_losses(dump)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-6), (step, ref, got)


def test_async_checkpoints_equal_sync(one_rank, tmp_path):
    dump = tmp_path / "async"
    check_ok(
        run_train(
            args(
                dump,
                6,
                "--training.local_batch_size",
                "2",
                *CKPT,
                "--checkpoint.interval",
                "2",
                "--checkpoint.async_mode",
                "async",
            )
        )
    )
    assert step_folders(dump) == step_folders(one_rank) == ["step-2", "step-4", "step-6"]
    for step in (2, 4):
        a, _ = read_checkpoint_tensors(dump / "checkpoint" / f"step-{step}", "")
        b, _ = read_checkpoint_tensors(one_rank / "checkpoint" / f"step-{step}", "")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert train_losses(dump) == train_losses(one_rank)


def test_another_batch_size_says_where_the_data_continues(one_rank, tmp_path, in_process, capsys):
    cfg = parse_args(
        args(
            tmp_path,
            6,
            "--training.local_batch_size",
            "3",
            "--checkpoint.initial_load_path",
            str(one_rank / "checkpoint" / "step-4"),
        )
    )
    with torch.random.fork_rng():
        trainer = Trainer(cfg)
    trainer.close()
    assert trainer.run.train_loader.samples_consumed == 4 * 2
    out = capsys.readouterr().out
    assert "dataloader: saved at 2 samples per step, this run takes 3: continuing from global sample 8" in out


def test_spider_resume_restores_the_rng(tmp_path):
    """Spider samples boundary noise in training: without the saved RNG state step 3 would differ."""
    spider = ["--model.name", "spider", "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "1"]
    check_ok(run_train(args(tmp_path / "straight", 4, *spider)))
    check_ok(run_train(args(tmp_path / "resumed", 2, *spider, *CKPT, "--checkpoint.interval", "2")))
    check_ok(run_train(args(tmp_path / "resumed", 4, *spider, *CKPT)))
    ref, got = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert sorted(got) == [1, 2, 3, 4]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-6), (step, ref, got)


# ---------------------------------------------------------------- start-up errors


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--checkpoint.initial_load_path", "{tmp}/nothing"], ["{tmp}/nothing does not exist"]),
        (
            ["--checkpoint.enable", "true", "--checkpoint.load_step", "5"],
            ["checkpoint.load_step = 5", "at or before step 5 in {tmp}/run/checkpoint"],
        ),
        (
            ["--checkpoint.initial_load_path", "{tmp}/step-4.tmp-0123"],
            ["{tmp}/step-4.tmp-0123 is not a complete checkpoint"],
        ),
        (["--checkpoint.initial_load_path", "{ckpt}/step-4", "--model.dim", "64"], ["{ckpt}/step-4", "dim 128 -> 64"]),
        (
            ["--checkpoint.initial_load_path", "{ckpt}/step-4", "--training.seq_len", "32"],
            ["{ckpt}/step-4", "seq_len=64 in the checkpoint"],
        ),
    ],
    ids=["missing", "missing-step", "partial", "other-model-args", "other-seq-len"],
)
def test_bad_checkpoints_fail_in_one_line(extra, needles, one_rank, tmp_path, in_process, capsys):
    partial = tmp_path / "step-4.tmp-0123"  # what a save killed before writing .metadata leaves
    shutil.copytree(one_rank / "checkpoint" / "step-4", partial)
    (partial / ".metadata").unlink()

    def fill(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path)).replace("{ckpt}", str(one_rank / "checkpoint"))

    with torch.random.fork_rng():
        code = main(args(tmp_path / "run", 2, "--training.local_batch_size", "2", *map(fill, extra)))
    assert code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in map(fill, needles):
        assert needle in lines[0], lines[0]
