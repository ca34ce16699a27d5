"""Hostile inputs, as a table: what a user gets wrong or what goes wrong under them.

Each row is one command line (with the data or checkpoints it needs made on the fly), the exit
code it must end with, the one line the user sees on stderr, and a check that nothing on disk was
lost. Rows that only need the config or the data run ``main(argv)`` in this process (fast);
signals, divergence and crashes run the real CLI in a subprocess.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from spider_titan.checkpoint.export import read_checkpoint_tensors
from spider_titan.config.parse import sections
from spider_titan.data.shards import write_shard
from spider_titan.train import main
from spider_titan.vocab import BOS_ID, EOS_ID, PAD_ID
from tests.utils import REPO, check_ok, read_metrics, run_train, shown_python, tiny_run

# the tiny run on the config's own corpus and step count: each row names its data and length
SPIDER = tiny_run(training__dataset=None, training__steps=None)
MOCK = ["--training.dataset", "mock"]


def text_tokens(n_docs: int = 40) -> np.ndarray:
    doc = [BOS_ID, *b"def f(x):\n    return x + 1\n", EOS_ID]
    return np.array(doc * n_docs, dtype=np.uint16)


def bytes_data(root: Path, train: np.ndarray, val: np.ndarray | None = None) -> Path:
    write_shard(root / "train" / "data_000000.bin", train)
    write_shard(root / "val" / "data_val_000000.bin", text_tokens() if val is None else val)
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes: 'nothing lost' is 'the same snapshot after'."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def finite_checkpoint(path: Path) -> bool:
    tensors, _ = read_checkpoint_tensors(path, "")
    return all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())


# ---------------------------------------------------------------- the table


@dataclass
class Row:
    id: str
    args: list[str]
    code: int
    needles: list[str]  # all in the one stderr line ({data} and {dump} filled in)
    make: Callable[[Path], None] | None = None  # writes the row's data under {data}
    kept: Callable[[Path], bool] | None = None  # extra "nothing lost" check on tmp_path
    extra_lines: int = 0  # stderr lines allowed beside the error line (config errors: one per problem)


def _truncated(data: Path) -> None:
    bytes_data(data, text_tokens())
    with open(data / "train" / "data_000000.bin", "ab") as f:
        f.write(b"\x01")  # an odd byte: a shard cut mid-token


def _all_pad(data: Path) -> None:
    bytes_data(data, np.full(4096, PAD_ID, dtype=np.uint16), np.full(4096, PAD_ID, dtype=np.uint16))


def _pad_val(data: Path) -> None:
    bytes_data(data, text_tokens(), np.full(4096, PAD_ID, dtype=np.uint16))


def _pad_windows(data: Path) -> None:
    # a few real bytes, then a long PAD run: most 64-byte windows hold nothing to predict
    bytes_data(data, np.concatenate([text_tokens(1), np.full(64 * 400, PAD_ID, dtype=np.uint16)]))


def _empty(data: Path) -> None:
    data.mkdir(parents=True)


def _a_text_file(data: Path) -> None:
    data.mkdir(parents=True)
    (data / "notes.txt").write_text("text\n")


def _wrong_types() -> tuple[list[str], list[str]]:
    """One wrongly typed value for every section that has a number or bool field."""
    args, keys = [], []
    for name, cls in sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float, bool):
                args += [f"--{name}.{f.name}", "not-a-number"]
                keys.append(f"{name}.{f.name}")
                break
    return args, keys


WRONG_ARGS, WRONG_KEYS = _wrong_types()
BYTES = ["--training.dataset", "bytes", "--training.dataset_path", "{data}"]


def _random_ids(data: Path) -> None:
    bytes_data(data, np.random.default_rng(0).integers(0, 65536, size=4096).astype(np.uint16))


def _text_as_bin(data: Path) -> None:
    bytes_data(data, text_tokens())
    (data / "train" / "data_000000.bin").write_bytes(b"a text file renamed .bin!\n")  # an even size


def _ids_past_the_probe(data: Path) -> None:
    """A 2M-token shard whose start-up probe blocks (16 x 64K tokens, evenly spaced) hold good text
    and everything between them id 300: the first batches read it."""
    tokens = np.full(1 << 21, 300, dtype=np.uint16)
    good = np.resize(text_tokens(), 1 << 16)
    for start in range(0, tokens.size, tokens.size // 16):
        tokens[start : start + good.size] = good
    bytes_data(data, tokens)


def _truncated_jsonl_gz(data: Path) -> None:
    import gzip
    import json

    data.mkdir(parents=True)
    whole = gzip.compress(b"".join(json.dumps({"text": f"doc {i} " * 40}).encode() + b"\n" for i in range(300)))
    (data / "docs.jsonl.gz").write_bytes(whole[: len(whole) // 2])


ROWS = [
    Row("truncated-shard", SPIDER + BYTES, 2, ["{data}/train/data_000000.bin", "odd size"], _truncated),
    Row("all-pad-shards", SPIDER + BYTES, 2, ["{data}/train/data_000000.bin", "every token is PAD"], _all_pad),
    Row(
        "all-pad-val",
        SPIDER + BYTES + ["--validation.enable", "true"],
        2,
        ["{data}/val/data_val_000000.bin", "every token is PAD"],
        _pad_val,
    ),
    Row(
        "pad-only-batch",
        SPIDER + BYTES + ["--training.local_batch_size", "1", "--training.steps", "50"],
        1,
        ["no label tokens", "train shards under {data}"],
        _pad_windows,
    ),
    Row("empty-folder", SPIDER + BYTES, 2, ["no *.bin token shards under {data}"], _empty),
    Row(
        "dataset-path-is-a-file",
        SPIDER + ["--training.dataset", "bytes", "--training.dataset_path", "{data}/notes.txt"],
        2,
        ["dataset path {data}/notes.txt is a file, not a folder of *.bin token shards"],
        _a_text_file,
    ),
    Row("missing-folder", SPIDER + BYTES, 2, ["{data}", "does not exist"]),
    Row("wrong-types", SPIDER + WRONG_ARGS, 2, [WRONG_KEYS[0]], extra_lines=len(WRONG_KEYS) - 1),
    Row("unknown-key", SPIDER + ["--training.stepz", "3"], 2, ["training.stepz"]),
    Row("unknown-section", SPIDER + ["--trianing.steps", "3"], 2, ["trianing"]),
    Row(
        "retired-model-option",
        SPIDER + ["--model.halting", "act"],
        2,
        ["--model.halting: model.halting has left spider (last in commit e0e7ffe", "remove it"],
    ),
    Row("misspelt-backend", SPIDER + ["--moe.backend", "tritn"], 2, ["moe.backend", "tritn", "triton"]),
    Row(
        "misspelt-ac-mode",
        SPIDER + ["--activation_checkpoint.mode", "ful"],
        2,
        ["activation_checkpoint.mode", "ful", "full"],
    ),
    Row(
        "impossible-degrees",
        SPIDER + ["--parallelism.data_parallel_shard_degree", "3"],
        2,
        ["data_parallel_shard_degree", "WORLD_SIZE"],
    ),
    Row("missing-config", ["--job.config_file", "train_configs/no_such_job.toml"], 2, ["no_such_job.toml"]),
    Row(
        "negative-min-lr-factor",
        SPIDER + MOCK + ["--lr_scheduler.min_lr_factor", "-0.5"],
        2,
        ["lr_scheduler.min_lr_factor = -0.5", "in [0, 1]"],
    ),
    Row(
        "negative-validation-steps",
        SPIDER + MOCK + ["--validation.steps", "-7"],
        2,
        ["validation.steps = -7", "-1 (the whole split) or an integer >= 1"],
    ),
    Row("negative-seed", SPIDER + MOCK + ["--training.seed", "-1"], 2, ["training.seed = -1", "in [0, 8388607]"]),
    Row(
        "seq-len-above-max-seq-len",
        SPIDER + MOCK + ["--training.seq_len", "4096"],
        2,
        ["training.seq_len = 4096", "model.max_seq_len = 2048", "set model.max_seq_len = 4096"],
    ),
    Row(
        "ids-outside-the-vocabulary",
        SPIDER + BYTES,
        2,
        ["{data}/train/data_000000.bin: token id", "outside the byte vocabulary", "scripts/prepare_data.py"],
        _random_ids,
    ),
    Row(
        "text-renamed-bin",
        SPIDER + BYTES,
        2,
        ["{data}/train/data_000000.bin: token id 8289 at byte offset 0", "scripts/prepare_data.py"],
        _text_as_bin,
    ),
    Row(
        "ids-past-the-probe",
        SPIDER + BYTES + ["--training.steps", "20"],
        1,
        ["{data}/train/data_000000.bin: token id 300 at byte offset", "scripts/prepare_data.py"],
        _ids_past_the_probe,
    ),
    Row(
        "text-dataset-truncated-gzip",
        SPIDER + ["--training.dataset", "text", "--training.dataset_path", "{data}/docs.jsonl.gz"],
        2,
        ["{data}/docs.jsonl.gz: ", "truncated", "gzip -t"],
        _truncated_jsonl_gz,
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_hostile_input(row, tmp_path, in_process, capsys):
    data, dump = tmp_path / "data", tmp_path / "run"
    if row.make is not None:
        row.make(data)
    before = snapshot(data) if data.exists() else {}

    def fill(text: str) -> str:
        return text.replace("{data}", str(data)).replace("{dump}", str(dump))

    with torch.random.fork_rng():
        code = main([fill(a) for a in row.args] + ["--job.dump_folder", str(dump)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == row.code, err
    assert len(lines) == 1 + row.extra_lines and "Traceback" not in err, err
    for needle in map(fill, row.needles):
        assert needle in err, (needle, err)
    if row.id == "wrong-types":  # every section's problem is reported at once
        assert all(any(key in line for line in lines) for key in WRONG_KEYS), (WRONG_KEYS, lines)
    assert (snapshot(data) if data.exists() else {}) == before  # the data is untouched


# ---------------------------------------------------------------- rows that need a real process


@pytest.mark.slow
def test_diverged_run_keeps_its_good_checkpoints_and_resumes_from_the_last(tmp_path):
    """lr 1e6: the run stops with exit 1 and one line naming the step and the last good checkpoint;
    no checkpoint on disk holds a non-finite tensor; the same command resumes from that one."""
    dump = tmp_path / "run"
    cmd = (
        SPIDER
        + MOCK
        + [
            "--optimizer.lr",
            "1e6",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "1",
            "--training.steps",
            "12",
            "--job.dump_folder",
            str(dump),
        ]
    )
    proc = run_train(cmd, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "non-finite" in lines[0], proc.stderr
    saved = sorted((dump / "checkpoint").glob("step-*"))
    assert saved, "the steps before the divergence were saved"
    last = saved[-1]
    assert f"last good checkpoint {last}" in lines[0] and f"--checkpoint.load_step {last.name[5:]}" in lines[0]
    assert f"resume from it with: {shown_python()} -m spider_titan.train " in lines[0], lines[0]
    bad_step = int(lines[0].split()[2].rstrip(":"))  # "error: step N: non-finite ..."
    assert bad_step == int(last.name[5:]) + 1  # every finite step before it was saved (interval 1)
    assert all(finite_checkpoint(p) for p in saved)

    again = run_train(cmd, timeout=300)
    assert again.returncode == 1
    assert f"loaded model+optimizer+lr_scheduler+dataloader+train_state+rng from {last}" in again.stdout, again.stdout
    assert sorted((dump / "checkpoint").glob("step-*")) == saved


@pytest.mark.slow
def test_two_ranks_stop_together_at_a_diverged_step(tmp_path):
    """FSDP over 2 ranks: both ranks see the same bad step and stop there; one line, exit 1."""
    dump = tmp_path / "run"
    proc = run_train(
        SPIDER + MOCK + ["--optimizer.lr", "1e6", "--training.steps", "12", "--job.dump_folder", str(dump)],
        nprocs=2,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "non-finite" in errors[0] and "checkpoint.enable is false" in errors[0], proc.stderr


def test_skip_nonfinite_steps_skips_then_stops(tmp_path, in_process, capsys, monkeypatch):
    """skip_nonfinite_steps = 2: two NaN steps in a row are skipped (weights untouched), the third stops."""
    from spider_titan import train as train_module

    real_clip = train_module.clip_grad_norm_
    calls = []

    def poisoned(params, max_norm):  # steps 3, 4, 5 report a NaN gradient norm
        calls.append(1)
        norm = real_clip(params, max_norm)
        return norm * float("nan") if len(calls) >= 3 else norm

    monkeypatch.setattr(train_module, "clip_grad_norm_", poisoned)
    with torch.random.fork_rng():
        code = main(
            SPIDER
            + MOCK
            + [
                "--training.steps",
                "8",
                "--training.skip_nonfinite_steps",
                "2",
                "--job.dump_folder",
                str(tmp_path / "run"),
            ]
        )
    captured = capsys.readouterr()
    assert code == 1
    assert "step 3: non-finite loss or gradient norm; update skipped (1 of at most 2 in a row)" in captured.out
    assert "step 4: non-finite loss or gradient norm; update skipped (2 of at most 2 in a row)" in captured.out
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: step 5: non-finite gradient norm"), captured.err
    assert "3 non-finite steps in a row, training.skip_nonfinite_steps = 2" in lines[0]


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(tmp_path, in_process, capsys):
    dense = tmp_path / "dense"
    check_ok(
        run_train(
            [
                "--job.config_file",
                "train_configs/debug_dense.toml",
                *MOCK,
                "--training.seq_len",
                "64",
                "--training.steps",
                "1",
                "--validation.enable",
                "false",
                "--checkpoint.enable",
                "true",
                "--checkpoint.last_save_model_only",
                "false",
                "--checkpoint.export_at_end",
                "false",
                "--metrics.enable_tensorboard",
                "false",
                "--job.dump_folder",
                str(dense),
            ]
        )
    )
    before = snapshot(dense)
    with torch.random.fork_rng():
        code = main(
            SPIDER
            + MOCK
            + [
                "--checkpoint.initial_load_path",
                str(dense / "checkpoint"),
                "--job.dump_folder",
                str(tmp_path / "spider"),
            ]
        )
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "holds a 'dense' model" in lines[0] and str(dense / "checkpoint") in lines[0], err
    assert snapshot(dense) == before


# A save that stops half-way and waits there, so the test can kill -9 it mid-write.
SLOW_SAVE_TRAINER = """
import os, sys, time
import torch.distributed.checkpoint as dcp
from spider_titan import train

