"""Safetensors export: full (unsharded) weights under plain FQNs + config.json, readable by safetensors alone.

    <out>/config.json              format version, model name / flavor / all args, vocabulary, dtype, step
    <out>/model.safetensors        every tensor, when they total at most ``max_shard_bytes``
    <out>/model-0000i-of-0000K.safetensors + model.safetensors.index.json   above it (the HF layout:
                                   ``weight_map`` FQN -> file, ``metadata.total_size`` in bytes)

Two sources, one writer (:func:`write_export`): a DCP checkpoint folder read in one process
(:func:`export_checkpoint`, behind ``scripts/export_safetensors.py``), or the live, possibly
FSDP-sharded model at the end of training (:func:`full_model_state_dict`, ``checkpoint.export_at_end``).
A model whose spec names Hugging Face classes (``Inference.hf_modules``) also gets the files that
load it with transformers (hf/bundle.py, docs/hf.md). One reader beside it (:func:`read_export`):
config.json, the model it names and every tensor, each checked against the others, with the model
block and tensor names checked by export_format.py, as the bundled Hugging Face code checks them.

No export deletes what it did not write: the folder carries a marker file (``.spider_titan_export``)
and :func:`check_export_target` refuses an ``out`` that holds anything but a previous export (or
that is, holds or lies inside a checkpoint folder). The new export is written into a temporary
sibling and swapped in whole (one atomic exchange where the OS has one), so a crash or a full disk
mid-write leaves the previous export as it was. One writer at a time per parent folder (an ``flock``
on the folder, which the kernel drops when its holder dies), so the temporary siblings of ``out``
(``.<name>.tmp-*``, ``.<name>.old-*``) found under that lock were left by a writer that was killed
(kill -9, power loss): the next export into ``out`` deletes them once ``out`` holds a complete export.

``quantize`` (``scripts/export_safetensors.py --quantize int8|int4``) writes the model's linears,
hashed tables and MoE expert weights weight-only quantized with torchao (:func:`quantized_state`, quantization/weight_only.py) and the
rest in ``dtype``; config.json's ``quantization`` names the method, and the readers quantize the same weights
before loading. A DCP checkpoint or an unquantized export can be its source.

Float8 training keeps each converted linear's high-precision weight as its parameter; with fp8
all-gather torchao wraps it in a tensor subclass that safetensors cannot store. The export unwraps
it, so the files hold bf16/fp32 weights under the ``nn.Linear`` names that a model built without
converters loads.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import glob
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from spider_titan import registry
from spider_titan.checkpoint.layout import (
    SINGLE_PROCESS_NOTICE,
    STEP_RE,
    DamagedCheckpointError,
    ModelIdentity,
    damaged_files_reason,
    first_cause,
    read_meta,
    resolve_checkpoint,
)
from spider_titan.errors import find_os_error
from spider_titan.export_format import (
    CONFIG_FILE,
    INDEX_FILE,
    REEXPORT,
    WEIGHTS_FILE,
    check_quantized_files,
    check_tensor_names,
    nonfinite_problem,
    nonfinite_tensor,
    read_model_block,
    read_tensors,
)
from spider_titan.hf.bundle import TOKENIZER_CONFIG, hf_config_keys, is_bundled_file, write_hf_files
from spider_titan.metrics.logger import shell_command
from spider_titan.quantization.weight_only import (
    DamagedQuantizedTensor,
    apply_weight_only,
    check_method,
    flatten_quantized,
    plan_weight_only,
    quantization_block,
    read_method,
    require_torchao,
    tensor_parts,
    torchao_header,
    unflatten_quantized,
)
from spider_titan.vocab import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

EXPORT_FORMAT_VERSION = 1
MARKER_FILE = ".spider_titan_export"  # {"format", "format_version", "step", "time"}: this folder is ours
SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the usual 5 GB per file of hub exports
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

logger = logging.getLogger("spider_titan")


def to_plain(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding ``t``'s values: unwraps wrapper subclasses that keep it in ``_tensor``."""
    while type(t) not in (torch.Tensor, nn.Parameter) and isinstance(getattr(t, "_tensor", None), torch.Tensor):
        t = t._tensor
    return t.detach()


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """FQN -> full CPU tensor of every saved tensor; a collective under FSDP, filled on rank 0 only.

    Gathers one tensor at a time, so the peak is one full tensor per rank plus rank 0's CPU copy.
    """
    keep = not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for fqn, value in get_model_state_dict(model).items():
        if isinstance(value, DTensor):
            local = to_plain(value.to_local())
            value = DTensor.from_local(
                local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride()
            ).full_tensor()
        value = to_plain(value)
        if keep:
            out[fqn] = value.to("cpu", copy=True)
    return out


