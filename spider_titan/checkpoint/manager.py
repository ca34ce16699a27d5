"""DCP checkpoints: save every ``interval`` steps, resume from the newest complete one.

Layout, one folder per step, each readable on its own (no run config needed):

    <dump_folder>/<checkpoint.folder>/
        step-<N>/                    a complete checkpoint
            .metadata, __*_*.distcp  torch.distributed.checkpoint (DCP) files, one set per rank
            meta.json                format version, step, contents, model identity (name, flavor,
                                     resolved args), world size and samples per step when saved,
                                     and ``finite: true`` (every saved tensor was checked finite)
        step-<N>.tmp-<token>/        being written, or left by a crash: never loaded, removed at start

What is saved is the dict of Statefuls and nothing else:

    model         get_model_state_dict: plain FQNs; FSDP2 DTensor shards are resharded on load
    optimizer     get_optimizer_state_dict: state keyed by parameter FQN (resharded the same way)
    lr_scheduler  the LambdaLR counters
    dataloader    global samples consumed (the same for every world size, see data/loader.py)
    train_state   step and tokens seen
    rng           torch's RNG state of every rank (the Spider model samples boundary noise), as
                  uint8 tensors, so ``dcp_to_torch_save`` output loads with ``weights_only=True``

Never a non-finite state: before writing, every floating tensor of the model and optimizer state
is checked (one pass, all ranks agree); a non-finite one stops the save with FloatingPointError.
Auto-resume and ``load_step`` take the newest checkpoint marked finite (at or before
``load_step``) that loads, and log each newer one they pass over and why: one whose meta.json
is unreadable, whose files differ from the names, sizes and CRC-32s meta.json recorded (``files``;
each rank checks a share of the files), or whose ``.metadata`` or data fail to load (the ranks
gather their reasons, so all agree on the checkpoint they load).

Crash safety: every rank writes into ``step-N.tmp-<token>``. ``dcp.save`` returns on rank 0 only
after it has gathered every rank's write results and written ``.metadata``, so at that point the
folder is whole: rank 0 adds ``meta.json`` and renames it to ``step-N``; the rename is the commit.
A folder is loaded only under its final name and with both ``.metadata`` and ``meta.json``.
keep_latest_k prunes after the commit, so it never deletes the newest complete checkpoint; it
counts and deletes only checkpoints that pass those checks, and leaves damaged ones alone.

A save or export that fails for want of disk (ENOSPC, EDQUOT, EROFS, EACCES) removes its partial
folder and raises :class:`~spider_titan.errors.WriteFailed` with one line naming the folder and
the fix; the older checkpoints are untouched.

The final save with ``last_save_model_only`` holds the weights only, in ``export_dtype``; it is an
artefact, not a resume point: auto-resume picks the newest *full* checkpoint and pruning leaves
model-only folders alone. ``initial_load_model_only`` starts a new run from any checkpoint's
weights (fresh optimizer, step 0).

Start-up problems (missing, partial or mismatched checkpoints) raise FileNotFoundError or
ValueError with one line that names the path and the mismatch; ``train.main`` prints it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
import uuid
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from spider_titan.checkpoint.export import export_command, full_model_state_dict, write_export
from spider_titan.checkpoint.layout import (
    FORMAT_VERSION,
    META_FILE,
    SINGLE_PROCESS_NOTICE,
    TMP_RE,
    DamagedCheckpointError,
    ModelIdentity,
    checksum,
    compare_identity,
    damage_reason,
    damaged_files_reason,
    file_records,
    first_cause,
    good_checkpoint_reason,
    incomplete_reason,
    is_model_only,
    list_checkpoints,
    read_meta,
    resolve_checkpoint,
    share,
    step_folders,
)
from spider_titan.errors import StateMismatch, WriteFailed, _chain, describe_os_error, find_os_error
from spider_titan.job_config import Checkpoint as CheckpointConfig
from spider_titan.protocol import DTYPES

if TYPE_CHECKING:
    from spider_titan.components.builder import Run

logger = logging.getLogger("spider_titan")

# ---------------------------------------------------------------- Statefuls


class ModelState(Stateful):
    """The model's weights and persistent buffers under plain FQNs (FSDP2 shards stay DTensors)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """The optimizer's state keyed by parameter FQN, so it reshards like the model.

    An optimizer that holds other optimizers as attributes (Muon on the matrices + AdamW on the
    rest) is saved as its parts: DCP's optimizer helpers need torch's own state layout.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        parts = [v for v in vars(optimizer).values() if isinstance(v, torch.optim.Optimizer)]
        self.optimizers = parts or [optimizer]

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizers)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizers, state_dict)


