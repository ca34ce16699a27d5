"""What a run may delete in its dump folder, a restart by torchrun in the same folder, the end report's
checkpoints, and the end-of-run export onto a full disk when it is all a run keeps."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from spider_titan.checkpoint.export import load_export_tensors, read_export_config
from spider_titan.checkpoint.run_folder import claim_run_folder, write_run_record
from spider_titan.config.manager import parse_args
from spider_titan.train import main

SMALL = [
    "--job.config_file",
    "train_configs/debug_model.toml",
    "--training.dataset",
    "mock",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "false",
    "--validation.enable",
    "false",
    "--checkpoint.export_at_end",
    "true",
]


def train(args: list[str], dump: Path, capsys) -> tuple[int, str, list[str]]:
    """``main`` in this process: (exit code, stdout, the non-empty stderr lines)."""
    with torch.random.fork_rng():
        code = main(SMALL + args + ["--job.dump_folder", str(dump)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, [line for line in err.splitlines() if line.strip()]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def finished(tmp_path: Path, capsys) -> Path:
    """A finished 2-step run (checkpoints off, an export) and the user's notes.txt beside it."""
    dump = tmp_path / "run"
    assert train(["--training.steps", "2"], dump, capsys)[0] == 0
    (dump / "notes.txt").write_text("mine")
    return dump


def set_outputs(dump: Path, outputs) -> None:
    run = json.loads((dump / "run.json").read_text())
    run["outputs"] = outputs
    (dump / "run.json").write_text(json.dumps(run))


BAD_OUTPUTS = [
    ("*", "a pattern, not a name"),
    ("metrics*.jsonl", "a pattern, not a name"),
    ("export/[a-z]*", "a pattern, not a name"),
    ("../outside.txt", "not a plain relative name inside the folder"),
    ("{abs}", "not a plain relative name inside the folder"),
    ("./notes.txt", "not a plain relative name inside the folder"),
    (".lock", "the folder's own lock or run record"),
    ("run.json", "the folder's own lock or run record"),
    (7, "not a name"),
]


@pytest.mark.parametrize("entry, why", BAD_OUTPUTS, ids=[str(e) for e, _ in BAD_OUTPUTS])
def test_overwrite_refuses_a_run_json_entry_that_is_not_a_plain_name(entry, why, tmp_path, in_process, capsys):
    """run.json names what job.overwrite may delete; an entry that is a pattern, leaves the folder or
    names the lock or the record is refused in one line and nothing is deleted (the entry "*" used to
    delete the user's notes.txt and the live run's own .lock)."""
    dump = finished(tmp_path, capsys)
    outside = dump.parent / "outside.txt"
    outside.write_text("not the run's")
    entry = str(outside) if entry == "{abs}" else entry
    set_outputs(dump, ["metrics.jsonl", entry, "export"])
    before = snapshot(dump)
    code, _, lines = train(["--training.steps", "3", "--job.overwrite", "true"], dump, capsys)
    assert code == 2 and len(lines) == 1, lines
    assert f"{dump / 'run.json'} lists the output {json.dumps(entry)}, {why}" in lines[0], lines
    assert "nothing was" in lines[0]
    assert snapshot(dump) == before and outside.read_text() == "not the run's"


def test_overwrite_refuses_a_name_reached_through_a_link(tmp_path, in_process, capsys):
    dump = finished(tmp_path, capsys)
    elsewhere = dump.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.bin").write_text("precious")
    (dump / "link").symlink_to(elsewhere)
    set_outputs(dump, ["metrics.jsonl", "link/data.bin"])
    code, _, lines = train(["--training.steps", "3", "--job.overwrite", "true"], dump, capsys)
    assert code == 2 and len(lines) == 1 and "reached through the symbolic link" in lines[0], lines
    assert (elsewhere / "data.bin").read_text() == "precious" and (dump / "notes.txt").is_file()


def test_overwrite_deletes_the_exact_names_only(tmp_path, in_process, capsys):
    """Plain names are deleted as named: metrics_rank1.jsonl is not 'metrics_rank*.jsonl' any more,
    so a user's metrics_rank_notes.jsonl beside it survives."""
    dump = finished(tmp_path, capsys)
    (dump / "metrics_rank1.jsonl").write_text("{}\n")
    (dump / "metrics_rank_notes.jsonl").write_text("mine\n")
    set_outputs(dump, ["metrics.jsonl", "export", "metrics_rank1.jsonl"])
    code, out, lines = train(["--training.steps", "3", "--job.overwrite", "true"], dump, capsys)
    assert code == 0 and lines == [], lines
    assert "job.overwrite: deleted export/, metrics.jsonl, metrics_rank1.jsonl of run" in out
    assert (dump / "notes.txt").read_text() == "mine" and (dump / "metrics_rank_notes.jsonl").is_file()
    assert not (dump / "metrics_rank1.jsonl").exists()
    assert json.loads((dump / "run.json").read_text())["outputs"] == [
        "config.toml",
        "metrics.jsonl",
        "comm_counts.jsonl",
        "tb",
        "checkpoint",
        "export",
        "profile_traces",
    ]