def read_checkpoint_tensors(path: Path, prefix: str = "model.") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Full tensors under ``prefix`` of a DCP checkpoint (read in this process alone, keys without
    the prefix) and its meta.json. ``path`` is a ``step-<N>`` folder or a folder of them (then the
    newest complete one)."""
    path = resolve_checkpoint(Path(path), origin="checkpoint")
    meta = read_meta(path)
    damage = damaged_files_reason(path, meta, verify=list(meta.get("files", {})))
    if damage is not None:
        raise DamagedCheckpointError(f"{damage}; the checkpoint is damaged: use another step")
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a cut or overwritten pickle fails in many ways
        raise DamagedCheckpointError(f"{path / '.metadata'}: unreadable ({first_cause(e)}); use another step") from None
    tensors = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    if not tensors:
        raise ValueError(f"{path}: the checkpoint holds no tensors under {prefix!r}")
    with warnings.catch_warnings():  # reading in one process is the intent, not a fallback
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_NOTICE)
        try:
            dcp.load(tensors, checkpoint_id=str(path), no_dist=True)
        except (Exception, dcp.CheckpointException) as e:  # CheckpointException wraps the reader's error
            raise DamagedCheckpointError(f"{path}: cannot be read ({first_cause(e)}); use another step") from None
    return {key[len(prefix) :]: t for key, t in tensors.items()}, meta


def export_config(
    identity: ModelIdentity,
    dtype: torch.dtype,
    *,
    step: int | None,
    num_parameters: int,
    quantization: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What config.json holds: enough to rebuild the model with no other file of the run."""
    config = {
        "format_version": EXPORT_FORMAT_VERSION,
        "library": "spider_titan",
        "model": {"name": identity.name, "flavor": identity.flavor, "args": identity.args},
        "trained_with_converters": list(identity.converters),
        "vocab": {
            "size": VOCAB_SIZE,
            "tokenizer": "bytes: ids 0..255 are UTF-8 bytes; a document is [BOS] + bytes + [EOS]",
            "pad_id": PAD_ID,
            "bos_id": BOS_ID,
            "eos_id": EOS_ID,
        },
        "dtype": DTYPE_NAMES[dtype],
        "step": step,
        "num_parameters": num_parameters,
    }
    if quantization is not None:  # readers that predate it refuse the export by its tensor names
        config["quantization"] = quantization
    return config


def _make_readable(path: Path, *, folder: bool = False) -> None:
    """safetensors writes its files 0600 (and mkdtemp its folders 0700); give them the mode of any
    other file or folder we write (0644 / 0755 under the usual umask), like config.json beside them."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if folder else 0o666) & ~umask)


def exported_identity(identity: ModelIdentity) -> ModelIdentity:
    """``identity`` with its model's ``export_args`` (ModelSpec) in place of what the run trained with."""
    reset = registry.get("model", identity.name).saved.export_values if identity.name in registry.names("model") else {}
    return dataclasses.replace(
        identity, args={**identity.args, **{k: v for k, v in reset.items() if k in identity.args}}
    )


def write_export(
    tensors: dict[str, torch.Tensor],
    identity: ModelIdentity,
    out: Path,
    *,
    dtype: torch.dtype,
    step: int | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    origin: str = "export",
    keep_out_of: Sequence[Path] = (),
    quantize: str | None = None,
) -> Path:
    """Write ``tensors`` (full, plain FQNs) in ``dtype`` as safetensors + config.json into ``out``,
    replacing a previous export there and refusing anything else (:func:`check_export_target`).
    ``quantize`` (int8, int4): the model's linears weight-only quantized (:func:`quantized_state`)."""
    out = Path(out)
    if quantize is not None:
        check_quantizable(identity.name, quantize)
    check_export_target(out, origin=origin, keep_out_of=keep_out_of)
    identity = exported_identity(identity)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _export_lock(out.parent):
        _remove_abandoned(out)  # before writing, to free their space (only once out is complete)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            _write_files(
                tensors,
                identity,
                tmp,
                dtype=dtype,
                step=step,
                max_shard_bytes=max_shard_bytes,
                out=out,
                quantize=quantize,
            )
            _make_readable(tmp, folder=True)  # mkdtemp makes it 0700
            _swap_in(tmp, out)
        except BaseException as e:
            # Name the cause while tmp still holds what was written: once it is deleted a full disk
            # has room again, and the free-space test of find_os_error would find nothing.
            cause = find_os_error(e, tmp) if isinstance(e, Exception) else None
            shutil.rmtree(tmp, ignore_errors=True)
            if cause is not None and cause is not e:
                raise OSError(cause.errno, cause.strerror, str(out)) from e
            raise
        _remove_abandoned(out)  # out is complete now, also where it did not exist before
    return out