real_save, calls = dcp.save, []

def save(state_dict, *, checkpoint_id, **kwargs):
    calls.append(checkpoint_id)
    if len(calls) == 2:
        os.makedirs(checkpoint_id, exist_ok=True)
        with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as f:
            f.write(b"half a shard")
        print("SAVING", flush=True)
        time.sleep(600)
    return real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)

dcp.save = save
sys.exit(train.main(sys.argv[1:]))
"""


def _wait_for(proc: subprocess.Popen, ready: Callable[[], bool], what: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}"
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)


@pytest.mark.slow
def test_kill_9_mid_save_resumes_from_the_previous_checkpoint(tmp_path):
    dump = tmp_path / "run"
    cmd = (
        SPIDER
        + MOCK
        + [
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "2",
            "--training.steps",
            "6",
            "--job.dump_folder",
            str(dump),
        ]
    )
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_SAVE_TRAINER, *cmd],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            _wait_for(proc, lambda: "SAVING" in out.read_text(), "second save")
            kept = snapshot(dump / "checkpoint" / "step-2")
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    resumed = run_train(cmd, timeout=300)
    check_ok(resumed)
    assert "left by an interrupted save" in resumed.stdout
    assert f"from {dump / 'checkpoint' / 'step-2'} (step 2)" in resumed.stdout
    assert [row["step"] for row in read_metrics(dump) if "loss" in row][-4:] == [3, 4, 5, 6]
    assert kept  # the checkpoint resumed from was complete when the crash came


@pytest.mark.slow
def test_sigterm_mid_run_saves_and_resumes(tmp_path):
    """Preemption: the step finishes, a checkpoint is written, exit 143; the same command resumes."""
    dump = tmp_path / "run"
    cmd = (
        SPIDER + MOCK + ["--checkpoint.enable", "true", "--checkpoint.interval", "1000", "--job.dump_folder", str(dump)]
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "spider_titan.train", *cmd, "--training.steps", "100000"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(proc, lambda: (dump / "metrics.jsonl").exists() and len(read_metrics(dump)) >= 3, "three steps")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    stopped = max(row["step"] for row in read_metrics(dump))
    assert (dump / "checkpoint" / f"step-{stopped}").is_dir(), out[-3000:]
    assert f"stopped at step {stopped} with a checkpoint" in out

    resumed = run_train(cmd + ["--training.steps", str(stopped + 2)])
    check_ok(resumed)
    assert [row["step"] for row in read_metrics(dump) if "loss" in row][-2:] == [stopped + 1, stopped + 2]


# ---------------------------------------------------------------- checkpoints any tool can read


@pytest.mark.slow
def test_dcp_to_torch_save_loads_with_weights_only(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dump = tmp_path / "run"
    check_ok(
        run_train(
            SPIDER
            + MOCK
            + [
                "--training.steps",
                "2",
                "--checkpoint.enable",
                "true",
                "--checkpoint.interval",
                "2",
                "--checkpoint.last_save_model_only",
                "false",
                "--job.dump_folder",
                str(dump),
            ]
        )
    )
    out = tmp_path / "ckpt.pt"
    dcp_to_torch_save(str(dump / "checkpoint" / "step-2"), str(out))
    state = torch.load(out, weights_only=True)
    assert set(state) >= {"model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"}
    assert state["rng"]["cpu"].dtype == torch.uint8 and state["rng"]["cpu"].shape[0] == 1
    assert state["train_state"]["step"] == 2


# ---------------------------------------------------------------- disk, memory, damaged checkpoints (issue 20)

CKPT = MOCK + [
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "1",
    "--checkpoint.last_save_model_only",
    "false",
]


def _train(args: list[str], dump: Path, capsys) -> tuple[int, str, list[str]]:
    """``main`` in this process: (exit code, stdout, the non-empty stderr lines)."""
    with torch.random.fork_rng():
        code = main(SPIDER + args + ["--job.dump_folder", str(dump)])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    return code, out, lines


def _without_dac_override() -> None:
    """In the child before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set,
    so a root process obeys file modes like anyone (the interpreter may live under /root, out of
    another user's reach, so switching to nobody is no option)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.slow
def test_read_only_dump_folder(tmp_path):
    """A dump folder this user cannot write: refused at start-up (exit 2, before anything is built), one
    line naming it, EACCES and the key to change."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "spider_titan.train",
                *SPIDER,
                *MOCK,
                "--training.steps",
                "1",
                "--job.dump_folder",
                str(locked / "run"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=_without_dac_override if os.geteuid() == 0 else None,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finally:
        locked.chmod(0o755)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert str(locked / "run") in lines[0] and "permission denied (EACCES)" in lines[0], lines
    assert "job.dump_folder" in lines[0]
    assert list(locked.iterdir()) == []


SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


@pytest.mark.parametrize("failure", ["enospc", "edquot", "short-write", "enospc-async"])
def test_disk_full_during_a_checkpoint_save(failure, tmp_path, in_process, capsys, monkeypatch):
    """The writer fails on the second save: one line (ENOSPC or EDQUOT named; torch's "unexpected pos"
    on a full disk read as ENOSPC), exit 1, no partial folder, the first checkpoint byte-identical."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from spider_titan import errors

    dump = tmp_path / "run"
    assert _train(CKPT + ["--training.steps", "1"], dump, capsys)[0] == 0
    before = snapshot(dump / "checkpoint")
    real = dcp_fs._write_item

    def full_disk(*args, **kwargs):
        if failure == "short-write":
            raise RuntimeError(SHORT_WRITE)
        code = errno.EDQUOT if failure == "edquot" else errno.ENOSPC
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(dcp_fs, "_write_item", full_disk)
    if failure == "short-write":  # the disk as torch leaves it: full
        monkeypatch.setattr(errors, "free_bytes", lambda path: 0)
    mode = ["--checkpoint.async_mode", "async"] if failure == "enospc-async" else []  # fails in a thread
    code, _, lines = _train(CKPT + mode + ["--training.steps", "3"], dump, capsys)
    monkeypatch.setattr(dcp_fs, "_write_item", real)
    named = "disk quota exceeded (EDQUOT)" if failure == "edquot" else "no space left on device (ENOSPC)"
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: checkpoint step 2 not saved") and named in lines[0], lines
    assert str(dump / "checkpoint") in lines[0] and "job.dump_folder" in lines[0] and "intact" in lines[0]
    assert snapshot(dump / "checkpoint") == before  # step-1 as it was, no step-2 or step-2.tmp-* left


def test_disk_full_during_the_end_of_run_export(tmp_path, in_process, capsys, monkeypatch):
    import safetensors.torch

    dump = tmp_path / "run"

    def full_disk(*args, **kwargs):  # safetensors' own words for a full disk: not an OSError
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    code, _, lines = _train(CKPT + ["--training.steps", "2", "--checkpoint.export_at_end", "true"], dump, capsys)
    step2 = dump / "checkpoint" / "step-2"
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: export at step 2 not written") and str(dump / "export") in lines[0], lines
    assert "no space left on device (ENOSPC)" in lines[0]
    assert f"export it later with {shown_python()} " in lines[0], lines
    assert f"--checkpoint {step2} --out {dump / 'export'}" in lines[0]
    assert not (dump / "export").exists() and finite_checkpoint(step2)


def test_a_resume_under_another_optimizer_says_the_files_are_fine(tmp_path, in_process, capsys):
    """The checkpoint is intact, this run's optimizer state has other keys: the line says so and how to go
    on (it said "cannot be loaded ... restore their files"), and the checkpoint is left as it was."""
    dump = tmp_path / "run"
    assert _train(CKPT + ["--training.steps", "1"], dump, capsys)[0] == 0
    before = snapshot(dump / "checkpoint")
    code, _, lines = _train(CKPT + ["--training.steps", "2", "--optimizer.name", "Muon"], dump, capsys)
    step1 = dump / "checkpoint" / "step-1"
    assert code == 2 and len(lines) == 1, lines
    assert f"{step1} does not fit this run: it holds no optimizer." in lines[0], lines
    assert "its files are intact" in lines[0] and "restore their files" not in lines[0]
    assert f"--checkpoint.initial_load_path {step1} --checkpoint.initial_load_model_only true" in lines[0]
    assert snapshot(dump / "checkpoint") == before


def test_pruning_leaves_a_damaged_older_checkpoint_alone(tmp_path, in_process, capsys):
    """keep_latest_k passes over a checkpoint whose meta.json is garbage: logged, kept as it is, the run
    goes on (a damaged old folder is no reason to stop training, nor ours to delete)."""
    dump = tmp_path / "run"
    assert _train(CKPT + ["--training.steps", "2"], dump, capsys)[0] == 0
    (dump / "checkpoint" / "step-1" / "meta.json").write_bytes(b"\xff\x00{not json")
    damaged = snapshot(dump / "checkpoint" / "step-1")
    code, out, lines = _train(CKPT + ["--training.steps", "4", "--checkpoint.keep_latest_k", "1"], dump, capsys)
    assert code == 0 and lines == [], lines
    assert f"keep_latest_k leaves {dump / 'checkpoint' / 'step-1'} alone, it is damaged" in out
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-1", "step-4"]
    assert snapshot(dump / "checkpoint" / "step-1") == damaged


def _garbage_meta(step: Path) -> None:
    (step / "meta.json").write_text('{"format_version": 1, "st')


def _cut_data(step: Path) -> None:
    with open(step / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)


def _cut_metadata(step: Path) -> None:
    with open(step / ".metadata", "r+b") as f:
        f.truncate(50)


def _flipped_bytes(step: Path) -> None:  # same size: only the CRC-32 in meta.json tells
    with open(step / "__0_0.distcp", "r+b") as f:
        f.seek(f.seek(0, 2) // 2)
        f.write(b"\x7f\xff\xff\xff")


@pytest.mark.parametrize(
    "damage",
    [_garbage_meta, _cut_data, _cut_metadata, _flipped_bytes],
    ids=["meta.json", "truncated-distcp", "truncated-metadata", "changed-distcp"],
)
def test_resume_falls_back_past_a_damaged_newest_checkpoint(damage, tmp_path, in_process, capsys):
    dump = tmp_path / "run"
    assert _train(CKPT + ["--training.steps", "2"], dump, capsys)[0] == 0
    damage(dump / "checkpoint" / "step-2")
    older = snapshot(dump / "checkpoint" / "step-1")
    code, out, lines = _train(CKPT + ["--training.steps", "3", "--checkpoint.interval", "100"], dump, capsys)
    assert code == 0 and lines == [], lines
    assert f"checkpoint: skipping {dump / 'checkpoint' / 'step-2'}: " in out, out[-3000:]
    assert f"from {dump / 'checkpoint' / 'step-1'} (step 1)" in out
    assert snapshot(dump / "checkpoint" / "step-1") == older


def test_every_checkpoint_damaged_stops_instead_of_starting_over(tmp_path, in_process, capsys):
    dump = tmp_path / "run"
    assert _train(CKPT + ["--training.steps", "2"], dump, capsys)[0] == 0
    for step in ("step-1", "step-2"):
        _cut_data(dump / "checkpoint" / step)
    before = snapshot(dump / "checkpoint")
    code, _, lines = _train(CKPT + ["--training.steps", "3"], dump, capsys)
    assert code == 2 and len(lines) == 1, lines
    assert f"no checkpoint in {dump / 'checkpoint'} loads" in lines[0] and "will not train over them" in lines[0]
    assert str(dump / "checkpoint" / "step-2" / "__0_0.distcp") in lines[0], lines
    assert str(dump / "checkpoint" / "step-1" / "__0_0.distcp") in lines[0], lines
    assert snapshot(dump / "checkpoint") == before


# ---------------------------------------------------------------- a run folder is one run's (issue 36)


@dataclass
class FolderRow:
    """A folder made by ``make(tmp_path)`` (a real earlier run, or a user's own files), then a start
    there with ``args``: its exit code, the phrases of its one stderr line, and every file under
    ``{dump}`` byte for byte the same afterwards."""

    id: str
    make: Callable[[Path, object], None]
    args: list[str]
    code: int
    needles: list[str]


def _earlier_run(args: list[str]) -> Callable[[Path, object], None]:
    def make(dump: Path, capsys) -> None:
        assert _train(args + ["--training.steps", "2"], dump, capsys)[0] == 0

    return make


def _then(first: Callable[[Path, object], None], damage: Callable[[Path], None]) -> Callable[[Path, object], None]:
    def make(dump: Path, capsys) -> None:
        first(dump, capsys)
        for step in sorted((dump / "checkpoint").glob("step-*")):
            damage(step)

    return make


def _users_folder(dump: Path, capsys) -> None:
    dump.mkdir()
    (dump / "config.toml").write_text("# my own notes\nlr = 3\n")
    (dump / "metrics.jsonl").write_text('{"mine": 1}\n')


def _no_metadata(step: Path) -> None:
    (step / ".metadata").unlink()


EXPORTS = MOCK + ["--checkpoint.export_at_end", "true", "--metrics.enable_tensorboard", "true"]
ONE_CKPT = CKPT + ["--checkpoint.interval", "100", "--metrics.enable_tensorboard", "true"]
FOLDER_ROWS = [
    FolderRow(
        "only-checkpoint-without-metadata",
        _then(_earlier_run(ONE_CKPT), _no_metadata),
        ONE_CKPT + ["--training.steps", "3"],
        2,
        ["no checkpoint in {dump}/checkpoint loads", "{dump}/checkpoint/step-2: no .metadata", "will not train over"],
    ),
    FolderRow(
        "only-checkpoint-with-bad-meta",
        _then(_earlier_run(ONE_CKPT), _garbage_meta),
        ONE_CKPT + ["--training.steps", "3"],
        2,
        ["no checkpoint in {dump}/checkpoint loads", "{dump}/checkpoint/step-2/meta.json: unreadable"],
    ),
    FolderRow(
        "finished-run-checkpoints-off",
        _earlier_run(EXPORTS),
        EXPORTS + ["--training.steps", "3"],
        2,
        ["{dump} holds run ", "finished at step 2", "export/", "metrics.jsonl", "--job.overwrite true"],
    ),
    FolderRow(
        "finished-run-model-only-save",
        _earlier_run(MOCK + ["--checkpoint.enable", "true", "--checkpoint.last_save_model_only", "true"]),
        MOCK + ["--checkpoint.enable", "true", "--training.steps", "3"],
        2,
        ["{dump} holds run ", "checkpoint/", "no full checkpoint to resume from", "--job.dump_folder <path>"],
    ),
    FolderRow(
        "users-own-folder",
        _users_folder,
        MOCK + ["--training.steps", "1"],
        2,
        ["{dump} is not empty and was not made by spider_titan", "config.toml, metrics.jsonl"],
    ),
    FolderRow(
        "users-own-folder-overwrite",
        _users_folder,
        MOCK + ["--training.steps", "1", "--job.overwrite", "true"],
        2,
        ["{dump} is not empty and was not made by spider_titan"],
    ),
    FolderRow(
        "resume-with-another-seq-len",
        _earlier_run(ONE_CKPT),
        ONE_CKPT + ["--training.steps", "3", "--training.seq_len", "32"],
        2,
        ["{dump}/checkpoint/step-2 does not fit this run", "seq_len=64 in the checkpoint but seq_len=32"],
    ),
]


@pytest.mark.parametrize("row", FOLDER_ROWS, ids=[r.id for r in FOLDER_ROWS])
def test_a_run_folder_is_never_trained_over(row, tmp_path, in_process, capsys):
    dump = tmp_path / "run"
    row.make(dump, capsys)
    before = snapshot(dump)
    code, _, lines = _train(row.args, dump, capsys)
    assert code == row.code and len(lines) == 1, lines
    for needle in row.needles:
        assert needle.replace("{dump}", str(dump)) in lines[0], (needle, lines[0])
    assert snapshot(dump) == before


def test_overwrite_replaces_a_finished_run(tmp_path, in_process, capsys):
    """--job.overwrite true deletes what the earlier run wrote (and nothing else), then trains anew."""
    dump = tmp_path / "run"
    _earlier_run(EXPORTS)(dump, capsys)
    (dump / "notes.txt").write_text("mine")
    old_id = json.loads((dump / "run.json").read_text())["run_id"]
    code, out, lines = _train(EXPORTS + ["--training.steps", "3", "--job.overwrite", "true"], dump, capsys)
    assert code == 0 and lines == [], lines
    assert f"run folder: job.overwrite: deleted export/, metrics.jsonl, tb/ of run {old_id}" in out, out[-3000:]
    assert [row["step"] for row in read_metrics(dump) if "loss" in row] == [1, 2, 3]
    assert len(list((dump / "tb").iterdir())) == 1 and (dump / "notes.txt").read_text() == "mine"
    run = json.loads((dump / "run.json").read_text())
    assert run["run_id"] != old_id and run["state"] == "finished" and run["step"] == 3


def test_empty_dump_folder_is_a_config_error(tmp_path, in_process, capsys, monkeypatch):
    """``--job.dump_folder ""`` would write into the current folder (the repository root): refused."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("a repository")
    with torch.random.fork_rng():
        code = main([*(str(REPO / a) if a.endswith(".toml") else a for a in SPIDER), *MOCK, "--job.dump_folder", ""])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == (
        "config error: job.dump_folder: empty; name the folder for the run's files, e.g. --job.dump_folder outputs/myrun"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]


def test_a_start_that_failed_leaves_a_folder_the_next_start_takes(tmp_path, in_process, capsys):
    """A start refused after the folder was claimed (bad data) writes nothing there, so the next
    start in the same folder trains."""
    dump = tmp_path / "run"
    bad = ["--training.dataset", "bytes", "--training.dataset_path", str(tmp_path / "missing"), "--training.steps", "1"]
    code, _, lines = _train(bad, dump, capsys)
    assert code == 2 and "does not exist" in lines[0], lines
    assert list(dump.iterdir()) == []  # no run.json, config.toml, metrics or TensorBoard file
    assert _train(MOCK + ["--training.steps", "1"], dump, capsys)[0] == 0


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_out_of_memory_names_the_step_and_the_knobs(device, tmp_path, in_process, capsys, monkeypatch):
    """torch's CUDA OutOfMemoryError, and a real CPU allocator failure, inside step 2."""
    from spider_titan import train as train_module

    real_clip, calls = train_module.clip_grad_norm_, []

    def clip(params, max_norm):
        calls.append(1)
        if len(calls) == 2:
            if device == "cuda":
                raise torch.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                    "capacity of 79.10 GiB of which 1.06 GiB is free."
                )
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the allocator's own error
        return real_clip(params, max_norm)

    monkeypatch.setattr(train_module, "clip_grad_norm_", clip)
    code, _, lines = _train(MOCK + ["--training.steps", "4"], tmp_path / "run", capsys)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: step 2: out of memory (")
    assert ("CUDA out of memory" if device == "cuda" else "can't allocate memory") in lines[0]
    assert "enforce fail" not in lines[0]
    for knob in ("training.local_batch_size", "activation_checkpoint.mode", "training.seq_len"):
        assert knob in lines[0], lines[0]


# ---------------------------------------------------------------- export and generate (issue 20)


def _script_main(name: str, argv: list[str], capsys) -> tuple[int, str, list[str]]:
    """``scripts/<name>.py`` main(argv) in this process: (exit code, stdout, stderr lines) as a shell sees them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"hostile_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = 0
    try:
        module.main(argv)
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    if isinstance(code, str):  # sys.exit("message"): the interpreter prints it and exits 1
        code, err = 1, err + code + "\n"
    assert "Traceback" not in err, err
    return code, out, [line for line in err.splitlines() if line.strip()]


@dataclass
class ToolRow:
    """A script's command line (``{root}`` is the test's folder), what ``make(root)`` put there first,
    the exit code, the phrases of its one stderr line, and every file under ``{root}`` unchanged."""

    id: str
    script: str
    args: list[str]
    code: int
    needles: list[str]
    make: Callable[[Path], None] | None = None
    stdin: bytes | None = None


def _metrics(*lines: str) -> Callable[[Path], None]:
    def make(root: Path) -> None:
        (root / "run").mkdir()
        (root / "run" / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))

    return make


def _file(root: Path) -> None:
    (root / "notes.txt").write_text("not a run\n")


TOOL_ROWS = [
    ToolRow(
        "plot-broken-line",
        "plot",
        ["{root}/run"],
        2,
        ["{root}/run/metrics.jsonl line 2: not JSON", "fix or delete that line"],
        _metrics('{"step": 1, "loss": 2.0}', "garbage", '{"step": 2, "loss": 1.0}'),
    ),
    ToolRow("plot-empty-metrics", "plot", ["{root}/run"], 2, ["holds no logged step yet"], _metrics()),
    ToolRow("plot-missing-folder", "plot", ["{root}/nope"], 2, ["run folder {root}/nope does not exist"]),
    ToolRow(
        "plot-run-is-a-file", "plot", ["{root}/notes.txt"], 2, ["{root}/notes.txt is a file, not a run folder"], _file
    ),
    ToolRow(
        "prepare-data-empty-stdin",
        "prepare_data",
        ["--input", "-", "--out", "{root}/data"],
        1,
        ["prepare_data: error: standard input is empty (0 bytes)"],
        stdin=b"",
    ),
    ToolRow(
        "prepare-data-empty-stdin-jsonl",
        "prepare_data",
        ["--input", "-", "--stdin_jsonl", "--out", "{root}/data"],
        1,
        ["standard input is empty (0 bytes)"],
        stdin=b"",
    ),
]


@pytest.mark.parametrize("row", TOOL_ROWS, ids=[r.id for r in TOOL_ROWS])
def test_hostile_tool_input(row, tmp_path, in_process, capsys, monkeypatch):
    if row.make is not None:
        row.make(tmp_path)
    if row.stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(row.stdin)))
    before = snapshot(tmp_path)
    code, _, lines = _script_main(row.script, [a.replace("{root}", str(tmp_path)) for a in row.args], capsys)
    assert code == row.code and len(lines) == 1, lines
    for needle in row.needles:
        assert needle.replace("{root}", str(tmp_path)) in lines[0], (needle, lines[0])
    assert snapshot(tmp_path) == before


def test_export_of_a_truncated_checkpoint_file(tmp_path, in_process, capsys):
    dump = tmp_path / "run"
    assert _train(CKPT + ["--training.steps", "1"], dump, capsys)[0] == 0
    step = dump / "checkpoint" / "step-1"
    _cut_data(step)
    before = snapshot(step)
    code, out, lines = _script_main(
        "export_safetensors", ["--checkpoint", str(step), "--out", str(tmp_path / "ex")], capsys
    )
    assert code == 1 and len(lines) == 1 and str(step / "__0_0.distcp") in lines[0], lines
    assert "truncated" in lines[0] and "use another step" in lines[0]
    assert not (tmp_path / "ex").exists() and snapshot(step) == before


@pytest.fixture
def export_dir(tmp_path):
    """An export of a freshly initialised one-layer dense model (no training needed)."""
    from spider_titan import registry
    from spider_titan.checkpoint.export import full_model_state_dict, write_export
    from spider_titan.checkpoint.layout import ModelIdentity
    from spider_titan.components.builder import materialize

    spec = registry.get("model", "dense")
    args = spec.build_args("debug", {"n_layers": 1})
    with torch.device("meta"):
        model = spec.model_cls(args)
    materialize(model, torch.device("cpu"), seed=0)
    out = tmp_path / "export"
    write_export(full_model_state_dict(model), ModelIdentity.of("dense", "debug", args), out, dtype=torch.float32)
    return out


def _edit_config(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(export: Path) -> None:
        config = json.loads((export / "config.json").read_text())
        edit(config)
        (export / "config.json").write_text(json.dumps(config))

    return apply


def _edit_tensors(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(export: Path) -> None:
        import safetensors.torch

        tensors = safetensors.torch.load_file(export / "model.safetensors")
        edit(tensors)
        safetensors.torch.save_file(tensors, export / "model.safetensors")

    return apply


def _cut(name: str, size: int) -> Callable[[Path], None]:
    def apply(export: Path) -> None:
        with open(export / name, "r+b") as f:
            f.truncate(size)

    return apply


WK = "layers.0.attention.wk.weight"
GENERATE_ROWS = [
    # (id, flags, edit of the export, needles in the one line; {export} filled in)
    ("temperature-nan", ["--temperature", "nan"], None, ["--temperature nan", ">= 0"]),
    ("temperature-negative", ["--temperature", "-1"], None, ["--temperature -1.0", ">= 0"]),
    ("temperature-inf", ["--temperature", "inf"], None, ["--temperature inf", "finite"]),
    ("top-k-negative", ["--top_k", "-3"], None, ["--top_k -3", "0 (all) to 257"]),
    ("top-k-too-large", ["--top_k", "1000"], None, ["--top_k 1000", "0 (all) to 257"]),
    ("max-new-bytes-negative", ["--max_new_bytes", "-1"], None, ["--max_new_bytes -1"]),
    ("not-a-device", ["--device", "gpu0"], None, ["--device 'gpu0'", "cpu or cuda"]),
    (
        "prompt-file-missing",
        ["--prompt_file", "{export}/no-such-prompt.txt"],
        None,
        ["--prompt_file {export}/no-such-prompt.txt", "No such file"],
    ),
    (
        "config-bad-json",
        [],
        lambda e: (e / "config.json").write_text('{"model": '),
        ["{export}/config.json", "not valid JSON"],
    ),
    (
        "config-not-utf8",
        [],
        lambda e: (e / "config.json").write_bytes(b"\xff\xfe{}"),
        ["{export}/config.json", "not valid JSON"],
    ),
    (
        "config-not-an-object",
        [],
        lambda e: (e / "config.json").write_text("[1, 2]"),
        ["{export}/config.json", "not a JSON object"],
    ),
    ("config-no-model", [], _edit_config(lambda c: c.pop("model")), ["{export}/config.json", "'model' must hold"]),
    (
        "config-missing-arg",
        [],
        _edit_config(lambda c: c["model"]["args"].pop("dim")),
        ["{export}/config.json", "missing 'dim'"],
    ),
    (
        "config-unknown-arg",
        [],
        _edit_config(lambda c: c["model"]["args"].update(dimm=3)),
        ["{export}/config.json", "unknown 'dimm'"],
    ),
    (
        "config-wrong-type",
        [],
        _edit_config(lambda c: c["model"]["args"].update(n_layers="1")),
        ["{export}/config.json", "'n_layers' is '1', expected a int"],
    ),
    (
        "config-bad-value",
        [],
        _edit_config(lambda c: c["model"]["args"].update(n_heads=0)),
        ["{export}/config.json", "build no 'dense' model"],
    ),
    (
        "config-unknown-flavor",
        [],
        _edit_config(lambda c: c["model"].update(flavor="huge")),
        ["{export}/config.json", "'huge' is not a flavor of 'dense'"],
    ),
    (
        "config-unknown-model",
        [],
        _edit_config(lambda c: c["model"].update(name="gpt")),
        ["{export}/config.json", "unknown model 'gpt'"],
    ),
    ("config-deleted", [], lambda e: (e / "config.json").unlink(), ["{export}", "no config.json"]),
    ("weights-truncated", [], _cut("model.safetensors", 5000), ["{export}/model.safetensors", "unreadable"]),
    ("weights-header-cut", [], _cut("model.safetensors", 3), ["{export}/model.safetensors", "unreadable"]),
    ("weights-deleted", [], lambda e: (e / "model.safetensors").unlink(), ["{export}", "model.safetensors"]),
    ("tensor-removed", [], _edit_tensors(lambda t: t.pop(WK)), ["{export}/model.safetensors", WK, "missing"]),
    (
        "tensor-reshaped",
        [],
        _edit_tensors(lambda t: t.update({WK: t[WK][:1]})),
        ["{export}/model.safetensors", WK, "has shape"],
    ),
    (
        "tensor-nan",
        [],
        _edit_tensors(lambda t: t[WK].view(-1).__setitem__(0, float("nan"))),
        ["{export}/model.safetensors", WK, "NaN or inf"],
    ),
]


@pytest.mark.parametrize("row", GENERATE_ROWS, ids=[r[0] for r in GENERATE_ROWS])
def test_generate_hostile_input(row, export_dir, in_process, capsys):
    _, flags, edit, needles = row
    if edit is not None:
        edit(export_dir)
    before = snapshot(export_dir)
    fill = [f.replace("{export}", str(export_dir)) for f in flags]
    code, out, lines = _script_main(
        "generate", ["--model", str(export_dir), "--max_new_bytes", "3", "--device", "cpu", *fill], capsys
    )
    assert code == 1 and len(lines) == 1 and out == "", (lines, out)
    for needle in needles:
        assert needle.replace("{export}", str(export_dir)) in lines[0], (needle, lines[0])
    assert snapshot(export_dir) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_generate_on_cuda_without_cuda(export_dir, in_process, capsys):
    code, _, lines = _script_main("generate", ["--model", str(export_dir), "--device", "cuda"], capsys)
    assert code == 1 and len(lines) == 1 and "--device cuda: CUDA is not available" in lines[0], lines
    assert "--device cpu" in lines[0]


@pytest.mark.slow
def test_generate_takes_any_prompt_bytes(export_dir, tmp_path, in_process, capsys, monkeypatch):
    """A non-UTF-8 argument as the OS passes it (a real process), and the same bytes from a file or
    stdin (in this process), give the same greedy sample; invalid UTF-8 shows as U+FFFD."""
    prompt = b"caf\xe9 \xffx"
    flags = ["--model", str(export_dir), "--max_new_bytes", "6", "--temperature", "0", "--device", "cpu"]
    by_arg = subprocess.run(
        [sys.executable, "scripts/generate.py", *flags, "--prompt", prompt],
        cwd=REPO,
        capture_output=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert by_arg.returncode == 0 and by_arg.stderr == b"", by_arg.stderr
    shown = by_arg.stdout.decode("utf-8")
    assert shown.startswith("caf\ufffd \ufffdx")
    (tmp_path / "prompt.bin").write_bytes(prompt)
    assert _script_main("generate", flags + ["--prompt_file", str(tmp_path / "prompt.bin")], capsys)[:2] == (0, shown)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(prompt)))
    assert _script_main("generate", flags + ["--prompt_file", "-"], capsys)[:2] == (0, shown)


@pytest.mark.slow
def test_disk_full_on_a_real_tmpfs(tmp_path, in_process, capsys):
    """The real thing where a mount is allowed (root with CAP_SYS_ADMIN): a 5 MB tmpfs holds the first
    3.2 MB checkpoint but not the second; torch reports "unexpected pos", the run names ENOSPC."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        dense = [
            "--job.config_file",
            "train_configs/debug_dense.toml",
            "--model.n_layers",
            "1",
            "--model.byte_ngram_orders",  # the n-gram tables alone would overflow the 5 MB disk
            "[]",
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "1",
            "--validation.enable",
            "false",
            "--metrics.enable_tensorboard",
            "false",
            "--checkpoint.export_at_end",
            "false",
        ]
        with torch.random.fork_rng():
            code = main(dense + CKPT + ["--training.steps", "3", "--job.dump_folder", str(disk / "run")])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith("error: checkpoint step 2 not saved") and "(ENOSPC" in lines[0], lines
        assert sorted(p.name for p in (disk / "run" / "checkpoint").iterdir()) == ["step-1"]
        assert finite_checkpoint(disk / "run" / "checkpoint" / "step-1")
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_metrics_onto_a_full_tmpfs(tmp_path, in_process, capsys):
    """metrics.jsonl fills a real disk mid-run (a 1 MB tmpfs with five pages left for the run's files):
    one line naming the file and ENOSPC, exit 1, no traceback, and every row in the file whole. It was
    ``error: None: ...`` and one or two tracebacks (the buffered row failed again at close), with the
    last row torn where the disk ran out."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        st = os.statvfs(disk)
        with open(disk / "filler", "wb") as f:
            f.write(b"\0" * (st.f_bavail * st.f_frsize - 5 * 4096))
        dump = disk / "run"
        code, _, lines = _train(MOCK + ["--training.steps", "60"], dump, capsys)
        metrics = dump / "metrics.jsonl"
        assert code == 1 and len(lines) == 1, lines
        assert (
            lines[0].startswith("error: metrics of step ")
            and f"{metrics}: no space left on device (ENOSPC)" in lines[0]
        )
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]  # every row whole
        assert (
            rows and metrics.read_bytes().endswith(b"\n") and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
        )
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # lazy: a file a failed run left open keeps it busy


def test_export_to_a_full_disk(tmp_path, in_process, capsys, monkeypatch):
    import safetensors.torch

    dump = tmp_path / "run"
    assert _train(CKPT + ["--training.steps", "1"], dump, capsys)[0] == 0
    before = snapshot(dump)

    def full_disk(*args, **kwargs):  # safetensors' own words for a full disk: not an OSError
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    out = tmp_path / "ex"
    code, _, lines = _script_main(
        "export_safetensors", ["--checkpoint", str(dump / "checkpoint"), "--out", str(out)], capsys
    )
    assert code == 1 and len(lines) == 1, lines
    assert f"{out}: no space left on device (ENOSPC)" in lines[0] and "--out" in lines[0], lines
    assert not out.exists() and snapshot(dump) == before


# ---------------------------------------------------------------- prepare_data


def _prepare_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_data_script", REPO / "scripts" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _docs_gz(path: Path, cut: bool = False) -> None:
    import gzip
    import json

    whole = gzip.compress(b"".join(json.dumps({"text": f"document {i} " * 30}).encode() + b"\n" for i in range(2000)))
    path.write_bytes(whole[: len(whole) * 3 // 4] if cut else whole)


class _FullDisk:
    """A shard file whose writes fail with ``err`` once ``left[0]`` bytes (shared by all the files) are
    written: the disk fills up (or turns read-only) after a few whole shards."""

    def __init__(self, f, err: int, left: list[int]):
        self.f, self.err, self.left = f, err, left

    def write(self, data) -> int:
        self.left[0] -= len(memoryview(data).cast("B"))
        if self.left[0] < 0:
            raise OSError(self.err, os.strerror(self.err))
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


PREPARE_ROWS = [  # (id, how the inputs are made, arguments, what the one line holds, errno injected at the writer)
    (
        "truncated-jsonl-gz",
        lambda d: _docs_gz(d / "in.jsonl.gz", cut=True),
        ["--input", "{in}/in.jsonl.gz"],
        ["{in}/in.jsonl.gz: ", "truncated", "gzip -t"],
        None,
    ),
    (
        "not-gzip",
        lambda d: (d / "in.jsonl.gz").write_text('{"text": "plain"}\n'),
        ["--input", "{in}/in.jsonl.gz"],
        ["{in}/in.jsonl.gz: is not valid .gz data", "gzip -t"],
        None,
    ),
    (
        "out-is-a-file",
        lambda d: (_docs_gz(d / "in.jsonl.gz"), (d / "out").write_text("mine")),
        ["--input", "{in}/in.jsonl.gz"],
        ["--out {in}/out is a file"],
        None,
    ),
    (
        "out-disk-full",
        lambda d: _docs_gz(d / "in.jsonl.gz"),
        ["--input", "{in}/in.jsonl.gz"],
        ["--out {in}/out: cannot write the shards (disk full", "free some space"],
        errno.ENOSPC,
    ),
    (
        "out-read-only",
        lambda d: _docs_gz(d / "in.jsonl.gz"),
        ["--input", "{in}/in.jsonl.gz"],
        ["--out {in}/out: cannot write the shards (read-only file system", "choose an --out folder"],
        errno.EROFS,
    ),
]


@pytest.mark.parametrize("row", PREPARE_ROWS, ids=[r[0] for r in PREPARE_ROWS])
def test_prepare_data_hostile_input(row, tmp_path, capsys, monkeypatch):
    """Each ends in exit 1 and one line naming the input (or --out) and the fix; no shard, partial
    shard or folder is left behind and the inputs are untouched."""
    from spider_titan.data import shards

    _, make, args, needles, err = row
    make(tmp_path)
    before = snapshot(tmp_path)
    if err is not None:
        left = [30_000]
        monkeypatch.setattr(shards, "open", lambda *a, **k: _FullDisk(open(*a, **k), err, left), raising=False)
    argv = [a.replace("{in}", str(tmp_path)) for a in args] + ["--out", str(tmp_path / "out"), "--shard_tokens", "4096"]
    with pytest.raises(SystemExit) as info:
        _prepare_script().main(argv)
    message = str(info.value.code)  # what Python prints on stderr for sys.exit(message)
    assert info.value.code not in (0, None) and capsys.readouterr().err == ""
    assert "\n" not in message and "Traceback" not in message, message
    for needle in needles:
        assert needle.replace("{in}", str(tmp_path)) in message, (needle, message)
    assert snapshot(tmp_path) == before
