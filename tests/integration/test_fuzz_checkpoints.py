"""Seeded fuzz of checkpoint and export files: random bytes written into, truncated or deleted.

One tiny run with two checkpoints and an export is made once; each case copies it, damages one
file of the newest checkpoint (``.metadata``, ``__0_0.distcp``, ``meta.json``) or of the export
(``config.json``, ``model.safetensors``) and runs what a user would run next, in this process:

- checkpoint cases: the same training command one step further (auto-resume), and the export
  script on the damaged step. The resume must either fall back (or load a harmlessly changed
  file) and reach exactly the loss of an undamaged run, with exit 0 and nothing on stderr, or end
  with one line; the export must write or end with one line.
- export cases: ``scripts/generate.py`` on the damaged export: a sample, or one line naming a file.

Every case: no traceback, and the older checkpoint byte-identical.
"""

from __future__ import annotations

import functools
import importlib.util
import random
import shutil
from pathlib import Path

import pytest
import torch

from spider_titan.train import main as train_main
from tests.utils import DEBUG_DENSE, REPO, check_ok, read_metrics, run_train, tiny_run

ARGS = tiny_run(
    job__config_file=REPO / DEBUG_DENSE,
    training__seq_len=32,
    training__local_batch_size=1,
    model__n_layers=1,
    training__deterministic=True,
    checkpoint__enable=True,
    checkpoint__interval=1,
    checkpoint__last_save_model_only=False,
    lr_scheduler__warmup_steps=1,
)
CHECKPOINT_FILES = [".metadata", "__0_0.distcp", "meta.json"]
EXPORT_FILES = ["config.json", "model.safetensors"]
FILES = CHECKPOINT_FILES + EXPORT_FILES
ACTIONS = ["bytes", "truncate", "delete"]
CASES = 60


@functools.cache
def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"fuzz_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, argv: list[str], capsys) -> tuple[int, str, str]:
    """``scripts/<name>.py`` main(argv) in this process: (exit code, stdout, stderr) as a shell sees
    them (``sys.exit("message")`` prints the message to stderr and exits 1)."""
    code = 0
    try:
        _script(name).main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    if isinstance(code, str):
        code, err = 1, err + code + "\n"
    return code, out, err


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 2-step run (checkpoints step-1 and step-2, export of step 2) and the loss at step 3 of the
    same run taken one step further: what any correct resume must reproduce."""
    root = tmp_path_factory.mktemp("fuzz")
    check_ok(
        run_train(
            ARGS
            + ["--training.steps", "2", "--checkpoint.export_at_end", "true", "--job.dump_folder", str(root / "run")]
        )
    )
    shutil.copytree(root / "run", root / "reference")
    shutil.rmtree(root / "reference" / "export")
    check_ok(
        run_train(
            ARGS
            + [
                "--training.steps",
                "3",
                "--checkpoint.export_at_end",
                "false",
                "--job.dump_folder",
                str(root / "reference"),
            ]
        )
    )
    loss3 = [row["loss"] for row in read_metrics(root / "reference") if row.get("step") == 3 and "loss" in row]
    return root / "run", loss3[0]


def damage(file: Path, action: str, rng: random.Random) -> str:
    """Write random bytes into, truncate, or delete ``file`` (where and how much: ``rng``); returns what was done."""
    size = file.stat().st_size
    if action == "delete":
        file.unlink()
    elif action == "truncate":
        cut = rng.randrange(size)
        with open(file, "r+b") as f:
            f.truncate(cut)
        action += f" to {cut}"
    else:
        offset = rng.randrange(size)
        junk = rng.randbytes(rng.randint(1, 64))
        with open(file, "r+b") as f:
            f.seek(offset)
            f.write(junk)
        action += f" {len(junk)} at {offset}"
    return action


def one_line(err: str) -> list[str]:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("case", range(CASES))
def test_fuzzed_file(case, base, tmp_path, in_process, capsys):
    run, loss3 = base
    rng = random.Random(case)
    dump = tmp_path / "run"
    shutil.copytree(run, dump)
    older = snapshot(dump / "checkpoint" / "step-1")
    # every (file, action) pair comes up every 15 cases; where and how much is the seed's choice
    name = FILES[case % len(FILES)]
    action = ACTIONS[case // len(FILES) % len(ACTIONS)]
    target = (dump / "checkpoint" / "step-2" if name in CHECKPOINT_FILES else dump / "export") / name
    what = f"case {case}, {target.name}: {damage(target, action, rng)}"
    damaged = tmp_path / "damaged-step-2"  # the resume may replace step-2: keep the damaged one for the export
    if name in CHECKPOINT_FILES:
        shutil.copytree(dump / "checkpoint" / "step-2", damaged)

    if name in CHECKPOINT_FILES:
        with torch.random.fork_rng():
            code = train_main(
                ARGS + ["--training.steps", "3", "--checkpoint.export_at_end", "false", "--job.dump_folder", str(dump)]
            )
        out, err = capsys.readouterr()
        if code == 0:  # fell back to step-1 (or the change was harmless): the run is exactly the undamaged one
            assert not err.strip(), (what, err)
            loss = [row["loss"] for row in read_metrics(dump) if row.get("step") == 3 and "loss" in row]
            assert loss[-1] == pytest.approx(loss3, abs=1e-6), (what, out[-2000:])
            if f"skipping {dump / 'checkpoint' / 'step-2'}" in out:
                assert f"from {dump / 'checkpoint' / 'step-1'} (step 1)" in out, (what, out[-2000:])
        else:
            assert code == 2 and "step-2" in one_line(err)[0], (what, code, err)
        code, out, err = run_script(
            "export_safetensors", ["--checkpoint", str(damaged), "--out", str(tmp_path / "export")], capsys
        )
        if code == 0:
            assert not err.strip() and "wrote" in out, (what, err)
        else:
            assert str(damaged) in one_line(err)[0], (what, err)
    else:
        code, out, err = run_script(
            "generate",
            ["--model", str(dump / "export"), "--prompt", "def ", "--max_new_bytes", "4", "--device", "cpu"],
            capsys,
        )
        if code == 0:
            assert out.startswith("def ") and not err.strip(), (what, err)
        else:
            assert str(dump / "export") in one_line(err)[0], (what, err)
    assert snapshot(dump / "checkpoint" / "step-1") == older, what