@contextlib.contextmanager
def _export_lock(parent: Path):
    """Hold ``parent``'s export lock (``flock`` on the folder itself) for the block; waits, saying so,
    while another process writes an export there."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("export: waiting for another export being written in %s", parent)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_abandoned(out: Path) -> None:
    """Delete the temporary siblings of ``out`` left by an export that was killed (called under the
    export lock, so no live writer owns one), once ``out`` holds a complete export (swapped in whole,
    marker present): until then such a folder may hold the only copy."""
    if out.is_symlink() or not (out / MARKER_FILE).is_file():
        return
    pattern = glob.escape(f".{out.name}")
    for path in sorted([*out.parent.glob(f"{pattern}.tmp-*"), *out.parent.glob(f"{pattern}.old-*")]):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            logger.info("export: removed %s, left by an export that did not finish", path)


def check_quantizable(name: str, quantize: str) -> None:
    """ValueError (one line) unless ``quantize`` is a method and model ``name`` has a quantized export."""
    check_method(quantize)
    inference = registry.get("model", name).inference
    if inference is None or inference.quantize_keep_fqns is None:
        raise ValueError(
            f"--quantize {quantize}: the {name!r} model has no quantized export (its ModelSpec names no "
            "quantize_keep_fqns); export it without --quantize"
        )


def quantized_state(
    tensors: dict[str, torch.Tensor], identity: ModelIdentity, dtype: torch.dtype, quantize: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's state with everything in ``dtype`` and its linears, tables and expert weights, but those its
    spec keeps (``Inference.quantize_keep_fqns``), quantized with ``quantize``; and config.json's block for it."""
    spec = registry.get("model", identity.name)
    model = spec.build_on_meta(identity.build_args())
    model.to_empty(device="cpu")  # buffers that are not saved stay unset: only the state is read back
    model.load_state_dict({k: to_plain(v) for k, v in tensors.items()}, strict=True)
    model.to(dtype)
    keep = spec.inference.quantize_keep_fqns
    quantized, kept, skipped = plan_weight_only(model, quantize, keep)
    if not quantized:
        raise ValueError(
            f"--quantize {quantize}: no linear, table or expert weight of the {identity.name!r} model can be quantized"
        )
    if skipped:
        logger.info(
            "export: %d weight(s) stay %s, their row width is not a multiple of the int4 group: %s",
            len(skipped),
            DTYPE_NAMES[dtype],
            ", ".join(skipped),
        )
    apply_weight_only(model, quantize, quantized)
    logger.info(
        "export: %d linears, tables and expert weights quantized to %s, %d kept in %s (%s)",
        len(quantized),
        quantize,
        len(kept),
        DTYPE_NAMES[dtype],
        ", ".join(keep),
    )
    return model.state_dict(), quantization_block(quantize, quantized, kept, skipped)