class RNGState(Stateful):
    """torch's CPU (and CUDA) RNG state of every rank, gathered so one copy holds all of them.

    Saved as uint8 tensors of shape (ranks, state bytes), so any tool can read them (no pickled
    bytes). Resumed on the same number of ranks, rank r gets its own state back; on another
    number every rank takes rank 0's (all ranks seed alike and draw alike, so they agree anyway).
    Before a load, :meth:`expect` sets the shapes found in the checkpoint (DCP loads in place).
    """

    def __init__(self):
        self.expected: dict[str, torch.Size] | None = None

    @staticmethod
    def _mine() -> dict[str, torch.Tensor]:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.zeros(0, dtype=torch.uint8)
        return {"cpu": torch.get_rng_state(), "cuda": cuda}

    def state_dict(self) -> dict[str, Any]:
        if self.expected is not None:  # the template DCP loads into
            return {k: torch.zeros(shape, dtype=torch.uint8) for k, shape in self.expected.items()}
        mine = self._mine()
        if dist.is_initialized():
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        return {key: torch.stack([state[key] for state in everyone]) for key in mine}

    def expect(self, shapes: dict[str, torch.Size]) -> None:
        self.expected = shapes

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.expected = None
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        cpu, cuda = state_dict["cpu"], state_dict["cuda"]
        saved = len(cpu)
        idx = rank if saved == world else 0
        if saved != world and rank == 0:
            logger.info(
                "rng: saved by %d ranks, this run has %d: every rank continues from rank 0's state", saved, world
            )
        torch.set_rng_state(cpu[idx].clone())
        if torch.cuda.is_available() and cuda[idx].numel():
            torch.cuda.set_rng_state(cuda[idx].clone())


# ---------------------------------------------------------------- checkpointer


# What DCP's load planner raises for a key this run's state has and the checkpoint lacks.
_MISSING_KEY = re.compile(r"Missing key in checkpoint state_dict: (\S+?)\.?$")


def _missing_key(failure: BaseException | None) -> str | None:
    """The state key this run expected and the checkpoint does not hold, when that is why ``failure`` happened."""
    for e in _chain(failure):
        found = _MISSING_KEY.search(str(e).strip())
        if found:
            return found.group(1)
    return None


@dataclass
class _Save:
    """A save whose files are (being) written to ``tmp``; committed to ``final`` when done."""

    step: int
    tmp: Path
    final: Path
    meta: dict[str, Any]
    started: float
    future: Future | None = None


