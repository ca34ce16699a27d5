"""Safetensors exports: readable by safetensors alone, rebuilt into the same model, sharded, bf16,
float8 weights unwrapped; model identity checks; next-byte sampling."""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from spider_titan import registry
from spider_titan.checkpoint.export import (
    INDEX_FILE,
    export_checkpoint,
    full_model_state_dict,
    load_export_tensors,
    read_export,
    read_export_config,
    write_export,
)
from spider_titan.checkpoint.layout import ModelIdentity, compare_identity
from spider_titan.components.builder import materialize
from spider_titan.config.manager import parse_args
from spider_titan.generation import generate, load_model, sample_next
from spider_titan.train import Trainer
from spider_titan.vocab import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
from tests.utils import DEBUG_DENSE, REPO, tiny_run

# Loads the export with safetensors alone and proves that nothing of spider_titan was imported.
LOAD_ALONE = """
import json, sys
from safetensors.torch import load_file
tensors = load_file(sys.argv[1])
assert not [m for m in sys.modules if m.startswith("spider_titan")]
print(json.dumps({k: [list(v.shape), str(v.dtype)] for k, v in tensors.items()}))
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The dense debug model after 3 steps, with its final model-only checkpoint and export."""
    dump = tmp_path_factory.mktemp("trained")
    argv = tiny_run(
        job__config_file=DEBUG_DENSE,
        training__seq_len=32,
        training__steps=3,
        job__dump_folder=dump,
        checkpoint__enable=True,
        checkpoint__export_at_end=True,
    )
    log = logging.getLogger("spider_titan")
    with pytest.MonkeyPatch.context() as mp, torch.random.fork_rng():
        mp.chdir(REPO)
        mp.setattr(log, "handlers", [])  # the trainer's handler must not outlive this fixture
        mp.setattr(log, "level", log.level)
        mp.setattr(log, "propagate", log.propagate)
        trainer = Trainer(parse_args(argv))
        try:
            trainer.train()
        finally:
            trainer.close()
    return trainer.run.model.eval(), dump


@pytest.mark.slow
def test_export_loads_with_safetensors_alone(trained):
    model, dump = trained
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_ALONE, str(dump / "export" / "model.safetensors")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    expected = model.state_dict()
    assert json.loads(proc.stdout) == {k: [list(v.shape), "torch.float32"] for k, v in expected.items()}
    tensors = safetensors.torch.load_file(dump / "export" / "model.safetensors")
    assert all(torch.equal(tensors[k], v) for k, v in expected.items())
    config = read_export_config(dump / "export")
    assert config["model"]["name"] == "dense" and config["model"]["flavor"] == "debug"
    assert config["model"]["args"]["dim"] == 128 and config["vocab"]["size"] == VOCAB_SIZE
    assert config["step"] == 3 and config["dtype"] == "float32"
    # readable by others like config.json beside it (safetensors itself writes 0600)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (dump / "export").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] and modes["model.safetensors"] & 0o044, modes


def test_model_from_export_gives_the_same_logits(trained):
    model, dump = trained
    fresh, _ = load_model(dump / "export")
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, model(x).logits)


@pytest.mark.slow
def test_script_exports_bf16_shards(trained, tmp_path):
    model, dump = trained
    out = tmp_path / "bf16"
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/export_safetensors.py",
            "--checkpoint",
            str(dump / "checkpoint"),
            "--out",
            str(out),
            "--dtype",
            "bfloat16",
            "--max_shard_size",
            "500000",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).is_file() for f in files)
    assert all((out / f).stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777 for f in files)
    assert not (out / "model.safetensors").exists()
    tensors = load_export_tensors(out)
    expected = model.state_dict()
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[k], v.to(torch.bfloat16)) for k, v in expected.items())
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    assert read_export_config(out)["dtype"] == "bfloat16"


