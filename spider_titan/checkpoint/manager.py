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
``load_step``), and log each newer one they pass over and why.

Crash safety: every rank writes into ``step-N.tmp-<token>``. ``dcp.save`` returns on rank 0 only
after it has gathered every rank's write results and written ``.metadata``, so at that point the
folder is whole: rank 0 adds ``meta.json`` and renames it to ``step-N``; the rename is the commit.
A folder is loaded only under its final name and with both ``.metadata`` and ``meta.json``.
keep_latest_k prunes after the commit, so it never deletes the newest complete checkpoint.

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

from spider_titan.checkpoint.export import full_model_state_dict, write_export
from spider_titan.checkpoint.layout import (
    FORMAT_VERSION,
    META_FILE,
    SINGLE_PROCESS_NOTICE,
    STEP_RE,
    TMP_RE,
    ModelIdentity,
    compare_identity,
    good_checkpoint_reason,
    is_complete,
    list_checkpoints,
    read_meta,
    resolve_checkpoint,
)
from spider_titan.models.common import DTYPES

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
            logger.info("rng: saved by %d ranks, this run has %d: every rank continues from rank 0's state", saved, world)
        torch.set_rng_state(cpu[idx].clone())
        if torch.cuda.is_available() and cuda[idx].numel():
            torch.cuda.set_rng_state(cuda[idx].clone())