def _write_files(
    tensors: dict[str, torch.Tensor],
    identity: ModelIdentity,
    tmp: Path,
    *,
    dtype: torch.dtype,
    step: int | None,
    max_shard_bytes: int,
    out: Path,
    quantize: str | None = None,
) -> None:
    """The export's files, into the temporary folder ``tmp`` (``out`` only names it in the log)."""
    block = None
    if quantize is None:
        state = {k: to_plain(v).to(dtype).contiguous() for k, v in tensors.items()}
        groups, descriptions, packed = {k: {k: t} for k, t in state.items()}, {}, set()
    else:
        state, block = quantized_state(tensors, identity, dtype, quantize)
        groups, descriptions, packed = flatten_quantized(state, quantize)
    shards: list[dict[str, dict[str, torch.Tensor]]] = [{}]  # file -> FQN -> stored key -> tensor
    size = 0
    for fqn, group in groups.items():  # a quantized weight's parts stay in one file
        nbytes = sum(t.numel() * t.element_size() for t in group.values())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][fqn] = group
        size += nbytes
    total = sum(t.numel() * t.element_size() for group in groups.values() for t in group.values())
    logger.info("export: writing %.0f MB in %d file(s) to %s ...", total / 1e6, len(shards), out)

    def save(shard: dict[str, dict[str, torch.Tensor]], name: str) -> None:
        stored = {key: t for group in shard.values() for key, t in group.items()}
        metadata = {"format": "pt"}
        if quantize is not None:
            metadata.update(torchao_header(list(shard), descriptions, sorted(packed & set(stored))))
        safetensors.torch.save_file(stored, tmp / name, metadata=metadata)
        _make_readable(tmp / name)

    if len(shards) == 1:
        save(shards[0], WEIGHTS_FILE)
    else:
        weight_map = {}
        t0, written = time.perf_counter(), 0
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save(shard, name)
            weight_map.update({key: name for group in shard.values() for key in group})
            written += sum(t.numel() * t.element_size() for group in shard.values() for t in group.values())
            rate = written / max(time.perf_counter() - t0, 1e-9) / 1e6
            logger.info("export: shard %d/%d written (%.0f MB, %.0f MB/s)", i, len(shards), written / 1e6, rate)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1))
    num_parameters = sum(t.numel() for t in state.values())
    config = export_config(identity, dtype, step=step, num_parameters=num_parameters, quantization=block)
    inference = registry.get("model", identity.name).inference
    hf_modules = None if inference is None else inference.hf_modules
    if hf_modules is not None:  # loadable by transformers' Auto classes too (docs/hf.md)
        config.update(hf_config_keys(identity.args, hf_modules))
        write_hf_files(tmp, hf_modules)
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    marker = {
        "format": "spider_titan safetensors export",
        "format_version": EXPORT_FORMAT_VERSION,
        "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (tmp / MARKER_FILE).write_text(json.dumps(marker) + "\n")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    C library or the file system has no such call."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(tmp: Path, out: Path) -> None:
    """Put the finished folder ``tmp`` at ``out``. A previous export there is exchanged with it in
    one step where the OS allows, else moved aside first, so a complete export is on disk at
    every moment; the old one is deleted last."""
    if not out.exists():
        tmp.rename(out)
        return
    if _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous export
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    out.rename(old)  # onto the empty folder mkdtemp made
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def is_own_export(path: Path) -> bool:
    """``path`` is a folder holding an export of ours and nothing else: the marker file (or, for
    exports written before the marker, a spider_titan config.json) and only the names an export
    writes."""
    path = Path(path)
    names = {p.name for p in path.iterdir()}
    if _foreign(names):
        return False
    if MARKER_FILE in names:
        return True
    try:
        return json.loads((path / CONFIG_FILE).read_text()).get("library") == "spider_titan"
    except (OSError, ValueError, AttributeError):
        return False


def _foreign(names: set[str]) -> list[str]:
    """The names among ``names`` that an export never writes."""
    ours = {CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE, MARKER_FILE, TOKENIZER_CONFIG}
    return sorted(n for n in names if n not in ours and not SHARD_RE.match(n) and not is_bundled_file(n))


def _listing(path: Path, names: list[str], limit: int = 4) -> str:
    shown = [n + ("/" if (path / n).is_dir() else "") for n in names[:limit]]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(shown) + more


def check_export_target(out: Path, *, origin: str = "export", keep_out_of: Sequence[Path] = ()) -> None:
    """ValueError (naming ``origin``, the folder, what is in it and the fix) unless writing an
    export at ``out`` deletes nothing but a previous export: ``out`` is new, empty or an export of
    ours, and is neither one of ``keep_out_of`` (checkpoint folders) nor inside or around one."""
    out = Path(out)
    where = out.resolve()
    for folder in keep_out_of:
        folder = Path(folder).resolve()
        if where == folder or where in folder.parents or folder in where.parents:
            how = "is" if where == folder else "holds" if where in folder.parents else "lies inside"
            raise ValueError(
                f"{origin}: {out} {how} the checkpoint folder {folder}; an export there would delete or mix "
                f"with checkpoints: give a folder of its own, e.g. {folder.parent / 'export'}"
            )
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise ValueError(f"{origin}: {out} is a file, not an export folder; give a new or empty folder")
    names = sorted(p.name for p in out.iterdir())
    if not names or is_own_export(out):
        return
    foreign = _foreign(set(names))
    why = (
        f"files an export does not write ({_listing(out, foreign)})"
        if MARKER_FILE in names
        else f"{_listing(out, names)}, not an export of spider_titan (no {MARKER_FILE})"
    )
    raise ValueError(
        f"{origin}: {out} holds {why}; an export replaces its folder, so it would delete them: "
        f"give a new or empty folder, e.g. {out / 'export'}"
    )


def export_checkpoint(
    checkpoint: Path,
    out: Path,
    *,
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    origin: str = "export",
    quantize: str | None = None,
) -> Path:
    """A DCP checkpoint (full or model-only, saved by any number of ranks), or an unquantized export
    (re-exported, e.g. to quantize it), -> a safetensors export.

    ``out`` is checked before any weight is read: it may not be, hold or lie inside the checkpoint
    folder (the ``step-<N>`` folder's parent) or the export read, and may hold nothing but a previous export."""
    checkpoint = Path(checkpoint)
    if (checkpoint / CONFIG_FILE).is_file():
        return _reexport(
            checkpoint, out, dtype=dtype, max_shard_bytes=max_shard_bytes, origin=origin, quantize=quantize
        )
    path = resolve_checkpoint(checkpoint, origin="checkpoint")
    keep_out_of = [path.parent] if STEP_RE.match(path.name) else [path]
    check_export_target(out, origin=origin, keep_out_of=keep_out_of)
    if quantize is not None:  # before the weights are read
        check_quantizable(ModelIdentity.from_json(read_meta(path)["model"]).name, quantize)
    tensors, meta = read_checkpoint_tensors(path)
    identity = ModelIdentity.from_json(meta["model"])
    check_identity_fits(path, identity, tensors)
    return write_export(
        tensors,
        identity,
        out,
        dtype=dtype,
        step=meta["step"],
        max_shard_bytes=max_shard_bytes,
        origin=origin,
        keep_out_of=keep_out_of,
        quantize=quantize,
    )


def check_identity_fits(path: Path, identity: ModelIdentity, tensors: dict[str, torch.Tensor]) -> None:
    """ValueError (one line, naming meta.json) unless the model that the checkpoint's saved args
    (``identity``) build has exactly ``tensors``' names and shapes: an export must not describe one
    model in its config.json and hold the weights of another."""
    where = path / "meta.json"
    try:
        model = registry.get("model", identity.name).build_on_meta(identity.build_args())
    except Exception as e:  # an unknown name, args this code refuses or that build no model
        raise ValueError(f"{where}: its model args build no model ({first_cause(e)}); export another step") from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    reshaped = sorted(k for k in set(expected) & set(tensors) if tuple(tensors[k].shape) != expected[k])
    problems = (
        [f"no tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")] if missing else []
    )
    problems += (
        [f"no such tensor as {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")] if extra else []
    )
    problems += [f"{k} is {tuple(tensors[k].shape)} where the args need {expected[k]}" for k in reshaped[:1]] + (
        [f"{len(reshaped) - 1} more of other shapes"] if len(reshaped) > 1 else []
    )
    if problems:
        raise ValueError(
            f"{where}: the {identity.name!r} model its args describe does not hold this checkpoint's tensors "
            f"({'; '.join(problems)}); meta.json was edited or belongs to another checkpoint: restore it or "
            "export another step"
        )