@pytest.mark.slow
def test_script_reports_a_missing_checkpoint(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/export_safetensors.py",
            "--checkpoint",
            str(tmp_path / "none"),
            "--out",
            str(tmp_path / "x"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1
    expected = f"export_safetensors: error: checkpoint: {tmp_path / 'none'} does not exist"
    assert proc.stderr.strip().splitlines() == [expected]


def dense_debug(name: str = "dense", **overrides) -> tuple[torch.nn.Module, object]:
    """The debug flavor of model ``name`` (with ``overrides``), materialised on the CPU (seed 0), and its args."""
    spec = registry.get("model", name)
    args = spec.build_args("debug", overrides)
    model = spec.build_on_meta(args)
    materialize(model, torch.device("cpu"), seed=0)
    return model, args


def test_float8_linears_export_their_high_precision_weights(tmp_path):
    float8 = pytest.importorskip("torchao.float8")
    model, args = dense_debug()
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    # fp8 all-gather wraps each converted weight in a tensor subclass, the hardest case to export
    float8.convert_to_float8_training(
        model,
        config=float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True),
        module_filter_fn=lambda mod, fqn: "lm_head" not in fqn,
    )
    assert type(model.layers[0].attention.wq).__name__ == "Float8Linear"
    assert type(model.layers[0].attention.wq.weight).__name__ != "Parameter"
    write_export(
        full_model_state_dict(model),
        ModelIdentity.of("dense", "debug", args, ["float8"]),
        tmp_path / "e",
        dtype=torch.float32,
    )
    tensors = load_export_tensors(tmp_path / "e")
    assert tensors.keys() == plain.keys()
    assert all(type(t) is torch.Tensor and torch.equal(t, plain[k]) for k, t in tensors.items())
    fresh, config = load_model(tmp_path / "e")  # a model without converters loads them strictly
    assert config["trained_with_converters"] == ["float8"]


def test_other_flavor_is_a_mismatch_naming_the_fields():
    spec = registry.get("model", "dense")
    saved = ModelIdentity.of("dense", "debug", spec.build_args("debug"))
    current = ModelIdentity.of("dense", "1B", spec.build_args("1B"))
    with pytest.raises(ValueError) as err:
        compare_identity(saved, current, "/ckpt/step-10")
    message = str(err.value)
    assert "\n" not in message
    for part in ("/ckpt/step-10", "dim 128 -> 2048", "n_layers 4 -> 22", "'debug'", "'1B'"):
        assert part in message, message
    other = ModelIdentity.of("spider", "debug", registry.get("model", "spider").build_args("debug"))
    with pytest.raises(ValueError, match="holds a 'spider' model"):
        compare_identity(other, saved, "/ckpt/step-10")


def test_args_that_keep_the_shapes_only_differ():
    spec = registry.get("model", "dense")
    saved = ModelIdentity.of("dense", "debug", spec.build_args("debug"))
    current = ModelIdentity.of("dense", "debug", spec.build_args("debug", {"rope_theta": 5e5}))
    assert compare_identity(saved, current, "x") == ["rope_theta 10000.0 -> 500000.0"]


def test_sample_next_draws_bytes_and_eos_only():
    logits = torch.full((VOCAB_SIZE,), -5.0)
    logits[PAD_ID] = logits[BOS_ID] = 10.0
    logits[65] = 1.0
    assert sample_next(logits, temperature=0) == 65
    logits[EOS_ID] = 2.0
    assert sample_next(logits, temperature=0) == EOS_ID
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(torch.randn(VOCAB_SIZE), temperature=1.0, generator=g) for _ in range(200)}
    assert draws and all(d < 256 or d == EOS_ID for d in draws)


def test_top_k_and_seed():
    logits = torch.randn(VOCAB_SIZE, generator=torch.Generator().manual_seed(1))
    logits[256:] = float("-inf")
    best = int(logits.argmax())
    g = torch.Generator().manual_seed(0)
    assert {sample_next(logits, temperature=2.0, top_k=1, generator=g) for _ in range(20)} == {best}
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert {sample_next(logits, temperature=5.0, top_k=3, generator=g) for _ in range(100)} <= top3


def test_generate_greedy_follows_argmax(trained):
    model, _ = trained
    out = generate(model, b"the ", max_new_bytes=6, temperature=0)
    ids = [BOS_ID, *b"the "]
    with torch.no_grad():
        for byte in out:
            logits = model(torch.tensor([ids])).logits[0, -1]
            candidates = torch.cat([logits[:256], logits[EOS_ID : EOS_ID + 1]])  # bytes, then EOS
            assert int(candidates.argmax()) == byte
            ids.append(byte)
    sampled = [generate(model, b"the ", max_new_bytes=6, temperature=0.9, seed=3) for _ in range(2)]
    assert sampled[0] == sampled[1]


