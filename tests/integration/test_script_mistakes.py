"""The product scripts' ordinary mistakes, as a table: each is refused before any work, in one line on
stderr, with exit status 1 or 2, no traceback, and nothing under the test's folder changed.

Every row runs the script's ``main(argv)`` in this process on files made once for the module (no
training: the debug models built, initialised and exported, a DCP checkpoint of one, a run's
metrics, a small corpus). The tests at the end run ``scripts/generate.py`` as a program, for what
only a real process shows: a closed or full stdout and Ctrl-C.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.utils import REPO

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _export_and_checkpoint(root: Path, name: str, overrides: dict) -> None:
    """``root/<name>``: an export of the freshly initialised debug model; ``root/<name>_ckpt/step-1``: a
    model-only DCP checkpoint of the same weights, with the meta.json the trainer writes."""
    import torch.distributed.checkpoint as dcp

    from spider_titan import registry
    from spider_titan.checkpoint.export import full_model_state_dict, write_export
    from spider_titan.checkpoint.layout import FORMAT_VERSION, ModelIdentity
    from spider_titan.components.builder import materialize

    spec = registry.get("model", name)
    args = spec.build_args("debug", overrides)
    with torch.device("meta"):
        model = spec.model_cls(args)
    materialize(model, torch.device("cpu"), seed=0)
    identity = ModelIdentity.of(name, "debug", args)
    state = full_model_state_dict(model)
    write_export(state, identity, root / name, dtype=torch.float32)
    step = root / f"{name}_ckpt" / "step-1"
    with warnings.catch_warnings():  # saving in one process is the intent
        warnings.simplefilter("ignore")
        dcp.save({f"model.{k}": v for k, v in state.items()}, checkpoint_id=str(step), no_dist=True)
    meta = {"format_version": FORMAT_VERSION, "step": 1, "model_only": True, "contents": ["model"]}
    (step / "meta.json").write_text(json.dumps({**meta, "model": identity.to_json()}))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Everything the rows read, made once: exports, checkpoints, a quantized export and its copy
    without the quantization block, a checkpoint whose meta.json names a deeper model, a run's
    metrics, a corpus and a plain file."""
    from spider_titan.checkpoint.export import export_checkpoint

    root = tmp_path_factory.mktemp("mistakes")
    _export_and_checkpoint(root, "dense", {"n_layers": 1})
    _export_and_checkpoint(root, "spider", {})
    export_checkpoint(root / "spider", root / "spider_int8", dtype=torch.bfloat16, quantize="int8")
    shutil.copytree(root / "spider_int8", root / "spider_int8_unmarked")
    config = json.loads((root / "spider_int8_unmarked" / "config.json").read_text())
    del config["quantization"]
    (root / "spider_int8_unmarked" / "config.json").write_text(json.dumps(config))
    shutil.copytree(root / "dense_ckpt", root / "dense_ckpt_edited")
    meta_file = root / "dense_ckpt_edited" / "step-1" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["model"]["args"]["n_layers"] = 2  # the tensors are a one-layer model's
    meta_file.write_text(json.dumps(meta))
    (root / "run").mkdir()
    (root / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    (root / "empty_run").mkdir()
    (root / "empty_run" / "metrics.jsonl").write_text("")
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("def f(x):\n    return x + 1\n")
    (root / "blank.txt").write_text("")
    (root / "notes.txt").write_text("a file, not a folder\n")
    (root / "shards" / "train").mkdir(parents=True)
    (root / "shards" / "train" / "data_000000.bin").write_bytes(b"\0" * 64)
    (root / "other").mkdir()
    (root / "other" / "mine.txt").write_text("not an export\n")
    return root


@dataclass
class Mistake:
    id: str
    script: str
    args: list[str]  # {root} is the module's folder
    needles: list[str]  # all in the one stderr line
    code: int = 1
    cuda: bool = True  # False: run as on a machine without CUDA
    extra: dict = field(default_factory=dict)


G = ["--device", "cpu", "--max_new_bytes", "4"]
MISTAKES = [
    # ---------------------------------------------------------------- generate
    Mistake(
        "generate-missing-model", "generate", ["--model", "{root}/nope", *G], ["--model {root}/nope does not exist"]
    ),
    Mistake("generate-model-is-a-file", "generate", ["--model", "{root}/notes.txt", *G], ["no config.json"]),
    Mistake(
        "generate-dense-has-no-loops", "generate", ["--model", "{root}/dense", "--n_loops", "2", *G], ["no core loops"]
    ),
    Mistake(
        "generate-zero-loops",
        "generate",
        ["--model", "{root}/spider", "--n_loops", "0", *G],
        ["--n_loops 0: must be >= 1"],
    ),
    Mistake(
        "generate-negative-bytes",
        "generate",
        ["--model", "{root}/dense", "--device", "cpu", "--max_new_bytes", "-1"],
        ["--max_new_bytes -1: must be >= 0"],
    ),
    Mistake("generate-top-k", "generate", ["--model", "{root}/dense", "--top_k", "300", *G], ["--top_k 300"]),
    Mistake(
        "generate-ttt-interactive",
        "generate",
        ["--model", "{root}/dense", "--ttt", "--interactive", *G],
        ["does not combine with --interactive"],
    ),
    Mistake("generate-temperature", "generate", ["--model", "{root}/dense", "--temperature", "-1", *G], ["finite"]),
    Mistake(
        "generate-no-cuda",
        "generate",
        ["--model", "{root}/dense", "--device", "cuda"],
        ["--device cuda: CUDA is not available here", "--device cpu"],
        cuda=False,
    ),
    Mistake(
        "generate-missing-prompt-file",
        "generate",
        ["--model", "{root}/dense", "--prompt_file", "{root}/nope.txt", *G],
        ["--prompt_file {root}/nope.txt: No such file"],
    ),
    Mistake(
        "generate-quantization-block-lost",
        "generate",
        ["--model", "{root}/spider_int8_unmarked", *G],
        ["{root}/spider_int8_unmarked/config.json: no 'quantization' block", "holds quantized weights"],
    ),
    Mistake(
        "generate-not-a-number", "generate", ["--model", "{root}/dense", "--max_new_bytes", "many"], ["invalid int"], 2
    ),
    # ---------------------------------------------------------------- export_safetensors
    Mistake(
        "export-missing-checkpoint",
        "export_safetensors",
        ["--checkpoint", "{root}/nope", "--out", "{root}/out"],
        ["{root}/nope does not exist"],
    ),
    Mistake(
        "export-no-checkpoint-in-folder",
        "export_safetensors",
        ["--checkpoint", "{root}/run", "--out", "{root}/out"],
        ["no complete checkpoint", "{root}/run"],
    ),
    Mistake(
        "export-zero-shard-size",
        "export_safetensors",
        ["--checkpoint", "{root}/dense_ckpt", "--out", "{root}/out", "--max_shard_size", "0"],
        ["--max_shard_size 0: must be >= 1"],
    ),
    Mistake(
        "export-negative-shard-size",
        "export_safetensors",
        ["--checkpoint", "{root}/dense_ckpt", "--out", "{root}/out", "--max_shard_size", "-5"],
        ["--max_shard_size -5: must be >= 1"],
    ),
    Mistake(
        "export-out-is-the-checkpoint-folder",
        "export_safetensors",
        ["--checkpoint", "{root}/dense_ckpt", "--out", "{root}/dense_ckpt"],
        ["is the checkpoint folder"],
    ),
    Mistake(
        "export-out-is-its-own-input",
        "export_safetensors",
        ["--checkpoint", "{root}/dense", "--out", "{root}/dense"],
        ["is or lies inside the export being read"],
    ),
    Mistake(
        "export-out-under-a-file",
        "export_safetensors",
        ["--checkpoint", "{root}/dense_ckpt", "--out", "{root}/notes.txt/export"],
        ["--out {root}/notes.txt/export: {root}/notes.txt is a file, not a folder"],
    ),
    Mistake(
        "export-out-holds-other-files",
        "export_safetensors",
        ["--checkpoint", "{root}/dense_ckpt", "--out", "{root}/other"],
        ["{root}/other holds", "not an export of spider_titan"],
    ),
    Mistake(
        "export-unknown-quantization",
        "export_safetensors",
        ["--checkpoint", "{root}/dense_ckpt", "--out", "{root}/out", "--quantize", "int3"],
        ["--quantize 'int3'"],
    ),
    Mistake(
        "export-dense-has-no-quantized-export",
        "export_safetensors",
        ["--checkpoint", "{root}/dense_ckpt", "--out", "{root}/out", "--quantize", "int8"],
        ["the 'dense' model has no quantized export"],
    ),
    Mistake(
        "export-meta-contradicts-tensors",
        "export_safetensors",
        ["--checkpoint", "{root}/dense_ckpt_edited", "--out", "{root}/out"],
        ["{root}/dense_ckpt_edited/step-1/meta.json: ", "does not hold this checkpoint's tensors", "layers.1."],
    ),
    Mistake(
        "export-quantization-block-lost",
        "export_safetensors",
        ["--checkpoint", "{root}/spider_int8_unmarked", "--out", "{root}/out", "--dtype", "float32"],
        ["no 'quantization' block"],
    ),
    Mistake(
        "export-bad-dtype",
        "export_safetensors",
        ["--checkpoint", "{root}/dense_ckpt", "--out", "{root}/out", "--dtype", "int8"],
        ["invalid choice"],
        2,
    ),
    # ---------------------------------------------------------------- prepare_data
    Mistake(
        "prepare-missing-input",
        "prepare_data",
        ["--input", "{root}/nope", "--out", "{root}/data"],
        ["input {root}/nope does not exist"],
    ),
    Mistake(
        "prepare-zero-shard-tokens",
        "prepare_data",
        ["--input", "{root}/corpus", "--out", "{root}/data", "--shard_tokens", "0"],
        ["shard_tokens=0 must be >= 1"],
    ),
    Mistake(
        "prepare-negative-shard-tokens",
        "prepare_data",
        ["--input", "{root}/corpus", "--out", "{root}/data", "--shard_tokens", "-3"],
        ["shard_tokens=-3 must be >= 1"],
    ),
    Mistake(
        "prepare-zero-workers",
        "prepare_data",
        ["--input", "{root}/corpus", "--out", "{root}/data", "--workers", "0"],
        ["workers=0 must be >= 1"],
    ),
    Mistake(
        "prepare-val-fraction",
        "prepare_data",
        ["--input", "{root}/corpus", "--out", "{root}/data", "--val_fraction", "1"],
        ["val_fraction=1.0 must be in [0, 1)"],
    ),
    Mistake(
        "prepare-negative-progress",
        "prepare_data",
        ["--input", "{root}/corpus", "--out", "{root}/data", "--progress_s", "-1"],
        ["--progress_s -1.0: must be >= 0"],
    ),
    Mistake(
        "prepare-out-is-the-input",
        "prepare_data",
        ["--input", "{root}/corpus", "--out", "{root}/corpus"],
        ["--out {root}/corpus is the input {root}/corpus"],
    ),
    Mistake(
        "prepare-out-inside-the-input",
        "prepare_data",
        ["--input", "{root}/corpus", "--out", "{root}/corpus/shards"],
        ["--out {root}/corpus/shards lies inside the input {root}/corpus"],
    ),
    Mistake(
        "prepare-out-is-the-input-file",
        "prepare_data",
        ["--input", "{root}/notes.txt", "--out", "{root}/notes.txt"],
        ["--out {root}/notes.txt is the input"],
    ),
    Mistake(
        "prepare-out-under-a-file",
        "prepare_data",
        ["--input", "{root}/corpus", "--out", "{root}/notes.txt/data"],
        ["--out {root}/notes.txt/data: {root}/notes.txt is a file, not a folder"],
    ),
    Mistake(
        "prepare-out-holds-shards",
        "prepare_data",
        ["--input", "{root}/corpus", "--out", "{root}/shards"],
        ["{root}/shards/train already holds shards"],
    ),
    Mistake(
        "prepare-no-text", "prepare_data", ["--input", "{root}/blank.txt", "--out", "{root}/data"], ["hold no text"]
    ),
    # ---------------------------------------------------------------- plot
    Mistake("plot-missing-run", "plot", ["{root}/nope"], ["run folder {root}/nope does not exist"], 2),
    Mistake("plot-run-is-a-file", "plot", ["{root}/notes.txt"], ["{root}/notes.txt is a file, not a run folder"], 2),
    Mistake("plot-no-rows", "plot", ["{root}/empty_run"], ["holds no logged step yet"], 2),
    Mistake("plot-out-not-a-picture", "plot", ["{root}/run", "--out", "{root}/x.txt"], ["not a picture format"], 2),
    Mistake("plot-out-is-a-folder", "plot", ["{root}/run", "--out", "{root}/corpus"], ["is a folder"], 2),
    Mistake(
        "plot-out-under-a-file",
        "plot",
        ["{root}/run", "--out", "{root}/notes.txt/x.png"],
        ["--out {root}/notes.txt/x.png: {root}/notes.txt is a file, not a folder"],
        2,
    ),
    Mistake("plot-x-absent", "plot", ["{root}/run", "--out", "{root}/x.png", "--x", "flops"], ["'train_flops'"], 2),
    Mistake("plot-unknown-x", "plot", ["{root}/run", "--x", "bytes"], ["argument --x: invalid choice"], 2),
]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"mistakes_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_every_script_has_five_mistakes_or_more():
    scripts = [m.script for m in MISTAKES]
    assert {s: scripts.count(s) for s in set(scripts)} == {
        s: max(5, scripts.count(s)) for s in ("generate", "export_safetensors", "prepare_data", "plot")
    }


@pytest.mark.parametrize("m", MISTAKES, ids=[m.id for m in MISTAKES])
def test_a_mistake_is_one_line_before_any_work(m, files, capsys, monkeypatch):
    if not m.cuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before, names = snapshot(files), set(files.iterdir())
    module = _script(m.script)
    code = 0
    try:
        module.main([a.replace("{root}", str(files)) for a in m.args])
    except SystemExit as e:
        code = e.code or 0
    finally:  # what a row wrongly wrote must not fail the rows after it
        written = sorted(set(files.iterdir()) - names)
        for path in written:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    out, err = capsys.readouterr()
    if isinstance(code, str):  # sys.exit("message"): the interpreter prints it, exit 1
        code, err = 1, err + code + "\n"
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == m.code and len(lines) == 1 and "Traceback" not in err, (code, err)
    for needle in m.needles:
        assert needle.replace("{root}", str(files)) in lines[0], (needle, lines[0])
    assert written == [] and snapshot(files) == before  # nothing written, nothing replaced


# ---------------------------------------------------------------- generate as a program


def _generate(files: Path, *args: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "scripts/generate.py", "--model", str(files / "dense"), "--device", "cpu", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stderr=subprocess.PIPE, **popen)


@pytest.mark.slow  # starts a process
def test_a_closed_pipe_ends_generate_quietly(files, tmp_path):
    """``generate.py ... | head -c 5``: the reader goes after 5 bytes of a 200 kB output; the script ends
    with 141 (128 + SIGPIPE, as a shell shows it) and nothing on stderr (it was a BrokenPipeError traceback)."""
    (tmp_path / "prompt.txt").write_bytes(b"a" * 200_000)  # more than a pipe holds
    proc = _generate(
        files, "--prompt_file", str(tmp_path / "prompt.txt"), "--max_new_bytes", "1", stdout=subprocess.PIPE
    )
    head = proc.stdout.read(5)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141) and head == b"aaaaa", err
    assert err == "", err


