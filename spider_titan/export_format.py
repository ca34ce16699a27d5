"""The safetensors export's format as its writer and every reader share it: file names, the model
block of config.json, and the tensor-name check.

    <export>/config.json         {"model": {"name", "flavor", "args"}, ...} (checkpoint/export.py writes it)
    <export>/model.safetensors   every tensor under its FQN; above the shard size instead
    <export>/model-0000i-of-0000K.safetensors + model.safetensors.index.json  (``weight_map``: key -> file)

A quantized export (config.json ``quantization``) stores each quantized weight as the plain tensors of
quantization/weight_only.py's flattening, with its description in the file's safetensors header;
:func:`read_tensors` rebuilds them with the reader's ``unflatten`` (weight_only.py's, handed in: this
contract imports no technique), so every reader sees the model's FQNs.

checkpoint/export.py writes an export and reads one back whole (``read_export``, for generation);
the Hugging Face classes bundled into an export (hf/) read the model and the tensor names here too,
so both check the same things with the same one-line errors. This module imports neither the
registry nor any model: a reader hands in how it finds a spec by name, and the bundled copy of this
file works where only torch and transformers are installed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors
import torch

from spider_titan.protocol import ModelSpec

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
REEXPORT = "re-export it with scripts/export_safetensors.py"
TORCHAO_KEYS = "tensor_names"  # a safetensors header written by torchao's flattening has this key


def read_model_block(model: Any, spec_of: Callable[[str], ModelSpec], where: object) -> tuple[ModelSpec, Any]:
    """(spec, args dataclass) of config.json's ``model`` block, checked key by key: its shape, the
    name (``spec_of`` raises ValueError for one it does not know), the flavor, and every arg against
    the flavor's (unknown, missing, wrong type), after ``ModelSpec.saved_args`` has filled in the
    fields added since and dropped the retired ones. ValueError naming ``where`` otherwise."""
    if not isinstance(model, dict) or not all(
        isinstance(model.get(k), t) for k, t in (("name", str), ("flavor", str), ("args", dict))
    ):
        raise ValueError(
            f"{where}: 'model' must hold 'name' and 'flavor' (strings) and 'args' (an object); restore it or {REEXPORT}"
        )
    name, flavor = model["name"], model["flavor"]
    try:
        spec = spec_of(name)
    except ValueError as e:
        raise ValueError(f"{where}: model.name: {e}") from None
    if flavor not in spec.flavors:
        raise ValueError(
            f"{where}: model.flavor {flavor!r} is not a flavor of {name!r}; choose one of {list(spec.flavors)}"
        )
    try:
        args = spec.saved_args(model["args"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    reference = spec.flavors[flavor]
    known = {f.name for f in dataclasses.fields(reference)}
    problems = [f"unknown {k!r}" for k in sorted(set(args) - known)]
    problems += [f"missing {k!r}" for k in sorted(known - set(args))]
    for key in sorted(set(args) & known):
        expected, value = getattr(reference, key), args[key]
        if expected is None or value is None:
            continue
        if isinstance(expected, bool) or isinstance(value, bool):
            ok = isinstance(expected, bool) and isinstance(value, bool)
        elif isinstance(expected, float):
            ok = isinstance(value, (int, float))
        elif isinstance(expected, (list, tuple)):
            ok = isinstance(value, list)
        else:
            ok = isinstance(value, type(expected))
        if not ok:
            problems.append(f"{key!r} is {value!r}, expected a {type(expected).__name__}")
    if problems:
        raise ValueError(f"{where}: model.args: {'; '.join(problems)}; restore it or {REEXPORT}")
    try:
        return spec, spec.args_cls(**args)
    except Exception as e:  # args of the right types that the args class itself refuses
        raise ValueError(
            f"{where}: model.args build no {name!r} model ({type(e).__name__}: {e}); restore it or {REEXPORT}"
        ) from None


def weight_files(folder: Path) -> list[Path] | None:
    """The safetensors files of an export folder (the shards its index names, or the one file); None
    when it holds neither the index nor the file."""
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        return [
            folder / name for name in sorted(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values()))
        ]
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    return None


def export_tensor_names(folder: Path) -> set[str] | None:
    """The FQNs an export folder holds (from the safetensors headers, no weights read; a quantized
    weight counts once, under its module's FQN); None when it holds no weights file; ValueError naming
    a file whose header cannot be read (a cut file)."""
    files = weight_files(folder)
    if files is None:
        return None
    names = set()
    for file in files:
        try:
            with safetensors.safe_open(str(file), framework="pt") as f:
                metadata = f.metadata()
                names |= set(stored_names(metadata) if is_torchao_header(metadata) else f.keys())
        except Exception as e:  # safetensors' own error for a cut or overwritten file, a header's bad JSON
            text = str(e).strip().splitlines()
            raise ValueError(
                f"{file}: unreadable ({type(e).__name__}: {text[-1] if text else ''}); restore it or {REEXPORT}"
            ) from None
    return names


def is_torchao_header(metadata: dict[str, str] | None) -> bool:
    """Whether a safetensors header was written by torchao's flattening (a quantized export's file)."""
    return bool(metadata) and TORCHAO_KEYS in metadata


def stored_names(metadata: dict[str, str]) -> list[str]:
    """The FQNs a file of a quantized export holds (its header's ``tensor_names``)."""
    return list(json.loads(metadata[TORCHAO_KEYS]))


def read_tensors(
    folder: Path, unflatten: Callable[..., dict[str, torch.Tensor]] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of an export folder under its FQN. A quantized export's files go through
    ``unflatten(stored, metadata, where=file)`` (quantization/weight_only.py ``unflatten_quantized``,
    which rebuilds torchao's subclasses); without it such a file is a ValueError."""
    files = weight_files(folder)
    if files is None:
        raise FileNotFoundError(f"{folder}: neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    tensors = {}
    for file in files:
        with safetensors.safe_open(str(file), framework="pt") as f:
            metadata, stored = f.metadata(), {key: f.get_tensor(key) for key in f.keys()}
        if is_torchao_header(metadata):
            if unflatten is None:
                raise ValueError(f"{file}: a quantized export; load it with spider_titan.generation.load_model")
            stored = unflatten(stored, metadata, where=file)
        tensors.update(stored)
    return tensors


def check_tensor_names(where: object, expected: set[str], found: set[str]) -> None:
    """ValueError naming ``where``, the missing and the extra tensors, unless ``found`` is ``expected``."""
    missing, extra = sorted(expected - found), sorted(found - expected)

    def few(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    problems = [f"{len(missing)} of the model's {len(expected)} tensors missing ({few(missing)})"] if missing else []
    problems += [f"{len(extra)} tensor(s) not in the model ({few(extra)})"] if extra else []
    if problems:
        raise ValueError(
            f"{where}: {' and '.join(problems)}; the export is incomplete or from another model: {REEXPORT}"
        )


def nonfinite_tensor(
    tensors: dict[str, torch.Tensor], parts: Callable[[torch.Tensor], list[torch.Tensor]] = lambda t: [t]
) -> str | None:
    """The first name (sorted) of ``tensors`` whose floating values hold NaN or inf; None when all are
    finite. ``parts`` lists the plain tensors a stored one is made of (a quantized weight's scales)."""
    for key in sorted(tensors):
        if not all(bool(torch.isfinite(t).all()) for t in parts(tensors[key]) if t.is_floating_point()):
            return key
    return None


def nonfinite_problem(where: object, key: str) -> str:
    """The one line for an export whose tensor ``key`` holds NaN or inf (every reader refuses it)."""
    return f"{where}: tensor {key} holds NaN or inf; export a checkpoint saved before the values went non-finite"


def check_quantized_files(folder: Path, method: str | None) -> None:
    """ValueError naming config.json unless its ``quantization`` block (``method``; None: no block)
    agrees with the weights files: torchao's header in them marks a quantized export."""
    files = weight_files(folder) or []
    quantized = []
    for file in files:
        with safetensors.safe_open(str(file), framework="pt") as f:
            if is_torchao_header(f.metadata()):
                quantized.append(file.name)
    if method is None and quantized:
        raise ValueError(
            f"{Path(folder) / CONFIG_FILE}: no 'quantization' block, but {quantized[0]} holds quantized weights "
            f"(torchao's header); restore config.json's 'quantization' from the export's original or {REEXPORT}"
        )
    if method is not None and files and not quantized:
        raise ValueError(
            f"{Path(folder) / CONFIG_FILE}: 'quantization' names {method}, but {files[0].name} holds no quantized "
            f"weights; remove that block if the export is not quantized, or {REEXPORT}"
        )