# ---------------------------------------------------------------- no export deletes what it did not write


def snapshot(root) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes: 'nothing changed' is 'the same snapshot after'."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def dense_identity() -> ModelIdentity:
    return ModelIdentity.of("dense", "debug", registry.get("model", "dense").build_args("debug"))


def export_script(checkpoint, out) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/export_safetensors.py", "--checkpoint", str(checkpoint), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.slow
def test_script_refuses_the_checkpoint_folder_and_the_run_folder(trained):
    """The two commands that deleted a run's checkpoints (and its config and metrics) exit 1 with
    one line naming the folder and the fix, and leave every byte of the run as it was."""
    _, dump = trained
    before = snapshot(dump)
    assert any(name.startswith("checkpoint/step-3/") for name in before)
    for out, needle in [(dump / "checkpoint", "is the checkpoint folder"), (dump, "holds the checkpoint folder")]:
        proc = export_script(dump / "checkpoint", out)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"export_safetensors: error: --out: {out} {needle} {dump / 'checkpoint'}; "), lines
        assert lines[0].endswith(f"give a folder of its own, e.g. {dump / 'export'}") and "wrote" not in proc.stdout
        assert snapshot(dump) == before
    # the same from a step folder, and for a folder inside the checkpoint folder (in this process)
    for checkpoint, out, needle in [
        (dump / "checkpoint" / "step-3", dump / "checkpoint", "is"),
        (dump / "checkpoint", dump / "checkpoint" / "step-3" / "e", "lies inside"),
    ]:
        with pytest.raises(ValueError, match=f"^--out: {out} {needle} the checkpoint folder"):
            export_checkpoint(checkpoint, out, dtype=torch.float32, origin="--out")
        assert snapshot(dump) == before


def test_a_folder_of_other_files_is_refused_and_kept(trained, tmp_path):
    _, dump = trained
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("[job]\n")
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "run" / "logs").mkdir()
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as err:
        export_checkpoint(dump / "checkpoint", tmp_path / "run", dtype=torch.float32, origin="--out")
    assert str(err.value) == (
        f"--out: {tmp_path / 'run'} holds config.toml, logs/, metrics.jsonl, not an export "
        f"of spider_titan (no .spider_titan_export); an export replaces its folder, so it would delete them: "
        f"give a new or empty folder, e.g. {tmp_path / 'run' / 'export'}"
    )
    assert snapshot(tmp_path) == before
    # an export with a file someone added to it: that file is not the export's to delete
    out = tmp_path / "e"
    write_export({"w": torch.ones(2)}, dense_identity(), out, dtype=torch.float32)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files an export does not write \(notes.txt\)"):
        write_export({"w": torch.zeros(2)}, dense_identity(), out, dtype=torch.float32)
    assert (out / "notes.txt").read_text() == "mine" and torch.equal(load_export_tensors(out)["w"], torch.ones(2))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not an export folder"):
        write_export({"w": torch.zeros(2)}, dense_identity(), tmp_path / "file", dtype=torch.float32)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_reexport_replaces_its_own_export_whole(tmp_path, monkeypatch, exchange):
    from spider_titan.checkpoint import export

    if not exchange:
        monkeypatch.setattr(export, "_exchange", lambda a, b: False)
    identity = dense_identity()
    out = tmp_path / "e"
    out.mkdir()  # an empty folder is fine
    write_export(
        {"a": torch.ones(3), "b": torch.ones(2)}, identity, out, dtype=torch.float32, step=1, max_shard_bytes=8
    )
    assert (out / INDEX_FILE).is_file() and json.loads((out / export.MARKER_FILE).read_text())["step"] == 1
    write_export({"a": torch.zeros(3)}, identity, out, dtype=torch.float32, step=2)
    assert sorted(p.name for p in out.iterdir()) == [export.MARKER_FILE, "config.json", "model.safetensors"]
    assert torch.equal(load_export_tensors(out)["a"], torch.zeros(3)) and read_export_config(out)["step"] == 2
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask  # a folder like any other, not mkdtemp's 0700
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]  # no temporary sibling left
    # an export written before the marker existed (config.json of spider_titan, export files only) is ours too
    (out / export.MARKER_FILE).unlink()
    write_export({"a": torch.full((3,), 7.0)}, identity, out, dtype=torch.float32, step=3)
    assert read_export_config(out)["step"] == 3 and (out / export.MARKER_FILE).is_file()


