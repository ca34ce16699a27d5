"""Entry point: parse config -> build the run -> train loop.

    torchrun --nproc_per_node=N -m spider_titan.train --job.config_file train_configs/<job>.toml [--section.key value ...]

The trainer is a straight line: ``Trainer.__init__`` builds everything through the builder, then
``train`` runs ``train_step`` until the run's steps (or its FLOPs budget) are spent, and ``main``
always calls ``close``.
The loop's helpers live in ``spider_titan/training/``: step health (bad steps are recorded on the
device and read where the loop syncs anyway), stop signals, the validation pass, the accounting
of tokens, FLOPs and rates, and the run's start and end report.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import re
import signal
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from spider_titan.checkpoint import build_checkpointer
from spider_titan.checkpoint.export import check_export_target, export_command
from spider_titan.checkpoint.layout import good_checkpoint_reason, is_complete, list_checkpoints
from spider_titan.checkpoint.lock import acquire_run_lock
from spider_titan.checkpoint.run_folder import claim_run_folder, record_run_end, write_run_record
from spider_titan.components.builder import Run, build_run
from spider_titan.config.help import help_text, to_toml
from spider_titan.config.manager import ConfigError, parse_args
from spider_titan.data.shards import DataError
from spider_titan.distributed import (
    all_reduce_sum,
    clip_grad_norm_,
    collective_failure,
    init_process_group,
    set_collective_timeout,
)
from spider_titan.errors import WriteFailed, describe_failure, free_bytes
from spider_titan.job_config import JobConfig
from spider_titan.metrics.logger import setup_logging, shell_command
from spider_titan.metrics.profiling import maybe_profile
from spider_titan.moe.layer import MoE
from spider_titan.parallel.fsdp import eval_pass, maybe_no_grad_sync
from spider_titan.parallel.mesh import destroy_process_groups
from spider_titan.training.calibration import Calibrator
from spider_titan.training.cuda_graph import FORWARD_BACKWARD, StepGraph, graph_blockers
from spider_titan.training.health import DropWatch, NoLabelsError, StepHealth
from spider_titan.training.progress import AUX, Progress, TrainState, reduce_metrics
from spider_titan.training.report import launch_command, log_end_block, log_start_block
from spider_titan.training.signals import Interrupted, ProgramSignals, StopSignal, second_signal_line
from spider_titan.training.ttt import ttt_validation
from spider_titan.training.validation import Validator
from spider_titan.vocab import IGNORE_INDEX

logger = logging.getLogger("spider_titan")


class Trainer:
    def __init__(self, cfg: JobConfig, *, command: str | None = None):
        self.cfg = cfg
        # How this run was started, quoted in messages that tell the user how to resume.
        self.command = command or shell_command(
            Path(sys.executable), "-m", "spider_titan.train", "--job.config_file", "<config>"
        )
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        setup_logging(self.rank)
        # What the run waits on in a collective now, for the line a lost or silent rank ends it with;
        # collectives wait comm.init_timeout_seconds until the first step is done, then the train timeout.
        self.doing = "start-up"
        self.timeout = ("comm.init_timeout_seconds", cfg.comm.init_timeout_seconds)
        if self.world_size > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() and cfg.training.device != "cpu" else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            init_process_group(backend, timeout_s=cfg.comm.init_timeout_seconds)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        self.dump_folder = Path(cfg.job.dump_folder)
        # One run per folder, before anything is written to it: the folder is this run's (new, or
        # its own to resume: checkpoint/run_folder.py), and the end-of-run export may not replace
        # anything but an export (checked now, not after hours of training).
        self.run_record: dict | None = None  # run.json (rank 0)

        def claim() -> None:
            config_hash = hashlib.sha256(to_toml(cfg).encode()).hexdigest()[:16]
            self.run_record = claim_run_folder(
                self.dump_folder, cfg, config_hash=config_hash, world_size=self.world_size
            )

        export_check = partial(
            check_export_target,
            self.dump_folder / "export",
            origin="checkpoint.export_at_end",
            keep_out_of=[self.dump_folder / cfg.checkpoint.folder],
        )
        self.run_lock = acquire_run_lock(
            self.dump_folder,
            rank=self.rank,
            distributed=self.world_size > 1,
            checks=[claim, export_check] if cfg.checkpoint.export_at_end else [claim],
        )
        torch.manual_seed(cfg.training.seed)

        self.run: Run = build_run(cfg, rank=self.rank, world_size=self.world_size, dump_folder=self.dump_folder)
        # refused here, before the run's record and config are written (a refused start leaves the folder as it was)
        self.step_graph = self._step_graph() if cfg.training.cuda_graph else None
        self.state = TrainState()
        # Restores model, optimizer, scheduler, data position, train state and RNG when resuming,
        # so the data iterator is made after it, from the restored loader.
        self.checkpointer = build_checkpointer(cfg.checkpoint, self.run, self.state)
        self.checkpointer.load()
        if self.rank == 0:  # the run has started: its record and config (a refused start leaves the folder as it was)
            write_run_record(self.dump_folder, self.run_record)
            (self.dump_folder / "config.toml").write_text(to_toml(cfg))
        if self.run.flops_budget is not None:
            self.run.flops_budget.spent = self.state.flops
        self.data_iter = iter(self.run.train_loader)
        self.stop = StopSignal(
            self.world_size,
            second_line=partial(
                second_signal_line,
                state=self.state,
                checkpoints=self.checkpointer.folder if cfg.checkpoint.enable else None,
                command=self.command,
            ),
        )
        run, t = self.run, cfg.training
        self.health = StepHealth(
            run.device,
            data=run.train_loader.dataset.description,
            skip_limit=t.skip_nonfinite_steps,
            latest_good=self.checkpointer.latest_good,
            saving=cfg.checkpoint.enable,
            command=self.command,
        )
        self.drops = DropWatch("the model's segment capacity (model.segment_capacity / packed_capacity)")
        # The model's eval passes: the same model, spec, device, precision and stop signal.
        evals = dict(device=run.device, autocast=self._eval_precision, stop=self.stop)
        # Validation replays the same batches every time, from where its loader stands now.
        self.validator = (
            Validator(
                run.model, run.spec, run.model_args, run.val_loader, cfg.validation, **evals, world_size=self.world_size
            )
            if run.val_loader is not None
            else None
        )
        # After the last step: eval-time settings fitted on the batches training would read next.
        micro_batches = run.total_steps * cfg.training.gradient_accumulation_steps
        self.calibrator = Calibrator(
            run.model,
            run.spec,
            run.model_args,
            run.train_loader,
            cfg.calibration,
            **evals,
            max_batches=micro_batches // 10,
        )
        self.progress = Progress(
            self.state,
            t,
            device=run.device,
            dp_degree=run.parallel_dims.dp_degree,
            world_size=self.world_size,
            total_steps=run.total_steps,
            budget=run.flops_budget,
            flops_per_byte=run.spec.flops_per_token(run.model_args, t.seq_len),
            val_freq=cfg.validation.freq if run.val_loader is not None else None,
            val_tokens=self.validator.pass_tokens() if self.validator is not None else 0,
        )
        self.best_val: tuple[float, int] | None = None  # (val bpb, step)
        set_collective_timeout(cfg.comm.init_timeout_seconds)  # every group made so far (meshes, the stop signal's)
        log_start_block(cfg, run, self.dump_folder)

    # ------------------------------------------------------------------ collectives

    @contextmanager
    def _waiting(self, doing: str, *, long: bool = False):
        """Collectives inside wait on ``doing`` (named by the line a lost or silent rank ends the run
        with); ``long``: for work slower than a step (a save, a validation, the end of the run), they
        wait comm.init_timeout_seconds, not the train timeout."""
        before, timeout = self.doing, self.timeout
        self.doing = doing
        if long and timeout[0] != "comm.init_timeout_seconds":
            self._set_timeout("comm.init_timeout_seconds", self.cfg.comm.init_timeout_seconds)
        yield  # left as it is when a collective fails inside: the line names it
        self.doing = before
        if self.timeout != timeout:
            self._set_timeout(*timeout)

    def _set_timeout(self, name: str, seconds: float) -> None:
        self.timeout = (name, seconds)
        if self.world_size > 1:
            set_collective_timeout(seconds)

    def collective_line(self, e: BaseException, kind: str) -> str:
        """The one line a failed collective (``kind``: ``timeout`` / ``lost``, see
        distributed.collective_failure) ends this rank with: its rank, the step, what it waited on,
        the newest complete checkpoint, and what happens next."""
        what = waited_for(kind, *self.timeout)
        signum = getattr(getattr(self, "stop", None), "signum", None)
        by = f"; {signal.Signals(signum).name} from the launcher" if signum is not None else ""
        ck = self.cfg.checkpoint
        kept = None
        if ck.enable and getattr(self, "checkpointer", None) is not None:
            kept = next(
                (
                    p
                    for _, p in reversed(list_checkpoints(self.checkpointer.folder))
                    if good_checkpoint_reason(p) is None
                ),
                None,
            )
        if kept is not None:
            saved = (
                f"the newest complete checkpoint is {kept}: torchrun --max-restarts resumes from it, as does "
                "the same command"
            )
        elif ck.enable:
            saved = "no complete checkpoint yet: a restart begins at step 0"
        else:
            saved = "nothing saved (checkpoint.enable = false)"
        return (
            f"rank {self.rank}: stopped at step {self.state.step}{by}, waiting in {self.doing}: {what} "
            f"[{first_line(e)}]; {saved}"
        )

    # ------------------------------------------------------------------ steps

    def _step_graph(self) -> StepGraph:
        """training.cuda_graph: the step's forwards and backwards as one graph; ValueError naming what
        this run lacks for it."""
        run = self.run
        graph_blockers_of = run.spec.acceleration.graph_blockers
        blockers = graph_blockers_of(run.model_args) if graph_blockers_of is not None else []
        compute_dtype = run.compute_weights.dtype if run.compute_weights is not None else run.autocast_dtype
        fp32_experts = compute_dtype in (None, torch.float32) and any(isinstance(m, MoE) for m in run.model.modules())
        missing = graph_blockers(
            device=run.device, world_size=self.world_size, model_blockers=blockers, fp32_experts=fp32_experts
        )
        if missing:
            raise ValueError("training.cuda_graph needs " + "; ".join(missing))
        return StepGraph(self._forward_backward, run.model)

    def _autocast(self):
        dtype = self.run.autocast_dtype
        if dtype is None:
            return nullcontext()
        # a CUDA graph may not keep autocast's cached casts past its capture
        return torch.autocast(self.run.device.type, dtype=dtype, cache_enabled=not self.cfg.training.cuda_graph)

    def _compute_weights(self):
        """The matmul weights cast once for everything inside (parallel/precision.py), when on."""
        weights = self.run.compute_weights
        return weights() if weights is not None else nullcontext()

    @contextmanager
    def _eval_precision(self):
        """An eval forward's precision: the train step's, weights cast once per call."""
        with self._compute_weights(), self._autocast():
            yield

    def next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(inputs, labels, sample_ids)`` per micro-batch; sample_ids (passed to models whose spec
        asks for them) key training noise by global sample index (offset by the seed), independent
        of the parallel layout."""
        batches = []
        loader, device = self.run.train_loader, self.run.device
        for _ in range(self.cfg.training.gradient_accumulation_steps):
            ids = loader.next_sample_ids().add_(self.cfg.training.seed << 40)  # in place: stays pinned
            inputs, labels = next(self.data_iter)
            batches.append(tuple(t.to(device, non_blocking=True) for t in (inputs, labels, ids)))
        return batches

    def _forward_backward(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], step: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The forwards and backwards of a step's micro-batches (gradients accumulated in ``.grad``):
        ``(ce_total, label_tokens, aux_totals)``, the labels counted over all ranks. What
        ``training.cuda_graph`` captures."""
        run = self.run
        model = run.model
        dp = run.parallel_dims.dp_degree
        accum = len(micro_batches)
        local_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels, _ in micro_batches)
        label_tokens = all_reduce_sum(local_tokens.float())
        global_tokens = label_tokens.clamp(min=1.0)
        ce_total = torch.zeros((), device=run.device)
        aux_totals: dict[str, torch.Tensor] = {}
        with self._compute_weights():  # one cast per weight for every micro-batch's forward and backward
            for i, (inputs, labels, sample_ids) in enumerate(micro_batches):
                # FSDP reduce-scatters gradients on the last micro-batch only (once per step)
                with maybe_no_grad_sync(model, is_last_microbatch=i == accum - 1):
                    extra = {"sample_ids": sample_ids} if "sample_ids" in run.spec.training.inputs else {}
                    if "step" in run.spec.training.inputs:  # keys per-step training randomness (Spider's loop count)
                        extra["step"] = step
                    with self._autocast():
                        out = model(inputs, **extra)
                    ce = run.spec.training.loss_sum(out.logits, labels)
                    loss = ce * (dp / global_tokens)
                    if out.aux_loss is not None:
                        loss = loss + out.aux_loss / accum
                    loss.backward()
                ce_total += ce.detach()
                for key, value in out.aux.items():
                    aux_totals[key] = aux_totals.get(key, 0) + value.detach().float() / accum
        return ce_total, label_tokens, aux_totals

    def train_step(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], step: int
    ) -> dict[str, torch.Tensor]:
        """Optimizer step ``step`` over ``micro_batches``, its tokens and FLOPs counted and the learning
        rate stepped; returns detached metrics (not yet reduced).

        The LM loss is normalised by the number of non-ignored labels over all micro-batches and
        ranks, so neither accumulation nor world size changes its scale: each rank backpropagates
        ``ce_sum * dp / N_global`` and FSDP's gradient average over dp ranks divides by dp again.
        Auxiliary losses are per-micro-batch means, averaged the same way.
        """
        run = self.run
        model = run.model
        model.train()
        fwd_bwd = self.step_graph if self.step_graph is not None else self._forward_backward
        with record_function(FORWARD_BACKWARD):  # what training.cuda_graph replays (lab/bench/gpu.py counts it)
            ce_total, label_tokens, aux_totals = fwd_bwd(micro_batches, step)
        global_tokens = label_tokens.clamp(min=1.0)
        grad_norm = clip_grad_norm_(list(model.parameters()), self.cfg.training.max_norm)
        step_reports: dict[str, torch.Tensor] = {}
        bad = self.health.record(step, ce_total / global_tokens * run.parallel_dims.dp_degree, grad_norm, label_tokens)
        if not self.health.skip_update(step, bad):  # reads ``bad`` only with training.skip_nonfinite_steps
            run.optimizer.step()
            for hook in run.post_step_hooks:
                reported = hook()  # None, or device scalars of this step (protocol.PostStepHook)
                if reported:
                    step_reports.update(reported)
        run.optimizer.zero_grad(set_to_none=True)

        metrics = {"ce_sum": ce_total, "label_tokens": global_tokens, "grad_norm": grad_norm}
        metrics.update({AUX + k: v for k, v in aux_totals.items()})
        metrics.update({AUX + k: v.detach().float() for k, v in step_reports.items()})
        self.progress.add_step(metrics)  # tokens, and FLOPs summed on the device
        if run.flops_budget is not None:  # the FLOPs spent set the learning rate and the last step: read every step
            self.progress.fold_flops()
            run.flops_budget.spent = self.state.flops
        run.lr_scheduler.step()
        return metrics

    def train(self) -> int:
        """Train to ``training.steps`` (or ``training.flops_budget``); the exit status: 0, or 128 + signal
        when a signal stopped the run. The loop runs inside the [profiling] window's profiler when one
        is asked for."""
        profiling = self.cfg.profiling
        first = self.state.step + 1
        with maybe_profile(
            profiling, self.dump_folder, self.rank, first_step=first, device_type=self.run.device.type
        ) as prof:
            return self._train_loop(prof)

    def _train_loop(self, profiler) -> int:
        run, cfg = self.run, self.cfg
        start_step = self.state.step
        self.progress.start()
        if 0 < start_step and self._trained():  # resumed at the last step (a stop there): its end-of-run work remains
            logger.info(
                "step %d, the last, is trained: its calibration, validation, final save and export follow", start_step
            )
            return self._end_of_run(start_step)
        budget = run.flops_budget
        while not self._trained():
            step = self.state.step + 1
            with self._waiting(f"step {step}'s collectives (forward, backward, gradients)"):
                metrics = self.train_step(self.next_micro_batches(), step)
            self.state.step = step
            if step == start_step + 1:  # the first step is done (FSDP's first gathers, compiles): the train timeout
                self._set_timeout("comm.train_timeout_seconds", cfg.comm.train_timeout_seconds)
            if profiler is not None:
                profiler.step()
            last = self._trained()
            if last and budget is not None and not budget.reached() and self.rank == 0:
                logger.warning(
                    "training.steps = %d reached at %.4g of training.flops_budget = %.4g FLOPs; raise "
                    "training.steps to spend the budget",
                    step,
                    budget.spent,
                    budget.budget,
                )
            log_now = step % cfg.metrics.log_freq == 0 or step == start_step + 1 or last
            val_now = self.validator is not None and (step % cfg.validation.freq == 0 or last)
            with self._waiting(f"the stop-signal check after step {step}"):
                stopping = self.stop.requested()  # at the last step too: its validation and export may take minutes
            save_now = self.checkpointer.save_due(step, last=last, stopping=stopping)
            with self._waiting(f"the metrics of step {step}"):
                if log_now or val_now or save_now:
                    self.health.check(step)  # never log, validate or save past a bad step
                    if budget is None:
                        self.progress.fold_flops()
                if log_now:
                    scalars = reduce_metrics(metrics, self.world_size)
                    scalars.update(self.progress.step_scalars(step, lr=run.lr_scheduler.get_last_lr()[0]))
                    run.metric_logger.log(step, scalars)
                    if self.rank == 0:
                        self.drops.log_step(step, scalars.get("segments_dropped"))
                    self.progress.new_interval()
            if stopping:
                return self._stop(step, ", the last (resuming runs its end-of-run work)" if last else "")
            if last:
                return self._end_of_run(step)
            if val_now:
                with self._waiting(f"the validation at step {step}", long=True):
                    val = self.progress.timed_validation(self.validator)
                if val is None:  # a signal during validation: abandoned, nothing of it reported
                    return self._stop(step, ", during its validation (not reported)")
                self._report_validation(step, val)
                self.progress.new_interval()
            with self._waiting(f"the checkpoint save of step {step}", long=True):
                self.checkpointer.maybe_save(step)
        return self._end_of_run(self.state.step)  # nothing to train (training.steps = 0)

    def _end_of_run(self, step: int) -> int:
        """The end of a trained run, written in this one place whether the last step was just trained
        or a resume found it trained: the calibration, the final validation, the final save, the export
        and the closing lines; the exit status. A stop signal during them ends the run through :meth:`_stop`
        (a resume then runs them again)."""
        with self._waiting(f"the end-of-run work after step {step}", long=True):
            if step > 0 and not self._calibrate(step):
                return self._stop(step, ", the last, during its calibration (not applied)")
            if step > 0 and self.validator is not None:
                val = self.progress.timed_validation(self.validator)
                if val is None:
                    return self._stop(step, ", the last, during the final validation (not reported)")
                self._report_validation(step, val)
                if self.cfg.validation.ttt:
                    self.run.metric_logger.log(step, self._ttt_validation())
            if step > 0:
                self.checkpointer.maybe_save(step, last=True)
            return self._export_at_end(step)

    def _ttt_validation(self) -> dict[str, float]:
        """``validation.ttt``: the val split's first documents without and with test-time training."""
        v, ds = self.cfg.validation, self.run.val_loader.dataset
        tokens = ds.window(0, min(ds.num_tokens, v.ttt_max_bytes or ds.num_tokens))
        with eval_pass(self.run.model):
            return ttt_validation(
                self.run.model,
                self.run.spec,
                tokens,
                seq_len=self.cfg.training.seq_len,
                batch_size=self.run.val_loader.local_batch_size,
                device=self.run.device,
                autocast=self._eval_precision,
            )

    def _trained(self) -> bool:
        """The run's length is reached: its steps, or its FLOPs budget."""
        budget = self.run.flops_budget
        return self.state.step >= self.run.total_steps or (budget is not None and budget.reached())

    def _calibrate(self, step: int) -> bool:
        """The end-of-run calibration (before the last validation, save and export, so all three see
        it; skipped when there are none); its figures are logged at ``step``. False when a stop signal
        cut it short (nothing applied)."""
        if not self.calibrator.active:
            return True
        ck = self.cfg.checkpoint
        if self.validator is None and not ck.enable and not ck.export_at_end:
            logger.info("calibration: skipped, nothing reads it (no validation, checkpoint or export)")
            return True
        figures = self.calibrator()
        if figures is None:
            return False
        if figures:
            self.run.metric_logger.log(step, figures)
        return True

    def _report_validation(self, step: int, val: dict[str, float]) -> None:
        val.update(self.progress.val_scalars(step))
        self.run.metric_logger.log(step, val)
        if self.best_val is None or val["val_bpb"] < self.best_val[0]:
            self.best_val = (val["val_bpb"], step)

    def _stop(self, step: int, where: str) -> int:
        """A signal stopped the run after ``step``: keep the model and say how to go on; the exit status.
        With checkpoints, a full checkpoint there (a resume point, also at the last step); without,
        the weights of ``step`` are exported (when the run exports at all), so a stop loses no training."""
        with self._waiting(f"the stop's save of step {step}", long=True):
            self.health.check(step)  # never save past a bad step
            self.checkpointer.maybe_save(step, stopping=True)
            ck = self.cfg.checkpoint
            exported = not ck.enable and ck.export_at_end
            if exported:  # well under a second at debug size; a second signal stops at once
                self.checkpointer.export_at_end(step)
        name = signal.Signals(self.stop.signum).name
        if self.rank == 0:
            record_run_end(self.dump_folder, self.run_record, state="stopped", step=step)
            if ck.enable:
                logger.warning(
                    "%s: stopped at step %d with a checkpoint (%s)%s; resume with: %s",
                    name,
                    step,
                    self.checkpointer.folder / f"step-{step}",
                    where,
                    self.command,
                )
            elif exported:
                logger.warning(
                    "%s: stopped at step %d%s; its weights are exported to %s (no resume point: "
                    "checkpoint.enable = false)",
                    name,
                    step,
                    where,
                    self.dump_folder / "export",
                )
            else:
                logger.warning("%s: stopped at step %d%s; nothing saved (checkpoint.enable = false)", name, step, where)
        return 128 + self.stop.signum

    def _export_at_end(self, step: int) -> int:
        """The end-of-run export (when asked for), then the closing lines; the exit status.

        With a checkpoint of ``step`` on disk, a signal before or during the export cuts it short
        (nothing half-written is left) and the run ends with 0 and the command that writes the
        export. Without one the export is all the run keeps, so it runs to its end whatever the
        first signal (a second one stops at once)."""
        ck = self.cfg.checkpoint
        if ck.export_at_end:
            saved = self.checkpointer.folder / f"step-{step}"  # written at the last step when checkpoints are on
            if not ck.enable:  # decided by the config, never by a folder rank 0 may not have renamed yet
                self._export_all_it_keeps(step)
                if self.stop.signum is not None and self.rank == 0:
                    logger.warning(
                        "%s received during the end-of-run export: the export was finished first (it is all "
                        "this run keeps); the run is complete",
                        signal.Signals(self.stop.signum).name,
                    )
            else:
                try:
                    if self.stop.requested():  # came during the final validation or save
                        raise Interrupted(self.stop.signum)
                    with self.stop.at_once():
                        self.checkpointer.export_at_end(step)
                except Interrupted:
                    out = self.dump_folder / "export"
                    write = export_command(saved, out, ck.export_dtype)
                    if self.rank == 0:
                        record_run_end(self.dump_folder, self.run_record, state="finished", step=step)
                        logger.warning(
                            "%s: the run is finished and saved (%s), but its export is incomplete (%s not "
                            "written); write it with: %s",
                            signal.Signals(self.stop.signum).name,
                            saved,
                            out,
                            write,
                        )
                    return 0
        if self.rank == 0:
            record_run_end(self.dump_folder, self.run_record, state="finished", step=step)
        elapsed = self.progress.elapsed()  # before latest_good(), which waits for a save in flight
        good = self.checkpointer.latest_good()
        final = self.checkpointer.folder / f"step-{step}"  # the last step's save (checkpoints on)
        log_end_block(
            self.cfg,
            self.state,
            self.dump_folder,
            elapsed=elapsed,
            best_val=self.best_val,
            final_save=final if ck.enable and step > 0 and is_complete(final) else None,
            resume_point=good[1] if good is not None else None,
        )
        return 0

    def _export_all_it_keeps(self, step: int) -> None:
        """The end-of-run export when it is all the run keeps (checkpoint.enable = false). When it cannot
        be written (a full disk), the weights go to the first of the temporary folders and the home
        folder that has room for them, and the run ends with one line saying where and how to move them
        into place; when none has room, the line says that the weights of ``step`` are lost and why."""
        failed: WriteFailed | None = None
        try:
            self.checkpointer.export_at_end(step)
        except WriteFailed as e:  # rank 0's, which writes it
            failed = e
        box: list = [str(failed) if failed is not None else None, None]
        if self.rank == 0 and failed is not None:
            need, box[1] = self._spare_export_folder(step)
            box.append(need)
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=self.stop.group)
        if box[0] is None:
            return
        why, spare = box[0], box[1]
        out = self.dump_folder / "export"
        if spare is None:
            raise WriteFailed(
                f"{why}; checkpoint.enable = false, so the trained weights of step {step} are lost: no temporary "
                f"or home folder has the {box[2] / 1e6:.0f} MB they need; free space on the disk of {out}, and "
                "turn checkpoints on (--checkpoint.enable true) to keep a resume point"
            ) from failed
        try:
            self.checkpointer.export(Path(spare), step=step)
        except WriteFailed as e:
            raise WriteFailed(
                f"{why}; checkpoint.enable = false, and the weights of step {step} could not be written to "
                f"{spare} either ({e}): they are lost"
            ) from failed
        raise WriteFailed(
            f"{why}; checkpoint.enable = false, so the weights of step {step} were exported to {spare} instead, "
            f"which has room: free space, then move them with: mv {spare} {out}"
        ) from failed

    def _spare_export_folder(self, step: int) -> tuple[int, str | None]:
        """(bytes the export needs, a new folder name with room for them, or None)."""
        itemsize = torch.empty((), dtype=getattr(torch, self.cfg.checkpoint.export_dtype)).element_size()
        need = sum(t.numel() for t in self.run.model.state_dict().values()) * itemsize
        places = [os.environ.get("TMPDIR"), tempfile.gettempdir(), "/var/tmp", str(Path.home())]
        run_id = (self.run_record or {}).get("run_id", "run")
        for place in dict.fromkeys(p for p in places if p):
            room = free_bytes(Path(place))
            if not Path(place).is_dir() or not os.access(place, os.W_OK) or room is None or room < need * 1.1 + 2**20:
                continue
            name = Path(place) / f"spider_titan-{run_id}-export-step-{step}"
            n = 1
            while name.exists():
                n += 1
                name = Path(place) / f"spider_titan-{run_id}-export-step-{step}-{n}"
            return need, str(name)
        return need, None

    def close(self) -> None:
        data_iter = getattr(self, "data_iter", None)
        if data_iter is not None:
            data_iter.close()  # DataLoader workers end now (data/loader.py), not 5 s into a later gc
        stop = getattr(self, "stop", None)
        if stop is not None:
            stop.restore()
        checkpointer = getattr(self, "checkpointer", None)
        if checkpointer is not None:
            checkpointer.close()
        run = getattr(self, "run", None)
        if run is not None:
            run.metric_logger.close()
        destroy_process_groups()
        lock = getattr(self, "run_lock", None)
        if lock is not None:
            lock.release()