def _reexport(
    source: Path, out: Path, *, dtype: torch.dtype, max_shard_bytes: int, origin: str, quantize: str | None
) -> Path:
    """The export ``source`` written again into ``out`` (another dtype, or quantized)."""
    where, inside = Path(out).resolve(), source.resolve()
    if where == inside or inside in where.parents:
        raise ValueError(f"{origin}: {out} is or lies inside the export being read ({source}); give another folder")
    config = read_export_config(source)
    if read_method(config, source / CONFIG_FILE) is not None:
        raise ValueError(
            f"{source}: already quantized ({config['quantization']['method']}); export from its checkpoint "
            "or an unquantized export instead"
        )
    identity = ModelIdentity.from_json({**config["model"], "converters": config.get("trained_with_converters", [])})
    if quantize is not None:  # before the weights are read
        check_quantizable(identity.name, quantize)
    check_export_target(out, origin=origin)
    _, _, tensors = read_export(source)
    return write_export(
        tensors,
        identity,
        out,
        dtype=dtype,
        step=config.get("step"),
        max_shard_bytes=max_shard_bytes,
        origin=origin,
        quantize=quantize,
    )


def export_command(checkpoint: Path, out: Path, dtype: str = "float32") -> str:
    """The command line that writes the export of ``checkpoint`` to ``out``: this interpreter (the
    venv's) and this checkout's ``scripts/export_safetensors.py``, paths as the shell here sees them."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "export_safetensors.py"
    dtype_flag = [] if dtype == "float32" else ["--dtype", dtype]
    return shell_command(
        Path(sys.executable), script, "--checkpoint", Path(checkpoint), "--out", Path(out), *dtype_flag
    )


def read_export_config(path: Path) -> dict[str, Any]:
    """config.json of an export folder; FileNotFoundError / ValueError (one line) naming the folder or file."""
    path = Path(path)
    file = path / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE}; give a folder written by scripts/export_safetensors.py")
    try:
        config = json.loads(file.read_bytes().decode("utf-8"))
    except ValueError as e:  # bad JSON or bad UTF-8
        raise ValueError(f"{file}: not valid JSON ({e}); restore it or {REEXPORT}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a JSON object; restore it or {REEXPORT}")
    if config.get("format_version") != EXPORT_FORMAT_VERSION:
        raise ValueError(
            f"{file}: export format {config.get('format_version')!r}, this code reads {EXPORT_FORMAT_VERSION}"
        )
    return config


def load_export_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export folder (one file, or the shards its index names), under its FQN;
    a quantized export's weights as torchao's tensors (export_format.read_tensors)."""
    return read_tensors(Path(path), unflatten_quantized)