def test_a_crash_mid_write_leaves_the_previous_export(tmp_path, monkeypatch):
    from spider_titan.checkpoint import export

    identity = dense_identity()
    out = tmp_path / "e"
    write_export({"a": torch.ones(3)}, identity, out, dtype=torch.float32, step=1)
    before = snapshot(tmp_path)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export.safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_export({"a": torch.zeros(3)}, identity, out, dtype=torch.float32, step=2)
    assert snapshot(tmp_path) == before  # the old export, and no temporary folder beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


# What safetensors 0.8.0 raises when its file does not fit (a SafetensorError, not an OSError; the
# real failure on a full tmpfs is in tests/unit/test_errors.py).
SAFETENSORS_ENOSPC = "Error while serializing: I/O error: No space left on device (os error 28)"


def safetensors_disk_full(tensors, filename, metadata=None):
    raise safetensors.SafetensorError(SAFETENSORS_ENOSPC)


def short_write(tensors, filename, metadata=None):
    """A write that fills the disk and fails with no errno: the partial file holds the space."""
    Path(filename).write_bytes(b"\0" * 100)
    raise RuntimeError("short write")


@pytest.mark.parametrize("failure", ["safetensors-error", "short-write"])
def test_a_full_disk_during_an_export_is_an_os_error_naming_the_export(failure, tmp_path, monkeypatch):
    """Either way write_export raises OSError(ENOSPC) for ``out`` (the caller's one line), with the
    library's error as its cause, and the previous export stays. A short write is read from the free
    space before the temporary folder is deleted: after that the disk has room again."""
    from spider_titan import errors
    from spider_titan.checkpoint import export

    identity = dense_identity()
    out = tmp_path / "e"
    write_export({"a": torch.ones(3)}, identity, out, dtype=torch.float32, step=1)
    before = snapshot(tmp_path)
    if failure == "short-write":
        monkeypatch.setattr(export.safetensors.torch, "save_file", short_write)

        def free_bytes(path):  # full while the partial file is on the disk
            return 100 if any(tmp_path.glob(".e.tmp-*/model.safetensors")) else 10**12

        monkeypatch.setattr(errors, "free_bytes", free_bytes)
    else:
        monkeypatch.setattr(export.safetensors.torch, "save_file", safetensors_disk_full)
    with pytest.raises(OSError) as err:
        write_export({"a": torch.zeros(3)}, identity, out, dtype=torch.float32, step=2)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(out), err.value
    assert isinstance(err.value.__cause__, (safetensors.SafetensorError, RuntimeError))
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["e"]


