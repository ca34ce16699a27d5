"""What a checkpoint folder holds and how to find one: the on-disk layout, shared by the
checkpointer (manager.py) and the safetensors export (export.py), which both import it.

    <dump_folder>/<checkpoint.folder>/
        step-<N>/                    a complete checkpoint (DCP files + meta.json)
        step-<N>.tmp-<token>/        being written, or left by a crash: never loaded

``meta.json`` names the model a checkpoint belongs to (:class:`ModelIdentity`), so it can be
checked against a run, or rebuilt (export, generation) without the run's config.
"""

from __future__ import annotations

import dataclasses
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spider_titan import registry
from spider_titan.config.validate import model_args_problems

FORMAT_VERSION = 1
META_FILE = "meta.json"
STEP_RE = re.compile(r"^step-(\d+)$")
TMP_RE = re.compile(r"^step-\d+\.tmp-")
# DCP's warning on every call made without a process group, a supported mode for one process.
SINGLE_PROCESS_NOTICE = r".*assuming the intent is to (save|load) in a single process"


# ---------------------------------------------------------------- model identity


@dataclass(frozen=True)
class ModelIdentity:
    """What a checkpoint's weights belong to: registry name, flavor label and resolved args."""

    name: str
    flavor: str
    args: dict[str, Any]
    converters: tuple[str, ...] = ()

    @classmethod
    def of(cls, name: str, flavor: str, args: Any, converters=()) -> ModelIdentity:
        """From a model args dataclass; args are normalised through JSON so saved and live compare equal."""
        return cls(name, flavor, json.loads(json.dumps(dataclasses.asdict(args))), tuple(converters))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "flavor": self.flavor, "args": self.args, "converters": list(self.converters)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelIdentity:
        """As saved, with its args as this code rebuilds the model (``ModelSpec.saved_args``: the fields
        added since filled in, the retired ones dropped; ValueError, one line, for a retired option
        at a value the code no longer reproduces)."""
        args = dict(data["args"])
        if data["name"] in registry.names("model"):
            args = registry.get("model", data["name"]).saved_args(args)
        return cls(data["name"], data["flavor"], args, tuple(data.get("converters", ())))

    def build_args(self) -> Any:
        """The model's args dataclass, checked as the config checks model args; ValueError when the
        saved args hold fields this code lacks or values it refuses."""
        spec = registry.get("model", self.name)
        known = {f.name for f in dataclasses.fields(spec.args_cls)}
        unknown = sorted(set(self.args) - known)
        if unknown:
            raise ValueError(f"model args {unknown} are not fields of {spec.args_cls.__name__}")
        args = spec.args_cls(**self.args)
        problems = model_args_problems(spec, args, prefix="saved model")
        if problems:
            raise ValueError("; ".join(problems))
        return args

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """FQN -> shape of every saved tensor, from a model built on the meta device (no memory)."""
        spec = registry.get("model", self.name)
        model = spec.build_on_meta(self.build_args())
        return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def compare_identity(saved: ModelIdentity, current: ModelIdentity, where: str) -> list[str]:
    """The args that differ (``field saved -> this run``); ValueError when the weights cannot fit.

    Args that leave every tensor shape unchanged (``n_loops``, loss weights) may differ: the
    caller logs them and loads. A different model, or shapes that differ, stop the run.
    """
    if saved.name != current.name:
        raise ValueError(
            f"{where}: holds a {saved.name!r} model (flavor {saved.flavor!r}) but this run builds "
            f"{current.name!r}; set model.name = {saved.name!r} or load another checkpoint"
        )
    diffs = [
        f"{k} {saved.args.get(k)!r} -> {current.args.get(k)!r}"
        for k in sorted(set(saved.args) | set(current.args))
        if saved.args.get(k) != current.args.get(k)
    ]
    if diffs and saved.parameter_shapes() != current.parameter_shapes():
        raise ValueError(
            f"{where}: model mismatch (saved -> this run): {', '.join(diffs)}; saved with flavor "
            f"{saved.flavor!r}, this run has {current.flavor!r}: use the saved model settings or another checkpoint"
        )
    return diffs


# ---------------------------------------------------------------- folders


class DamagedCheckpointError(ValueError):
    """A checkpoint whose files cannot be read (truncated, overwritten, missing): resuming falls back
    past it to an older one; everywhere else it is one line naming the folder."""


def is_complete(path: Path) -> bool:
    """A committed checkpoint: final name, DCP metadata and meta.json present."""
    return STEP_RE.match(path.name) is not None and (path / ".metadata").is_file() and (path / META_FILE).is_file()


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of a checkpoint folder; DamagedCheckpointError when it is unreadable, not what
    this code writes, or of another format."""
    file = path / META_FILE
    try:
        meta = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise DamagedCheckpointError(f"{file}: unreadable ({first_cause(e)}); the checkpoint is damaged") from None
    if not isinstance(meta, dict):
        raise DamagedCheckpointError(
            f"{file}: holds a JSON {type(meta).__name__}, not an object; the checkpoint is damaged"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise DamagedCheckpointError(
            f"{file}: checkpoint format {meta.get('format_version')!r}, this code reads {FORMAT_VERSION}"
        )
    kinds = {"step": int, "contents": list, "model": dict, "files": dict}
    wrong = [k for k, kind in kinds.items() if k in meta and not isinstance(meta[k], kind)]
    missing = [k for k in ("step", "contents", "model") if k not in meta]
    if wrong or missing:
        raise DamagedCheckpointError(
            f"{file}: {'missing ' + str(missing) if missing else ''}{' ' if missing and wrong else ''}"
            f"{'wrong type of ' + str(wrong) if wrong else ''}; the checkpoint is damaged"
        )
    return meta


def first_cause(e: BaseException) -> str:
    """One line for an exception, looking through DCP's per-rank wrapper (``CheckpointException``)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))
        if isinstance(e, tuple):  # (exception, traceback) in some torch versions
            e = e[0]
    text = str(e).strip().splitlines()
    line = text[-1] if text else ""
    return f"{type(e).__name__}: {line[:200] + '...' if len(line) > 200 else line}"