def test_overwrite_reads_the_rank_metrics_entry_of_earlier_versions_as_exact_names(tmp_path, in_process, capsys):
    """Earlier versions listed 'metrics_rank*.jsonl'; it stands for metrics_rank<N>.jsonl and no other name."""
    dump = finished(tmp_path, capsys)
    for name in ("metrics_rank0.jsonl", "metrics_rank12.jsonl", "metrics_rank_notes.jsonl", "metrics_rank1.jsonl.bak"):
        (dump / name).write_text("{}\n")
    set_outputs(dump, ["metrics.jsonl", "export", "metrics_rank*.jsonl"])
    code, out, lines = train(["--training.steps", "3", "--job.overwrite", "true"], dump, capsys)
    assert code == 0 and lines == [], lines
    assert "deleted export/, metrics.jsonl, metrics_rank0.jsonl, metrics_rank12.jsonl of run" in out, out[-3000:]
    assert (dump / "metrics_rank_notes.jsonl").is_file() and (dump / "metrics_rank1.jsonl.bak").is_file()


def test_a_restart_by_torchrun_before_the_first_checkpoint_starts_the_same_run_again(tmp_path, monkeypatch):
    """The same torchrun launch (TORCHELASTIC_RUN_ID) and config, its end not recorded, no full
    checkpoint yet: the restart takes the folder back (what the first start wrote is deleted, the run id
    kept); another launch in that folder is still refused."""
    dump = tmp_path / "run"
    dump.mkdir()
    cfg = parse_args(["--job.config_file", "train_configs/debug_model.toml", "--checkpoint.enable", "true"])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-a")
    run = claim_run_folder(dump, cfg, config_hash="h1", world_size=2)
    write_run_record(dump, run)
    (dump / "metrics.jsonl").write_text('{"step": 1}\n')
    (dump / "notes.txt").write_text("mine")
    again = claim_run_folder(dump, cfg, config_hash="h1", world_size=2)
    assert again["run_id"] == run["run_id"] and again["launch"] == "launch-a"
    assert not (dump / "metrics.jsonl").exists() and (dump / "notes.txt").read_text() == "mine"
    write_run_record(dump, again)
    (dump / "metrics.jsonl").write_text('{"step": 1}\n')
    for launch, config_hash in (("launch-b", "h1"), ("launch-a", "h2")):  # another launch, another config
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", launch)
        with pytest.raises(ValueError, match="no full checkpoint to resume from"):
            claim_run_folder(dump, cfg, config_hash=config_hash, world_size=2)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with pytest.raises(ValueError, match="no full checkpoint to resume from"):
        claim_run_folder(dump, cfg, config_hash="h1", world_size=2)
    assert (dump / "metrics.jsonl").is_file()


def test_the_end_report_names_the_checkpoint_with_the_final_weights(tmp_path, in_process, capsys):
    """The final save (model only, step-3) holds the final weights; step-2 is the resume point. The
    report used to say 'last checkpoint: step-2' right after writing step-3."""
    dump = tmp_path / "run"
    ck = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--training.steps", "3"]
    code, out, lines = train(ck, dump, capsys)
    assert code == 0 and lines == [], lines
    assert f"final weights: {dump / 'checkpoint' / 'step-3'} (model only, float32)" in out, out[-2000:]
    assert f"last full checkpoint (the resume point): {dump / 'checkpoint' / 'step-2'}" in out
    assert "last checkpoint:" not in out


def _full_disk_in(dump: Path, monkeypatch) -> None:
    """safetensors fails under ``dump`` in its own words for a full disk, which has no free byte."""
    import safetensors.torch

    from spider_titan import train as train_module

    real = safetensors.torch.save_file

    def save_file(tensors, filename, *args, **kwargs):
        if str(filename).startswith(str(dump)):
            raise safetensors.SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(train_module, "free_bytes", lambda path: 0 if str(path).startswith(str(dump)) else None)


def test_export_onto_a_full_disk_without_checkpoints_keeps_the_weights_where_there_is_room(
    tmp_path, in_process, capsys, monkeypatch
):
    from spider_titan import train as train_module

    dump, spare = tmp_path / "run", tmp_path / "spare"
    spare.mkdir()
    _full_disk_in(dump, monkeypatch)
    monkeypatch.setenv("TMPDIR", str(spare))
    monkeypatch.setattr(train_module, "free_bytes", lambda path: 10**12 if str(path) == str(spare) else 0)
    code, _, lines = train(["--training.steps", "2"], dump, capsys)
    assert code == 1 and len(lines) == 1, lines
    kept = [p for p in spare.iterdir()]
    assert len(kept) == 1 and kept[0].name.startswith("spider_titan-") and kept[0].name.endswith("-export-step-2")
    assert lines[0].startswith("error: export at step 2 not written") and "(ENOSPC)" in lines[0], lines
    assert f"were exported to {kept[0]} instead" in lines[0] and f"mv {kept[0]} {dump / 'export'}" in lines[0]
    assert read_export_config(kept[0])["step"] == 2 and load_export_tensors(kept[0])
    assert not (dump / "export").exists()


def test_export_onto_a_full_disk_without_checkpoints_says_what_is_lost(tmp_path, in_process, capsys, monkeypatch):
    dump = tmp_path / "run"
    _full_disk_in(dump, monkeypatch)
    from spider_titan import train as train_module

    monkeypatch.setattr(train_module, "free_bytes", lambda path: 0)
    code, _, lines = train(["--training.steps", "2"], dump, capsys)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: export at step 2 not written") and "(ENOSPC)" in lines[0], lines
    assert "checkpoint.enable = false, so the trained weights of step 2 are lost" in lines[0], lines
    assert "MB they need" in lines[0] and "--checkpoint.enable true" in lines[0]
    assert not (dump / "export").exists() and os.listdir(dump)