# ---------------------------------------------------------------- checkpointer


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
        cfg,
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
            good = self._newest_good(at_most=cfg.load_step)
            if good is None:
                steps = [s for s, p in list_checkpoints(self.folder) if good_checkpoint_reason(p) is None]
                raise FileNotFoundError(
                    f"checkpoint.load_step = {cfg.load_step}: no complete, finite checkpoint at or before step "
                    f"{cfg.load_step} in {self.folder}; resumable steps there: {steps or 'none'}"
                )
            return self._load(good[1], model_only=False, origin="checkpoint.load_step")
        if cfg.enable:
            self._warn_incomplete()
            good = self._newest_good()
            if good is not None:
                return self._load(good[1], model_only=False, origin="resuming")
        if cfg.initial_load_path:
            origin = "checkpoint.initial_load_path"
            path = resolve_checkpoint(Path(cfg.initial_load_path), origin=origin,
                                      prefer_full=not cfg.initial_load_model_only)
            return self._load(path, model_only=cfg.initial_load_model_only, origin=origin)
        if cfg.enable:
            logger.info("checkpoint: no checkpoint in %s, starting from step 0", self.folder)
        return None

    def _newest_good(self, at_most: int | None = None, *, quiet: bool = False) -> tuple[int, Path] | None:
        """(step, path) of the newest checkpoint one may resume from (at or before ``at_most``),
        logging why each newer one was passed over."""
        for step, path in reversed(list_checkpoints(self.folder)):
            if at_most is not None and step > at_most:
                continue
            reason = good_checkpoint_reason(path)
            if reason is None:
                return step, path
            if not quiet and self.rank == 0 and not read_meta(path).get("model_only"):
                logger.warning("checkpoint: skipping %s: %s", path, reason)
        return None

    def latest_good(self) -> tuple[int, Path] | None:
        """(step, path) of the newest checkpoint this run could resume from, or None."""
        self.wait()
        return self._newest_good(quiet=True)

    def _load(self, path: Path, *, model_only: bool, origin: str) -> int:
        meta = read_meta(path)
        where = f"{origin}: {path}"
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
            saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
            shapes = {k: saved[f"rng.{k}"].size for k in ("cpu", "cuda") if f"rng.{k}" in saved and hasattr(saved[f"rng.{k}"], "size")}
            if len(shapes) != 2:
                raise ValueError(f"{where}: its RNG state is in an older format; start from its weights with "
                                 "checkpoint.initial_load_model_only = true")
            self.states["rng"].expect(shapes)
        t0 = time.perf_counter()
        try:
            dcp.load({k: self.states[k] for k in keys}, checkpoint_id=str(path), **self._dcp_kwargs())
        except (Exception, dcp.CheckpointException) as e:  # a BaseException wrapping every rank's failure
            raise ValueError(f"{where} cannot be loaded: {_first_cause(e)}") from e
        if self.rank == 0:
            logger.info(
                "checkpoint: loaded %s from %s (step %d) in %.2f s",
                "+".join(keys), path, meta["step"], time.perf_counter() - t0,
            )
            saved = meta.get("samples_per_step")
            if "dataloader" in keys and saved and self.samples_per_step and saved != self.samples_per_step:
                logger.info(
                    "dataloader: saved at %d samples per step, this run takes %d: continuing from global "
                    "sample %d of the same order, grouped into batches differently from here on",
                    saved, self.samples_per_step, self.states["dataloader"].state_dict()["samples_consumed"],
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
        save = _Save(step, self.folder / f"step-{step}.tmp-{self.token}", self.folder / f"step-{step}", meta,
                     time.perf_counter())
        if asynchronous:
            # Staging copies every tensor to CPU memory before this returns; training goes on
            # while a thread writes the copy.
            save.future = dcp.async_save(states, checkpoint_id=str(save.tmp), **self._dcp_kwargs())
            self.pending = save
            if self.rank == 0:
                logger.info("checkpoint: step %d staged in %.2f s, writing in the background",
                            step, time.perf_counter() - save.started)
        else:
            if self.rank == 0:  # a 1B checkpoint takes tens of seconds: say so before, not only after
                logger.info("checkpoint: writing step %d to %s ...", step, save.final)
            dcp.save(states, checkpoint_id=str(save.tmp), **self._dcp_kwargs())
            self._commit(save)

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
            good = self._newest_good(quiet=True)
            raise FloatingPointError(
                f"{what}: the model or optimizer state holds non-finite values; last good checkpoint: "
                f"{good[1] if good else 'none'}"
            )

    def wait(self) -> None:
        """Finish the save in flight, if any (its files written, then committed)."""
        if self.pending is not None:
            save, self.pending = self.pending, None
            save.future.result()
            self._commit(save)

    def _poll(self) -> None:
        if self.pending is not None and self.pending.future.done():
            self.wait()

    def _commit(self, save: _Save) -> None:
        """Rank 0: meta.json, then the rename that makes the checkpoint visible, then pruning."""
        if self.rank != 0:
            return
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
            save.final, "model only, " + save.meta["dtype"] if save.meta["model_only"] else "full",
            size / 1e6, took, size / 1e6 / max(took, 1e-9),
        )
        self._prune()

    def _prune(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        full = [p for _, p in list_checkpoints(self.folder) if not read_meta(p).get("model_only")]
        for path in full[:-k]:
            shutil.rmtree(path)
            logger.info("checkpoint: removed %s (keep_latest_k = %d)", path, k)

    def _warn_incomplete(self) -> None:
        if self.rank != 0 or not self.folder.is_dir():
            return
        for path in sorted(self.folder.iterdir()):
            if STEP_RE.match(path.name) and not is_complete(path):
                logger.warning("checkpoint: skipping %s: no .metadata or %s, not a complete checkpoint", path, META_FILE)

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
            write_export(tensors, self.identity, out, dtype=DTYPES[self.cfg.export_dtype], step=step)
            logger.info("export: wrote %s (%s) in %.2f s", out, self.cfg.export_dtype, time.perf_counter() - t0)

    def close(self) -> None:
        """Wait for the save in flight so the last checkpoint is committed before the process ends."""
        self.wait()


def _first_cause(e: BaseException) -> str:
    """One line for an exception, looking through DCP's per-rank wrapper."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))
        if isinstance(e, tuple):  # (exception, traceback) in some torch versions
            e = e[0]
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def build_checkpointer(cfg, run: "Run", train_state: Stateful) -> Checkpointer:
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
        cfg, states=states, identity=identity, dump_folder=run.dump_folder,
        samples_per_step=run.train_loader.global_batch_size * run.cfg.training.gradient_accumulation_steps,
    )