def checksum(file: Path) -> int:
    """CRC-32 of a file, read in 64 MiB pieces (zlib: about 6 GB/s here): DCP stores no checksum,
    and bytes changed inside a tensor's data load silently."""
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 26):
            crc = zlib.crc32(chunk, crc)
    return crc


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """This rank's part of ``names`` when the ranks verify checksums in parts (file i: rank i % world)."""
    return sorted(names)[rank::world_size]


def file_records(path: Path, crcs: dict[str, int]) -> dict[str, dict[str, int]]:
    """name -> {bytes, crc32} of every file in a checkpoint folder, recorded in meta.json as ``files``."""
    return {
        f.name: {"bytes": f.stat().st_size, "crc32": crcs[f.name]}
        for f in sorted(path.iterdir())
        if f.is_file() and f.name != META_FILE
    }


def damaged_files_reason(path: Path, meta: dict[str, Any], *, verify: list[str] | None = None) -> str | None:
    """Why the folder's files differ from those meta.json recorded when saved (a missing or cut
    file; with ``verify``, those files' contents by CRC-32), or None. Names and sizes cost one stat
    each, so they are checked before every load; contents only right before one."""
    files = meta.get("files", {})
    for name, record in sorted(files.items()):
        if not (isinstance(record, dict) and isinstance(record.get("bytes"), int)):
            return f"{path / META_FILE}: its record of {name} is unreadable; the checkpoint is damaged"
        file = path / name
        if not file.is_file():
            return f"{file} is missing; the checkpoint is damaged"
        now = file.stat().st_size
        if now != record["bytes"]:
            return f"{file} has {now} bytes, {record['bytes']} when saved (truncated or overwritten)"
    for name in verify if verify is not None else ():
        if name in files and checksum(path / name) != files[name].get("crc32"):
            return f"{path / name}: its contents changed since the save (CRC-32 differs); the checkpoint is damaged"
    return None


def step_folders(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step-<N>`` folder under ``folder``, complete or not, oldest first."""
    if not folder.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir())


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``folder``, oldest first."""
    return [(step, path) for step, path in step_folders(folder) if is_complete(path)]


def incomplete_reason(path: Path) -> str | None:
    """Why a ``step-<N>`` folder is not a complete checkpoint (a file the save writes last is
    missing: the save was cut short, or the folder was copied in part), or None."""
    missing = [name for name in (".metadata", META_FILE) if not (path / name).is_file()]
    if not missing:
        return None
    return f"{path}: no {' or '.join(missing)}, so not a complete checkpoint (a cut-short save or a partial copy)"


def damage_reason(path: Path) -> str | None:
    """Why a checkpoint folder is damaged (meta.json unreadable, a file missing or cut), or None."""
    try:
        meta = read_meta(path)
    except ValueError as e:
        return str(e)
    return damaged_files_reason(path, meta)


def good_checkpoint_reason(path: Path) -> str | None:
    """None for a checkpoint that may be resumed from; else why not (for the log)."""
    damage = damage_reason(path)
    if damage is not None:
        return damage
    meta = read_meta(path)
    if meta.get("model_only"):
        return "it holds the model only (a final save)"
    if meta.get("finite") is not True:
        return "it is not marked finite (saved before finiteness checks existed)"
    return None


def is_model_only(path: Path) -> bool:
    """A final, weights-only save (False when its meta.json cannot be read)."""
    try:
        return bool(read_meta(path).get("model_only"))
    except ValueError:
        return False


def resolve_checkpoint(path: Path, *, origin: str, prefer_full: bool = False) -> Path:
    """``path`` itself when it is a checkpoint, or the newest complete one inside it (the newest
    full one with ``prefer_full``, when there is one).

    FileNotFoundError when nothing is there, ValueError for a partial checkpoint (``origin`` is
    the config key or flag that named the path, quoted in the message).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{origin}: {path} does not exist")
    if (path / META_FILE).is_file() or (path / ".metadata").is_file() or TMP_RE.match(path.name):
        if not is_complete(path):
            raise ValueError(
                f"{origin}: {path} is not a complete checkpoint (an interrupted save: "
                f"{'no .metadata' if not (path / '.metadata').is_file() else 'no ' + META_FILE}"
                f"{', temporary name' if STEP_RE.match(path.name) is None else ''}); use another step"
            )
        return path
    found = [p for _, p in list_checkpoints(path)]
    if not found:
        raise FileNotFoundError(f"{origin}: no complete checkpoint (step-<N>/ with {META_FILE}) in {path}")
    full = [p for p in found if good_checkpoint_reason(p) is None]
    return full[-1] if prefer_full and full else found[-1]