def test_script_on_a_full_disk_says_so_in_one_line(trained, tmp_path, monkeypatch):
    """scripts/export_safetensors.py when safetensors finds the disk full: exit 1 with one line naming
    ENOSPC, --out and the fix (it was a 30-line traceback); the previous export is byte-identical."""
    from spider_titan.checkpoint import export

    _, dump = trained
    out = tmp_path / "ex"
    write_export({"a": torch.ones(3)}, dense_identity(), out, dtype=torch.float32, step=1)
    before = snapshot(tmp_path)
    spec = importlib.util.spec_from_file_location(
        "export_safetensors_script", REPO / "scripts" / "export_safetensors.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(export.safetensors.torch, "save_file", safetensors_disk_full)
    with pytest.raises(SystemExit) as stop:
        script.main(["--checkpoint", str(dump / "checkpoint"), "--out", str(out)])
    line = stop.value.code  # sys.exit(text): Python prints the text and exits with status 1
    assert isinstance(line, str) and "\n" not in line, line
    assert line.startswith(f"export_safetensors: error: {out}: no space left on device (ENOSPC); "), line
    assert line.endswith("free space on that disk or set --out to a folder on another"), line
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ex"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None or sys.prefix == sys.base_prefix, reason="needs make and a venv")
def test_make_sample_reads_the_run_of_config_and_args(trained):
    """`make sample` with CONFIG and ARGS finds the run's folder as the trainer does, and the sample
    comes under a line saying where it is from. Run with this interpreter's venv, installing nothing."""
    _, dump = trained
    venv = Path(sys.prefix)
    make = [
        "make",
        "-s",
        "-o",
        str(venv / ".spider_titan_installed"),
        "-o",
        str(venv / "bin" / "python"),
        f"VENV={venv}",
        "CONFIG=train_configs/debug_dense.toml",
        f"ARGS=--job.dump_folder {shlex.quote(str(dump))}",
    ]
    proc = subprocess.run(
        [*make, "sample", "SAMPLE_ARGS=--max_new_bytes 5 --temperature 0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    label, sample = proc.stdout.splitlines()[:2]
    assert label == f"sample from {dump}/export (prompt 'def '):" and sample.startswith("def ")


def test_the_reader_names_the_shard_of_an_extra_tensor_and_the_index_of_a_missing_one(tmp_path):
    """``read_export`` checks the tensor names with the check the bundled Hugging Face code runs
    (export_format.check_tensor_names), naming the file to look at: in a sharded export the shard that
    holds an extra tensor, and the index when one is missing."""
    model, args = dense_debug()
    tensors = full_model_state_dict(model)
    identity = ModelIdentity.of("dense", "debug", args)
    extra = {**tensors, "extra.weight": torch.zeros(4)}
    out = write_export(extra, identity, tmp_path / "e", dtype=torch.float32, max_shard_bytes=1 << 16)
    shard = json.loads((out / INDEX_FILE).read_text())["weight_map"]["extra.weight"]
    with pytest.raises(ValueError) as e:
        read_export(out)
    assert str(e.value).startswith(f"{out / shard}: 1 tensor(s) not in the model (extra.weight); "), e.value
    dropped = sorted(tensors)[0]
    out = write_export(
        {k: v for k, v in tensors.items() if k != dropped}, identity, out, dtype=torch.float32, max_shard_bytes=1 << 16
    )
    with pytest.raises(ValueError) as e:
        read_export(out)
    assert str(e.value).startswith(f"{out / INDEX_FILE}: 1 of the model's {len(tensors)} tensors missing ({dropped})")
    assert "\n" not in str(e.value)


def spider_debug_export(tmp_path: Path, **overrides) -> tuple[torch.nn.Module, Path]:
    model, args = dense_debug("spider", **overrides)
    out = write_export(
        full_model_state_dict(model), ModelIdentity.of("spider", "debug", args), tmp_path / "e", dtype=torch.float32
    )
    return model.eval(), out


def test_an_export_older_than_the_added_args_loads_as_the_model_it_is(tmp_path):
    """An export written before a field of ``SPIDER_ADDED_ARGS`` existed lacks it; it loads with the
    value that rebuilds it (the same logits), a field set in the file wins over the table, and a
    field that is missing for any other reason is still an error."""
    from spider_titan.models.spider.args import SPIDER_ADDED_ARGS, SpiderArgs

    assert set(SPIDER_ADDED_ARGS) <= {f.name for f in dataclasses.fields(SpiderArgs)}
    model, out = spider_debug_export(tmp_path, **SPIDER_ADDED_ARGS)  # the model as it was saved then
    file = out / "config.json"
    config = json.loads(file.read_text())
    for key in SPIDER_ADDED_ARGS:
        del config["model"]["args"][key]
    file.write_text(json.dumps(config))
    old, _ = load_model(out)
    assert dataclasses.asdict(old.args) == dataclasses.asdict(model.args)
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(old(x).logits, model(x).logits)

    config["model"]["args"]["segment_bucket"] = 8  # a saved value wins over the table's
    file.write_text(json.dumps(config))
    assert load_model(out)[0].args.segment_bucket == 8
    del config["model"]["args"]["n_core"]
    file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing 'n_core'"):
        load_model(out)


def test_an_export_computes_every_segment_whatever_capacity_it_trained_with(tmp_path):
    """Static shapes (``segment_capacity``, ``packed_capacity``) are how training sized its tensors: an
    export of such a model writes them as 0, so a short or dense prompt loses no segment at inference.
    The control: the trained model itself, with its capacities, drops segments of the same prompts."""
    capacity = {"segment_capacity": 1.5, "packed_capacity": 1.35}
    model, out = spider_debug_export(tmp_path, **capacity)
    assert {k: read_export_config(out)["model"]["args"][k] for k in capacity} == dict.fromkeys(capacity, 0.0)
    exported, _ = load_model(out)
    exact = dataclasses.replace(model.args, **dict.fromkeys(capacity, 0.0))
    reference = registry.get("model", "spider").build_on_meta(exact)
    reference.to_empty(device="cpu").load_state_dict(model.state_dict())
    x = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(x).logits, reference.eval()(x).logits)
        assert float(model(x).aux["segments_dropped"]) > 0


# Starts an export of the dense debug model into argv[1] and hangs once the first weights file is
# half-written, so the test can kill it -9 there.
KILLED_EXPORT = """
import sys, time
from pathlib import Path
import safetensors.torch
import torch
from spider_titan.checkpoint.export import full_model_state_dict, write_export
from spider_titan.checkpoint.layout import ModelIdentity
from spider_titan import registry
from spider_titan.components.builder import materialize

def hang(tensors, filename, metadata=None):
    Path(filename).write_bytes(b"half a file")
    print("WRITING", flush=True)
    time.sleep(600)

safetensors.torch.save_file = hang
spec = registry.get("model", "dense")
args = spec.build_args("debug")
model = spec.build_on_meta(args)
materialize(model, torch.device("cpu"), seed=0)
write_export(full_model_state_dict(model), ModelIdentity.of("dense", "debug", args), Path(sys.argv[1]), dtype=torch.float32)
"""


@pytest.mark.slow
def test_an_export_killed_mid_write_is_cleaned_up_by_the_next(tmp_path, caplog):
    """kill -9 mid-write leaves the previous export whole and a temporary sibling; the next export
    into that folder deletes the sibling (its writer's lock died with it) and nothing else."""
    model, args = dense_debug()
    out = tmp_path / "e"
    identity = ModelIdentity.of("dense", "debug", args)
    write_export(full_model_state_dict(model), identity, out, dtype=torch.float32)
    before = snapshot(out)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_EXPORT, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "WRITING"
    finally:
        proc.kill()
        proc.wait(timeout=60)
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".e.tmp-")]
    assert len(left) == 1 and snapshot(out) == before, left
    (tmp_path / ".e.old-dead").mkdir()  # what a kill between the two renames of a non-atomic swap leaves
    (tmp_path / ".other.tmp-live").mkdir()  # another export's: not ours to delete
    with caplog.at_level(logging.INFO, logger="spider_titan"):
        write_export(full_model_state_dict(model), identity, out, dtype=torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-live", "e"]
    assert caplog.text.count("left by an export that did not finish") == 2
    assert torch.equal(
        load_model(out)[0](torch.zeros(1, 4, dtype=torch.long)).logits,
        model(torch.zeros(1, 4, dtype=torch.long)).logits,
    )


def test_a_second_export_into_a_folder_waits_for_the_first(tmp_path, caplog):
    """While another process holds a folder's export lock (here: a second open file of the folder,
    which flock treats as another owner), an export into it waits, says so, and then finishes."""
    import fcntl
    import threading

    model, args = dense_debug()
    holder = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    done = threading.Event()

    def export() -> None:
        write_export(
            full_model_state_dict(model), ModelIdentity.of("dense", "debug", args), tmp_path / "e", dtype=torch.float32
        )
        done.set()

    with caplog.at_level(logging.INFO, logger="spider_titan"):
        thread = threading.Thread(target=export)
        thread.start()
        try:
            assert not done.wait(1.0) and not (tmp_path / "e").exists()
        finally:
            os.close(holder)
        thread.join(timeout=600)
    assert done.is_set() and (tmp_path / "e" / "model.safetensors").is_file()
    assert "waiting for another export being written in" in caplog.text