@pytest.mark.slow  # starts a process
def test_a_full_stdout_is_one_line(files):
    """``generate.py ... > /dev/full``: one line naming standard output and ENOSPC's words, exit 1."""
    with open("/dev/full", "w") as full:
        proc = _generate(files, "--prompt", "x" * 10_000, "--max_new_bytes", "1", stdout=full)
        err = proc.stderr.read().decode()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.wait(timeout=120) == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == "generate: error: standard output: No space left on device; write it to a disk with room"


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("gap_s", [0.05, 0.3])
def test_ctrl_c_twice_in_interactive_exits_130(files, gap_s):
    """Two SIGINTs ``gap_s`` apart during a long turn: exit 130 and no traceback (the second one used to
    land in the interpreter's exit and print one from torch's atexit hooks)."""
    proc = _generate(files, "--interactive", "--max_new_bytes", "100000", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    err = b""
    deadline = time.monotonic() + 120
    while b"Ctrl-D ends" not in err and time.monotonic() < deadline:
        chunk = os.read(proc.stderr.fileno(), 4096)
        if not chunk:
            break
        err += chunk
    proc.stdin.write(b"hello\n")
    proc.stdin.flush()
    # the turn is streaming once its first bytes are out (a fixed wait can outlast the turn: this export,
    # sampling with seed 0, drew its end-of-document byte after 236 bytes on one machine)
    assert os.read(proc.stdout.fileno(), 1), "the turn wrote nothing"
    proc.send_signal(signal.SIGINT)
    time.sleep(gap_s)
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=60)
    err = (err + rest).decode()
    assert proc.returncode == 130 and "Traceback" not in err, err