def waited_for(kind: str, name: str, seconds: float) -> str:
    """What a failed collective of ``kind`` (distributed.collective_failure) means, under the timeout ``name``."""
    if kind == "timeout":
        return f"no answer from another rank within {name} = {seconds:g} s (it hangs, is stopped or is gone)"
    return "another rank is gone (its connection closed: the process died or was killed)"


def first_line(e: BaseException, limit: int = 200) -> str:
    """The library's own words for ``e``: its first sentence, without the source location gloo puts first."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text.splitlines()[0])
    return text.split(". ")[0][:limit]


def main(argv: list[str] | None = None) -> int:
    """The command line. Signal handlers (stop at a step boundary on SIGTERM / Ctrl-C) are
    installed only when ``argv`` is None, i.e. when run as a program, not called from Python."""
    from_cli = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text(argv))
        return 0
    try:
        cfg = parse_args([a for a in argv if a != "--print_config"])
    except ConfigError as e:
        # The same flags and files give every rank of a node the same problems: one rank says them.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            for line in e.problems:
                print(f"config error: {line}", file=sys.stderr)
        return 2
    if "--print_config" in argv:  # the resolved config as TOML; nothing is built
        print(to_toml(cfg), end="")
        return 0
    command = launch_command(argv)
    # SIGTERM / Ctrl-C: start-up unwinds, then the trainer stops at a step boundary, closing ends at once.
    signals = ProgramSignals(install=from_cli)
    trainer = None
    try:
        try:
            trainer = Trainer(cfg, command=command)
        except (ValueError, FileNotFoundError) as e:
            # Start-up problems caused by the config or the data: one line, no traceback.
            logger.debug("start-up failed", exc_info=True)
            print(f"error: {e}", file=sys.stderr)
            return 2
        except Interrupted as e:  # during start-up: nothing trained, nothing to save
            print(
                f"{e} received during start-up: stopped before training, nothing saved; run the same command "
                "to start again",
                file=sys.stderr,
            )
            return 128 + e.signum
        signals.hand_over(trainer.stop)
        try:
            code = trainer.train()
        except (FloatingPointError, NoLabelsError) as e:  # a diverged run or empty data: say where
            if trainer.rank == 0:  # every rank stops at the same step with the same message
                print(f"error: {e}", file=sys.stderr)
            return 1
        except DataError as e:  # a bad token in a shard, seen by the rank that read it
            print(f"error: {e}", file=sys.stderr)
            return 1
        if code:
            return code
    except Exception as e:  # a full or read-only disk, out of memory: one line naming it and the fix
        kind = collective_failure(e)
        if kind is not None:  # another rank is gone or silent: every rank left says so, with its rank
            logger.debug("collective failed", exc_info=True)
            if trainer is not None:
                print(f"error: {trainer.collective_line(e, kind)}", file=sys.stderr)
            else:
                what = waited_for(kind, "comm.init_timeout_seconds", cfg.comm.init_timeout_seconds)
                rank = os.environ.get("RANK", "0")
                print(f"error: rank {rank}: stopped during start-up: {what} [{first_line(e)}]", file=sys.stderr)
            signals.said = True  # torchrun now stops this worker too: that ends it without another line
            return 1
        line = describe_failure(e, f"step {trainer.state.step + 1}" if trainer is not None else "start-up")
        if line is None:
            raise
        logger.debug("failed", exc_info=True)
        if trainer is None or trainer.rank == 0 or not isinstance(e, WriteFailed):  # saves fail on every rank
            print(f"error: {line}", file=sys.stderr)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        else:
            destroy_process_groups()
        signals.take_back()  # a signal now ends the process at once, in one line (no KeyboardInterrupt mid-collect)
        # The model sits in reference cycles (FSDP's hooks), and through its meshes holds the process
        # groups: collected now, their threads end here rather than in the interpreter's shutdown
        # (parallel/mesh.py destroy_process_groups).
        trainer = None
        gc.collect()
        signals.restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
