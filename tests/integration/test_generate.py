"""scripts/generate.py end to end on an export of a freshly initialised model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from spider_titan import registry
from spider_titan.checkpoint.export import full_model_state_dict, write_export
from spider_titan.checkpoint.layout import ModelIdentity
from spider_titan.components.builder import materialize
from spider_titan.generation import Conversation, generate, load_model
from tests.utils import REPO


def run_generate(flags: list[str]) -> subprocess.CompletedProcess:
    """``python scripts/generate.py FLAGS`` from the repository, one intra-op thread, output captured."""
    return subprocess.run(
        [sys.executable, "scripts/generate.py", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.slow
def test_generate_cli_matches_the_library(tmp_path):
    spec = registry.get("model", "dense")
    args = spec.build_args("debug", {"n_layers": 1})
    with torch.device("meta"):
        model = spec.model_cls(args)
    materialize(model, torch.device("cpu"), seed=0)
    write_export(full_model_state_dict(model), ModelIdentity.of("dense", "debug", args), tmp_path, dtype=torch.float32)

    proc = run_generate(
        [
            "--model",
            str(tmp_path),
            "--prompt",
            "hello",
            "--max_new_bytes",
            "12",
            "--temperature",
            "0.7",
            "--top_k",
            "20",
            "--seed",
            "1",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    loaded, _ = load_model(tmp_path)
    expected = generate(loaded, b"hello", max_new_bytes=12, temperature=0.7, top_k=20, seed=1)
    assert proc.stdout == "hello" + expected.decode("utf-8", errors="replace") + "\n"


@pytest.mark.slow
def test_generate_straight_from_a_runs_checkpoint_equals_its_export(tmp_path):
    """No export step needed: a run folder, its checkpoint folder and a step folder load the newest
    (or that) checkpoint's weights, and sample what the run's own fp32 export samples. The end-of-run
    calibration comes before the last save and the export: both hold the gains it logged, the
    checkpoint before it the initial ones."""
    from tests.utils import check_ok, read_metrics, run_train, tiny_run

    run = tmp_path / "run"
    check_ok(
        run_train(
            tiny_run(
                training__steps=4,
                training__local_batch_size=None,  # the config's 8
                metrics__log_freq=None,
                checkpoint__enable=True,
                checkpoint__interval=2,
                checkpoint__export_at_end=True,
                job__dump_folder=run,
            )
        )
    )
    exported, _ = load_model(run / "export")
    want = generate(exported, b"ab", max_new_bytes=16, temperature=0.9, seed=3)
    for folder in (run, run / "checkpoint", run / "checkpoint" / "step-4"):
        model, config = load_model(folder)
        assert config["step"] == 4 and config["model"]["name"] == "spider"
        assert generate(model, b"ab", max_new_bytes=16, temperature=0.9, seed=3) == want
    older, config = load_model(run / "checkpoint" / "step-2")
    assert config["step"] == 2
    ids = torch.tensor([[257, *b"abcdef"]])
    assert not torch.equal(older(ids).logits, exported(ids).logits)  # step 2 really is another model
    (logged,) = [row for row in read_metrics(run) if "calib_gain_bpb" in row]
    gains = exported.core.extra_loop_gain.tolist()
    assert logged["step"] == 4 and gains[2:] == [logged["loop_gain_3"], logged["loop_gain_4"]]
    assert load_model(run / "checkpoint" / "step-4")[0].core.extra_loop_gain.tolist() == gains
    assert older.core.extra_loop_gain.tolist() == [1.0] * 4


@pytest.mark.slow
def test_loops_with_calibrated_gain_0_are_skipped_with_one_line(tmp_path, monkeypatch):
    """``--n_loops 4`` on a Spider trained at 2 whose calibration set loops 3 and 4 to gain 0: one
    line says they are skipped, and the bytes are those of all 4 loops run (the library with
    effective_loops patched to run what is asked)."""
    from spider_titan import generation

    spec = registry.get("model", "spider")
    args = spec.build_args("debug", {"n_loops": 2})
    model = spec.build_on_meta(args)
    materialize(model, torch.device("cpu"), seed=0)
    model.core.extra_loop_gain[2:] = 0.0
    write_export(full_model_state_dict(model), ModelIdentity.of("spider", "debug", args), tmp_path, dtype=torch.float32)

    flags = ["--model", str(tmp_path), "--prompt", "def ", "--max_new_bytes", "24", "--temperature", "0"]
    proc = run_generate([*flags, "--n_loops", "4"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == (
        "generate: --n_loops 4: loops 3-4 have calibrated gain 0 (they leave the output unchanged); running 2 loops"
    )
    assert lines[1].endswith("n_loops 4 (trained 2, 2 run))") and len(lines) == 2
    loaded, _ = load_model(tmp_path)
    monkeypatch.setattr(generation, "effective_loops", lambda m, n: n)
    every_loop = generate(loaded, b"def ", max_new_bytes=24, temperature=0, n_loops=4)
    assert proc.stdout == "def " + every_loop.decode("utf-8", errors="replace") + "\n"


def test_interactive_session_streams_turns_and_shows_bytes_safely(tmp_path, monkeypatch, capsys):
    """scripts/generate.py --interactive: each line is a turn, an empty line continues, /reset
    starts anew (the same greedy bytes again), and after each turn stderr shows bytes/s and loops;
    invalid UTF-8 and control bytes reach the terminal as U+FFFD and escapes."""
    import importlib.util
    import io
    import types

    spec = registry.get("model", "spider")
    args = spec.build_args("debug", {})
    with torch.device("meta"):
        model = spec.model_cls(args)
    materialize(model, torch.device("cpu"), seed=0)
    write_export(full_model_state_dict(model), ModelIdentity.of("spider", "debug", args), tmp_path, dtype=torch.float32)
    loader = importlib.util.spec_from_file_location("generate_cli", REPO / "scripts" / "generate.py")
    cli = importlib.util.module_from_spec(loader)
    loader.spec = None
    loader.loader.exec_module(cli)

    stdin = types.SimpleNamespace(buffer=io.BytesIO(b"Once upon\n\n/reset\nOnce upon\n"))
    monkeypatch.setattr(sys, "stdin", stdin)
    cli.main(
        ["--model", str(tmp_path), "--interactive", "--temperature", "0", "--max_new_bytes", "12", "--device", "cpu"]
    )
    out, err = capsys.readouterr()
    turns = [line for line in err.splitlines() if "bytes/s (cached, n_loops" in line]
    assert len(turns) == 3 and "a new document" in err, err
    reply = Conversation(load_model(tmp_path)[0], temperature=0)
    first, second = bytes(reply.turn(b"Once upon", 12)), bytes(reply.turn(b"", 12))
    shown = io.StringIO()
    cli.TerminalText(shown).write(first + second + first, final=True)
    assert out == shown.getvalue()

    shown = io.StringIO()
    text = cli.TerminalText(shown)
    for piece in (b"caf\xc3", b"\xa9 \xff\x1b[2J\n"):
        text.write(piece)
    assert shown.getvalue() == "caf\u00e9 \ufffd\\x1b[2J\n"