class Checkpointer:
    """Saves and restores ``states`` (name -> Stateful) under ``<dump_folder>/<cfg.folder>``.

    ``cfg`` is the [checkpoint] section. ``identity`` is written to every checkpoint and checked
    on load; ``samples_per_step`` (global batch x accumulation) is recorded so that a resume with
    another batch can say what happens to the data order.
    ``states["model"]`` must be a :class:`ModelState` (model-only saves and the export use it).
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        states: dict[str, Stateful],
        identity: ModelIdentity,
        dump_folder: Path,
        samples_per_step: int | None = None,
    ):
        self.cfg = cfg
        self.states = states
        self.identity = identity
        self.dump_folder = Path(dump_folder)
        self.folder = self.dump_folder / cfg.folder
        self.samples_per_step = samples_per_step
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.pending: _Save | None = None
        if self.distributed:
            # DCP's own collectives go through a gloo group: async saves run them in a background
            # thread, which must neither share the training group nor need CUDA tensors.
            self.group = dist.new_group(backend="gloo")
            token = [uuid.uuid4().hex[:8] if self.rank == 0 else None]
            dist.broadcast_object_list(token, src=0, group=self.group)
            self.token = token[0]
        else:
            self.group = None
            self.token = uuid.uuid4().hex[:8]
            # Installed for the process, not around each call: async saves warn from their thread.
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS_NOTICE)
        if cfg.enable and self.rank == 0:
            self._remove_partial()

    # ------------------------------------------------------------ load

    def load(self) -> int | None:
        """Restore the run when there is something to resume; the step restored, or None.

        Order: ``load_step`` (this run's folder) > the newest full checkpoint in this run's folder
        (when ``enable``) > ``initial_load_path`` (weights only with ``initial_load_model_only``).
        """
        cfg = self.cfg
        if cfg.load_step >= 0:
            step = self._resume(at_most=cfg.load_step, origin="checkpoint.load_step")
            if step is None:
                steps = [s for s, p in list_checkpoints(self.folder) if good_checkpoint_reason(p) is None]
                raise FileNotFoundError(
                    f"checkpoint.load_step = {cfg.load_step}: no complete, finite checkpoint at or before step "
                    f"{cfg.load_step} in {self.folder}; resumable steps there: {steps or 'none'}"
                )
            return step
        if cfg.enable:
            step = self._resume(origin="resuming")
            if step is not None:
                return step
        if cfg.initial_load_path:
            origin = "checkpoint.initial_load_path"
            path = resolve_checkpoint(
                Path(cfg.initial_load_path), origin=origin, prefer_full=not cfg.initial_load_model_only
            )
            return self._load(path, model_only=cfg.initial_load_model_only, origin=origin)
        if cfg.enable:
            logger.info("checkpoint: no checkpoint in %s, starting from step 0", self.folder)
        return None

    def _resume(self, *, origin: str, at_most: int | None = None) -> int | None:
        """Load the newest checkpoint (at or before ``at_most``) that loads; the step, or None when
        there is none to try. Incomplete and damaged ones are passed over alike, with a warning each;
        when none tried loads, ValueError naming each and why (a fresh start would train over them)."""
        failed = []
        for step, path in reversed(step_folders(self.folder)):
            if at_most is not None and step > at_most:
                continue
            reason = damage = incomplete_reason(path) or damage_reason(path)
            if damage is None:
                reason = good_checkpoint_reason(path)
            if reason is None:
                try:
                    return self._load(path, model_only=False, origin=origin)
                except DamagedCheckpointError as e:
                    reason = damage = str(e)
            if damage is not None:
                failed.append(damage)
            elif is_model_only(path):
                continue
            if self.rank == 0:
                logger.warning("checkpoint: skipping %s: %s", path, reason)
        if failed:
            raise ValueError(
                f"{origin}: no checkpoint in {self.folder} loads: {'; '.join(failed)}; this run will not train over "
                "them: restore their files, or give this run its own folder with --job.dump_folder <path>"
            )
        return None

    def _newest_good(self, at_most: int | None = None) -> tuple[int, Path] | None:
        """(step, path) of the newest checkpoint that passes the checks made without loading it."""
        for step, path in reversed(list_checkpoints(self.folder)):
            if (at_most is None or step <= at_most) and good_checkpoint_reason(path) is None:
                return step, path
        return None

    def _agree(self, problem: str | None) -> str | None:
        """The first rank's problem with a checkpoint, or None when every rank loaded it (one gather,
        at load time only): all ranks take the same decision, and rank 0 logs the reason."""
        if not self.distributed:
            return problem
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, problem, group=self.group)
        return next((p for p in everyone if p is not None), None)

    def latest_good(self) -> tuple[int, Path] | None:
        """(step, path) of the newest checkpoint this run could resume from, or None."""
        self.wait()
        return self._newest_good()

    def _load(self, path: Path, *, model_only: bool, origin: str) -> int:
        where = f"{origin}: {path}"
        problem: DamagedCheckpointError | None = None  # found on this rank; the ranks then agree
        try:
            meta = read_meta(path)
            files = list(meta.get("files", {}))
            damage = damaged_files_reason(path, meta, verify=share(files, self.rank, self.world_size))
            if damage is not None:
                raise DamagedCheckpointError(damage)
            saved = _read_dcp_metadata(path)
        except DamagedCheckpointError as e:
            problem = e
        agreed = self._agree(None if problem is None else str(problem))
        if agreed is not None:
            raise DamagedCheckpointError(agreed)
        diffs = compare_identity(ModelIdentity.from_json(meta["model"]), self.identity, where)
        if diffs and self.rank == 0:
            logger.warning("checkpoint %s: model args differ, the weights fit: %s", path, ", ".join(diffs))
        if meta.get("model_only") and not model_only:
            raise ValueError(
                f"{where} holds the model only (a final save); start from its weights with "
                "checkpoint.initial_load_model_only = true, or load a full checkpoint"
            )
        keys = ["model"] if model_only else list(self.states)
        missing = [k for k in keys if k not in meta["contents"]]
        if missing:
            raise ValueError(f"{where} has no {missing} (it holds {meta['contents']})")
        if "rng" in keys:
            shapes = {
                k: saved[f"rng.{k}"].size
                for k in ("cpu", "cuda")
                if f"rng.{k}" in saved and hasattr(saved[f"rng.{k}"], "size")
            }
            if len(shapes) != 2:
                raise ValueError(
                    f"{where}: its RNG state is in an older format; start from its weights with "
                    "checkpoint.initial_load_model_only = true"
                )
            self.states["rng"].expect(shapes)
        t0 = time.perf_counter()
        failure: BaseException | None = None
        try:
            dcp.load({k: self.states[k] for k in keys}, checkpoint_id=str(path), **self._dcp_kwargs())
        except (Exception, dcp.CheckpointException) as e:  # a BaseException wrapping every rank's failure
            failure = e
        mismatch = next((e for e in _chain(failure) if isinstance(e, StateMismatch)), None)
        if mismatch is not None:  # the checkpoint is fine: this run's settings differ from the saved ones
            raise ValueError(f"{where} does not fit this run: {mismatch}") from None
        absent = _missing_key(failure)
        if absent is not None:  # its files passed their checks: the state this run holds differs from the saved one
            raise ValueError(
                f"{where} does not fit this run: it holds no {absent} (its files are intact; it was saved under "
                f"other {absent.split('.')[0]} settings, e.g. another optimizer.name); resume with the settings it was "
                f"saved with, or start a new run from its weights with --checkpoint.initial_load_path {path} "
                "--checkpoint.initial_load_model_only true"
            ) from None
        agreed = self._agree(None if failure is None else f"{where} cannot be loaded: {first_cause(failure)}")
        if agreed is not None:
            raise DamagedCheckpointError(agreed) from failure
        if self.rank == 0:
            logger.info(
                "checkpoint: loaded %s from %s (step %d) in %.2f s",
                "+".join(keys),
                path,
                meta["step"],
                time.perf_counter() - t0,
            )
            saved = meta.get("samples_per_step")
            if "dataloader" in keys and saved and self.samples_per_step and saved != self.samples_per_step:
                logger.info(
                    "dataloader: saved at %d samples per step, this run takes %d: continuing from global "
                    "sample %d of the same order, grouped into batches differently from here on",
                    saved,
                    self.samples_per_step,
                    self.states["dataloader"].state_dict()["samples_consumed"],
                )
        return 0 if model_only else int(meta["step"])

    # ------------------------------------------------------------ save

    def save_due(self, step: int, *, last: bool = False, stopping: bool = False) -> bool:
        """Whether :meth:`maybe_save` with the same arguments (or :meth:`export_at_end`) will write anything."""
        cfg = self.cfg
        return (cfg.enable and (last or stopping or step % cfg.interval == 0)) or (last and cfg.export_at_end)

    def maybe_save(self, step: int, *, last: bool = False, stopping: bool = False) -> None:
        """Save when ``step`` is on the interval or the last one (then :meth:`export_at_end` follows).

        ``stopping``: the run ends early after this step (a signal): save a full checkpoint now,
        on the interval or not, and wait for it.
        """
        self._poll()
        cfg = self.cfg
        if cfg.enable and (last or stopping or step % cfg.interval == 0):
            if last and cfg.last_save_model_only:
                self.save(step, model_only=True)
            else:
                # the last save is synchronous: the process ends right after it
                self.save(step, asynchronous=cfg.async_mode == "async" and not (last or stopping))

    def export_at_end(self, step: int) -> None:
        """The end-of-run export to ``<dump_folder>/export``. Interrupted (KeyboardInterrupt: a stop
        signal), it leaves nothing half-written: what the writer had begun beside ``export`` is removed,
        and the previous export, if any, stays (unless the writer was caught between moving it away
        and moving the new one in: then nothing is touched)."""
        out = self.dump_folder / "export"
        before = set(self.dump_folder.iterdir()) if self.rank == 0 else set()
        try:
            self.export(out, step=step)
        except KeyboardInterrupt:
            if self.rank == 0 and out.exists() == (out in before):
                for path in set(self.dump_folder.iterdir()) - before:
                    if path.name.startswith(out.name) and path != out:
                        shutil.rmtree(path) if path.is_dir() else path.unlink()
                        logger.info("export: removed %s, left by the interrupted export", path)
            raise

    def save(self, step: int, *, model_only: bool = False, asynchronous: bool = False) -> None:
        """Write ``step-<step>`` (full, or the model only in ``export_dtype``); at most one save in flight."""
        self.wait()
        self.check_finite(f"step {step}: not saving a checkpoint")
        if model_only:
            dtype = DTYPES[self.cfg.export_dtype]
            states: dict[str, Any] = {"model": {k: v.to(dtype) for k, v in self.states["model"].state_dict().items()}}
        else:
            states = dict(self.states)
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "model_only": model_only,
            "dtype": self.cfg.export_dtype if model_only else None,
            "contents": list(states),
            "model": self.identity.to_json(),
            "world_size": self.world_size,
            "samples_per_step": self.samples_per_step,
            "finite": True,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        save = _Save(
            step, self.folder / f"step-{step}.tmp-{self.token}", self.folder / f"step-{step}", meta, time.perf_counter()
        )
        if asynchronous:
            # Staging copies every tensor to CPU memory before this returns; training goes on
            # while a thread writes the copy.
            save.future = dcp.async_save(states, checkpoint_id=str(save.tmp), **self._dcp_kwargs())
            self.pending = save
            if self.rank == 0:
                logger.info(
                    "checkpoint: step %d staged in %.2f s, writing in the background",
                    step,
                    time.perf_counter() - save.started,
                )
        else:
            if self.rank == 0:  # a 1B checkpoint takes tens of seconds: say so before, not only after
                logger.info("checkpoint: writing step %d to %s ...", step, save.final)
            try:
                dcp.save(states, checkpoint_id=str(save.tmp), **self._dcp_kwargs())
                self._commit(save)
            except (Exception, dcp.CheckpointException) as e:
                self._failed(save, e)

    def check_finite(self, what: str) -> None:
        """FloatingPointError when any floating tensor of the model or optimizer state is not
        finite on any rank (one pass over local shards, one all-reduce)."""
        model = self.states["model"].model
        tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
        optimizer = self.states.get("optimizer")
        if optimizer is not None:
            for opt in optimizer.optimizers:
                tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        flags: dict[torch.device, list[torch.Tensor]] = {}  # per device: one host read each, not one per tensor
        for t in tensors:
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.is_floating_point() and local.numel():
                flags.setdefault(local.device, []).append(torch.isfinite(local).all())
        finite = all(bool(torch.stack(f).all()) for f in flags.values())
        bad = torch.tensor([0 if finite else 1], dtype=torch.int64)
        if self.distributed:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        if bad.item():
            good = self._newest_good()
            raise FloatingPointError(
                f"{what}: the model or optimizer state holds non-finite values; last good checkpoint: "
                f"{good[1] if good else 'none'}"
            )

    def wait(self) -> None:
        """Finish the save in flight, if any (its files written, then committed)."""
        if self.pending is not None:
            save, self.pending = self.pending, None
            try:
                save.future.result()
                self._commit(save)
            except (Exception, dcp.CheckpointException) as e:
                self._failed(save, e)

    def _failed(self, save: _Save, e: BaseException) -> None:
        """A save that did not complete: remove its partial folder (rank 0), then raise WriteFailed
        for a cause outside the code (disk full, read-only, quota), else re-raise ``e``."""
        cause = find_os_error(e, self.folder)  # before the removal gives the space back
        if self.rank == 0:
            shutil.rmtree(save.tmp, ignore_errors=True)
        if cause is None:
            raise e
        raise WriteFailed(
            f"checkpoint step {save.step} not saved ({describe_os_error(cause, self.folder)}); "
            "the older checkpoints are intact"
        ) from e

    def _poll(self) -> None:
        if self.pending is not None and self.pending.future.done():
            self.wait()

    def _commit(self, save: _Save) -> None:
        """Rank 0: checksums of the files, meta.json, then the rename that makes the checkpoint
        visible, then pruning. Rank 0 reads every file back for the checksums (no collective: an
        async save is committed whenever rank 0 finds it done); at zlib's 6 GB/s that is 2-3 s
        for a 1B model's 12 GB with AdamW state, once per save, never per step."""
        if self.rank != 0:
            return
        crcs = {f.name: checksum(f) for f in save.tmp.iterdir() if f.is_file()}
        save.meta["files"] = file_records(save.tmp, crcs)  # checked before every load
        (save.tmp / META_FILE).write_text(json.dumps(save.meta, indent=1))
        if save.final.exists():  # the same step saved again (a run resumed from an earlier step)
            old = save.final.with_name(f"{save.final.name}.tmp-{self.token}-old")
            save.final.rename(old)
            save.tmp.rename(save.final)
            shutil.rmtree(old)
        else:
            save.tmp.rename(save.final)
        size = sum(f.stat().st_size for f in save.final.iterdir() if f.is_file())
        took = time.perf_counter() - save.started
        logger.info(
            "checkpoint: saved %s (%s, %.1f MB) in %.2f s, %.0f MB/s",
            save.final,
            "model only, " + save.meta["dtype"] if save.meta["model_only"] else "full",
            size / 1e6,
            took,
            size / 1e6 / max(took, 1e-9),
        )
        self._prune()

    def _prune(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        good = []
        for _, path in list_checkpoints(self.folder):
            damage = damage_reason(path)
            if damage is not None:
                logger.warning("checkpoint: keep_latest_k leaves %s alone, it is damaged: %s", path, damage)
            elif good_checkpoint_reason(path) is None:
                good.append(path)
        for path in good[:-k]:
            try:
                shutil.rmtree(path)
            except OSError as e:
                logger.warning("checkpoint: could not remove %s (keep_latest_k = %d): %s", path, k, e)
            else:
                logger.info("checkpoint: removed %s (keep_latest_k = %d)", path, k)

    def _remove_partial(self) -> None:
        if not self.folder.is_dir():
            return
        for path in sorted(self.folder.iterdir()):
            if TMP_RE.match(path.name) and path.is_dir():
                shutil.rmtree(path)
                logger.info("checkpoint: removed %s, left by an interrupted save", path)

    def _dcp_kwargs(self) -> dict[str, Any]:
        return {"process_group": self.group} if self.distributed else {"no_dist": True}

    # ------------------------------------------------------------ export, close

    def export(self, out: Path, *, step: int | None = None) -> None:
        """Write the live model as a safetensors export (every rank takes part; rank 0 writes)."""
        self.check_finite(f"step {step}: not exporting")
        t0 = time.perf_counter()
        tensors = full_model_state_dict(self.states["model"].model)
        if self.rank == 0:
            try:
                write_export(tensors, self.identity, out, dtype=DTYPES[self.cfg.export_dtype], step=step)
            except Exception as e:  # torch and safetensors report a short write in their own words
                self._export_failed(out, step, e)
            logger.info("export: wrote %s (%s) in %.2f s", out, self.cfg.export_dtype, time.perf_counter() - t0)

    def _export_failed(self, out: Path, step: int | None, e: Exception) -> None:
        cause = find_os_error(e, out)
        if cause is None:
            raise e
        saved = list_checkpoints(self.folder) if self.cfg.enable else []
        later = (
            (
                f"; the checkpoint {saved[-1][1]} is saved: export it later with "
                f"{export_command(saved[-1][1], out, self.cfg.export_dtype)}"
            )
            if saved
            else ""
        )
        raise WriteFailed(f"export at step {step} not written ({describe_os_error(cause, out)}){later}") from e

    def close(self) -> None:
        """Wait for the save in flight so the last checkpoint is committed before the process ends.

        One is in flight here only when the run stopped on another error (every normal end saves
        synchronously, after waiting): a failure of it is logged, not raised over that error."""
        try:
            self.wait()
        except WriteFailed as e:
            logger.error("%s", e)


def _read_dcp_metadata(path: Path) -> dict[str, Any]:
    """The DCP ``.metadata`` of a checkpoint (FQN -> what was saved); DamagedCheckpointError when it
    cannot be read (a cut or overwritten pickle fails in many ways, hence the broad except)."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        if not isinstance(metadata, dict):
            raise TypeError(f"holds a {type(metadata).__name__}")
        return metadata
    except Exception as e:
        raise DamagedCheckpointError(
            f"{path / '.metadata'}: unreadable ({first_cause(e)}); the checkpoint is damaged"
        ) from None


def build_checkpointer(cfg: CheckpointConfig, run: Run, train_state: Stateful) -> Checkpointer:
    """The run's Checkpointer over the Statefuls that must survive a restart (``cfg`` = [checkpoint])."""
    states: dict[str, Stateful] = {
        "model": ModelState(run.model),
        "optimizer": OptimizerState(run.model, run.optimizer),
        "lr_scheduler": run.lr_scheduler,
        "dataloader": run.train_loader,
        "train_state": train_state,
        "rng": RNGState(),
    }
    identity = ModelIdentity.of(run.spec.name, run.cfg.model.flavor, run.model_args, run.cfg.model.converters)
    return Checkpointer(
        cfg,
        states=states,
        identity=identity,
        dump_folder=run.dump_folder,
        samples_per_step=run.train_loader.global_batch_size * run.cfg.training.gradient_accumulation_steps,
    )