def _weights_file(path: Path, key: str | None = None) -> Path:
    """The safetensors file that holds ``key`` (or the export's weights file or index)."""
    if (path / INDEX_FILE).is_file():
        try:
            return path / json.loads((path / INDEX_FILE).read_text())["weight_map"][key]
        except Exception:  # an unreadable index, or a key it lacks: name the index itself
            return path / INDEX_FILE
    return path / WEIGHTS_FILE


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the export; ValueError naming the file that cannot be read."""
    try:
        return load_export_tensors(path)
    except (FileNotFoundError, DamagedQuantizedTensor):
        raise
    except Exception as e:  # safetensors' own error, bad index JSON, a file the index names but lacks
        files = [path / INDEX_FILE] if (path / INDEX_FILE).is_file() else []
        files += sorted(path.glob("*.safetensors"))
        bad = files[0] if files else path
        for file in files[len(files) > 1 and files[0].name == INDEX_FILE :]:
            try:
                safetensors.torch.load_file(file)
            except Exception:
                bad = file
                break
        text = str(e).strip().splitlines()
        raise ValueError(
            f"{bad}: unreadable ({type(e).__name__}: {text[-1] if text else ''}); restore it or {REEXPORT}"
        ) from None


def read_export(path: Path) -> tuple[dict[str, Any], nn.Module, dict[str, torch.Tensor]]:
    """config.json of the export folder ``path``, the model it names built on the meta device, and
    every tensor, each checked against the others: an export edited or damaged by hand (bad JSON,
    missing or mistyped args, an unknown model or flavor, a missing, extra, cut or reshaped tensor,
    non-finite weights) is a ValueError naming the file and the key or tensor, in one line."""
    path = Path(path)
    config = read_export_config(path)
    spec, args = read_model_block(config.get("model"), lambda name: registry.get("model", name), path / CONFIG_FILE)
    method = read_method(config, path / CONFIG_FILE)
    if method is not None:  # before reading: a missing torchao is not a damaged file
        require_torchao(path / CONFIG_FILE, method)
    try:
        model = spec.build_on_meta(args)
    except Exception as e:  # args of the right types whose values build no model (n_heads = 0, ...)
        raise ValueError(
            f"{path / CONFIG_FILE}: model.args build no {spec.name!r} model "
            f"({type(e).__name__}: {e}); restore it or {REEXPORT}"
        ) from None
    tensors = _read_tensors(path)
    check_quantized_files(path, method)  # once every file is known to be readable
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    extra = sorted(set(tensors) - set(expected))
    check_tensor_names(_weights_file(path, extra[0] if extra else None), set(expected), set(tensors))
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != shape:
            raise ValueError(
                f"{_weights_file(path, key)}: tensor {key} has shape {tuple(tensors[key].shape)}, "
                f"the model in {CONFIG_FILE} needs {shape}; restore it or {REEXPORT}"
            )
    bad = nonfinite_tensor(tensors, tensor_parts)
    if bad is not None:
        raise ValueError(nonfinite_problem(_weights_file(path, bad), bad))
    return config, model, tensors
