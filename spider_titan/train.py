"""Entry point: parse config -> build the run -> train loop.

    torchrun --nproc_per_node=N -m spider_titan.train --job.config_file train_configs/<job>.toml [--section.key value ...]

The trainer is a straight line: ``Trainer.__init__`` builds everything through the builder, then
``train`` runs ``train_step`` until the step budget is spent, and ``main`` always calls ``close``.

Step health costs no host sync per step: every step folds "loss or gradient norm non-finite" and
"no label tokens in the global batch" into device-side flags (:class:`StepHealth`), which are read
at log steps, before every checkpoint and at the end. The first bad step stops the run with one
line naming it and the last good checkpoint (``training.skip_nonfinite_steps`` skips up to N
non-finite updates in a row instead, at the price of one sync per step).
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import signal
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from spider_titan.checkpoint import build_checkpointer
from spider_titan.components.builder import Run, build_run
from spider_titan.config.job_config import JobConfig
from spider_titan.config.manager import ConfigError, help_text, parse_args, to_toml
from spider_titan.data.shards import DataError
from spider_titan.metrics.logger import Throughput, format_duration, memory_gib, peak_flops, setup_logging
from spider_titan.models.common import IGNORE_INDEX
from spider_titan.parallel.fsdp import maybe_no_grad_sync
from spider_titan.parallel.utils import all_reduce_sum, clip_grad_norm_

logger = logging.getLogger("spider_titan")

LN2 = math.log(2.0)


class TrainState:
    """Step counter, tokens seen and training FLOPs spent: a Stateful, checkpointed with the run."""

    def __init__(self):
        self.step = 0
        self.tokens_seen = 0
        self.flops = 0.0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "flops": self.flops}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.flops = float(state.get("flops", 0.0))


class NonFiniteError(FloatingPointError):
    """A step's loss or gradient norm was not finite (or the model state is): the run stops."""


class NoLabelsError(ValueError):
    """A batch or split with no label tokens: there is nothing to learn from it."""


class StepHealth:
    """Device-side record of bad steps, read on the host only when asked (:meth:`read`).

    first_bad:   first step whose loss or gradient norm was non-finite (NONE: none yet)
    bad_loss, bad_norm: that step's loss (per label token, this rank's) and gradient norm
    first_empty: first step whose global batch held no label token (NONE: none yet)
    """

    NONE = 2**62

    def __init__(self, device: torch.device):
        self.first_bad = torch.full((), self.NONE, dtype=torch.int64, device=device)
        self.first_empty = torch.full((), self.NONE, dtype=torch.int64, device=device)
        self.bad_loss = torch.zeros((), device=device)
        self.bad_norm = torch.zeros((), device=device)

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, label_tokens: torch.Tensor) -> torch.Tensor:
        """Fold step ``step`` in. Returns "the gradient norm is non-finite": the same on every rank
        (the norm is all-reduced), so every rank takes the same skip decision on it."""
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        first = bad & (self.first_bad == self.NONE)
        self.first_bad = torch.where(first, step, self.first_bad)
        self.bad_loss = torch.where(first, loss.float(), self.bad_loss)
        self.bad_norm = torch.where(first, grad_norm.float(), self.bad_norm)
        self.first_empty = torch.where((label_tokens == 0) & (self.first_empty == self.NONE), step, self.first_empty)
        return ~torch.isfinite(grad_norm)

    def clear_nonfinite(self) -> None:
        """Forget a skipped non-finite step (``training.skip_nonfinite_steps``)."""
        self.first_bad.fill_(self.NONE)

    def read(self) -> tuple[int, int, float, float]:
        """(first_bad, first_empty, bad_loss, bad_norm), -1 for none: one sync, and one min
        all-reduce so every rank sees the earliest bad step of any rank."""
        steps = torch.stack([self.first_bad, self.first_empty])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(steps, op=dist.ReduceOp.MIN)
        first_bad, first_empty = (-1 if v == self.NONE else int(v) for v in steps.tolist())
        loss, norm = torch.stack([self.bad_loss, self.bad_norm]).tolist()
        return first_bad, first_empty, loss, norm


class StopSignal:
    """SIGTERM / SIGINT (preemption, Ctrl-C) ask the run to stop at the next step boundary.

    The handler only sets a flag; the train loop finishes its step, every rank agrees on the same
    stop step (a max all-reduce over a CPU gloo group, so no GPU sync per step), a checkpoint is
    written, and the process exits with 128 + the signal. A second signal interrupts at once.
    Handlers are installed by the command-line entry point only (:meth:`install`): a Trainer built
    inside another program (a test suite, a notebook) leaves that program's signals alone.
    """

    def __init__(self, world_size: int):
        self.signum: int | None = None
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.previous = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second one: stop now
            self.restore()
            raise KeyboardInterrupt
        self.signum = signum
        logger.warning("%s received: stopping after this step", signal.Signals(signum).name)

    def requested(self) -> bool:
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and self.signum is None:
            self.signum = int(flag.item())  # another rank was signalled
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


class Trainer:
    def __init__(self, cfg: JobConfig, *, command: str | None = None):
        self.cfg = cfg
        # How this run was started, quoted in messages that tell the user how to resume.
        self.command = command or "python -m spider_titan.train --job.config_file <config>"
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        setup_logging(self.rank)
        if self.world_size > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() and cfg.training.device != "cpu" else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        self.dump_folder = Path(cfg.job.dump_folder)
        if self.rank == 0:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
            (self.dump_folder / "config.toml").write_text(to_toml(cfg))
        torch.manual_seed(cfg.training.seed)

        self.run: Run = build_run(cfg, rank=self.rank, world_size=self.world_size, dump_folder=self.dump_folder)
        self.state = TrainState()
        # Restores model, optimizer, scheduler, data position, train state and RNG when resuming,
        # so the data iterator is made after it, from the restored loader.
        self.checkpointer = build_checkpointer(cfg.checkpoint, self.run, self.state)
        self.checkpointer.load()
        self.data_iter = iter(self.run.train_loader)
        self.stop = StopSignal(self.world_size)
        self.health = StepHealth(self.run.device)
        # Validation replays the same batches every time: remember where its loader starts.
        self.val_start = self.run.val_loader.state_dict() if self.run.val_loader is not None else None
        self.throughput = Throughput(self.run.device)
        self.best_val: tuple[float, int] | None = None  # (val bpb, step)
        self.skipped_in_a_row = 0  # non-finite updates skipped since the last good step
        self.log_start_block()

    def log_start_block(self) -> None:
        """Where this run writes what, and the shape of the job, once at start."""
        cfg, run, t = self.cfg, self.run, self.cfg.training
        ck = cfg.checkpoint
        d = self.dump_folder
        files = [("config.toml", f"the resolved config (rerun: --job.config_file {d / 'config.toml'})")]
        if cfg.metrics.enable_jsonl:
            files.append(("metrics.jsonl", "one JSON line per logged step and validation (scripts/plot.py draws it)"))
        if cfg.metrics.enable_tensorboard:
            tb = cfg.metrics.save_tb_folder
            files.append((f"{tb}/", f"TensorBoard (tensorboard --logdir {d / tb})"))
        if ck.enable:
            files.append((f"{ck.folder}/", f"DCP checkpoints every {ck.interval} steps and at the end; "
                                           "rerunning the same command resumes"))
        if ck.export_at_end:
            files.append(("export/", "safetensors export at the end (scripts/generate.py --model ...)"))
        width = max(len(name) for name, _ in files) + 2
        lines = [f"run folder {d}/"] + [f"  {name:<{width}}{what}" for name, what in files]
        lines.append(
            f"training {run.total_steps} steps: global batch {t.local_batch_size * t.gradient_accumulation_steps * run.parallel_dims.dp_degree}"
            f" x {t.seq_len} bytes ({t.local_batch_size} per rank x {t.gradient_accumulation_steps} accumulation x "
            f"{run.parallel_dims.dp_degree} ranks) on {run.device}"
        )
        for line in lines:
            logger.info(line)

    # ------------------------------------------------------------------ steps

    def _autocast(self):
        dtype = self.run.autocast_dtype
        return torch.autocast(self.run.device.type, dtype=dtype) if dtype is not None else nullcontext()

    def next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(inputs, labels, sample_ids)`` per micro-batch; sample_ids (passed to models whose spec
        asks for them) key training noise by global sample index (offset by the seed), independent
        of the parallel layout."""
        batches = []
        loader, device = self.run.train_loader, self.run.device
        for _ in range(self.cfg.training.gradient_accumulation_steps):
            ids = loader.next_sample_ids() + (self.cfg.training.seed << 40)
            inputs, labels = next(self.data_iter)
            batches.append((inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True), ids.to(device)))
        return batches

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], step: int) -> dict[str, torch.Tensor]:
        """Optimizer step ``step`` over ``micro_batches``; returns detached metrics (not yet reduced).

        The LM loss is normalised by the number of non-ignored labels over all micro-batches and
        ranks, so neither accumulation nor world size changes its scale: each rank backpropagates
        ``ce_sum * dp / N_global`` and FSDP's gradient average over dp ranks divides by dp again.
        Auxiliary losses are per-micro-batch means, averaged the same way.
        """
        run = self.run
        model = run.model
        model.train()
        dp = run.parallel_dims.dp_degree
        accum = len(micro_batches)
        local_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels, _ in micro_batches)
        label_tokens = all_reduce_sum(local_tokens.float())
        global_tokens = label_tokens.clamp(min=1.0)

        ce_total = torch.zeros((), device=run.device)
        aux_totals: dict[str, torch.Tensor] = {}
        for i, (inputs, labels, sample_ids) in enumerate(micro_batches):
            # FSDP reduce-scatters gradients on the last micro-batch only (once per step)
            with maybe_no_grad_sync(model, is_last_microbatch=i == accum - 1):
                extra = {"sample_ids": sample_ids} if "sample_ids" in run.spec.train_inputs else {}
                with self._autocast():
                    out = model(inputs, **extra)
                ce = run.spec.loss_sum(out.logits, labels)
                loss = ce * (dp / global_tokens)
                if out.aux_loss is not None:
                    loss = loss + out.aux_loss / accum
                loss.backward()
            ce_total += ce.detach()
            for key, value in out.aux.items():
                aux_totals[key] = aux_totals.get(key, 0) + value.detach().float() / accum

        grad_norm = clip_grad_norm_(list(model.parameters()), self.cfg.training.max_norm)
        bad = self.health.record(step, ce_total / global_tokens * dp, grad_norm, label_tokens)
        if self.cfg.training.skip_nonfinite_steps > 0 and bool(bad):  # the one sync this option costs
            self._skip_update(step)
        else:
            self.skipped_in_a_row = 0
            run.optimizer.step()
            for hook in run.post_step_hooks:
                hook()
        run.lr_scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)

        metrics = {"ce_sum": ce_total, "label_tokens": global_tokens, "grad_norm": grad_norm}
        metrics.update({f"aux.{k}": v for k, v in aux_totals.items()})
        return metrics

    def _skip_update(self, step: int) -> None:
        """Drop step ``step``'s update; past ``skip_nonfinite_steps`` of them in a row, stop."""
        self.skipped_in_a_row += 1
        limit = self.cfg.training.skip_nonfinite_steps
        if self.skipped_in_a_row > limit:
            self.check_health(step, why=f"{self.skipped_in_a_row} non-finite steps in a row, "
                                        f"training.skip_nonfinite_steps = {limit}")
        logger.warning("step %d: non-finite loss or gradient norm; update skipped (%d of at most %d in a row)",
                       step, self.skipped_in_a_row, limit)
        self.health.clear_nonfinite()

    def check_health(self, step: int, *, why: str = "") -> None:
        """Read the device-side flags (one sync); raise for a non-finite or empty step so far."""
        first_bad, first_empty, bad_loss, bad_norm = self.health.read()
        if first_empty >= 0:
            raise NoLabelsError(
                f"step {first_empty}: the global batch holds no label tokens (every target is PAD) in "
                f"{self.run.train_loader.dataset.description}; the data has nothing to learn there"
            )
        if first_bad >= 0:
            what = "loss" if not math.isfinite(bad_loss) else "gradient norm"
            raise NonFiniteError(
                f"step {first_bad}: non-finite {what} (loss {bad_loss:.4g}, grad norm {bad_norm:.4g}"
                f"{'; ' + why if why else ''}; detected at step {step}); {self._resume_hint()}"
            )

    def _resume_hint(self) -> str:
        """'last good checkpoint ...; resume with ...' for the one-line stop messages."""
        good = self.checkpointer.latest_good()
        if good is None:
            where = "no checkpoint was saved" if self.cfg.checkpoint.enable else "checkpoint.enable is false, nothing was saved"
            return f"{where}; lower optimizer.lr or set training.skip_nonfinite_steps and start again"
        step, path = good
        return (f"last good checkpoint {path}; resume from it with: {self.command} --checkpoint.load_step {step} "
                "(lower optimizer.lr or set training.skip_nonfinite_steps first)")

    def reduce_metrics(self, metrics: dict[str, torch.Tensor]) -> dict[str, float]:
        """Global means of the step's metrics (one all-reduce), as floats."""
        keys = sorted(k for k in metrics if k.startswith("aux."))
        local = torch.stack([metrics["ce_sum"]] + [metrics[k].reshape(()) for k in keys]).double()
        total = all_reduce_sum(local).tolist()
        ws = self.world_size
        lm_loss = total[0] / float(metrics["label_tokens"])
        out = {"loss": lm_loss, "bpb": lm_loss / LN2, "grad_norm": float(metrics["grad_norm"])}
        out.update({k[4:]: total[i + 1] / ws for i, k in enumerate(keys)})
        return out

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Loss and bits per byte on the validation split (the same batches every time), once per
        eval variant of the model (e.g. Spider at 1, 2, 4 loops); the plain variant also reports
        the model's own figures (``val_<aux key>``)."""
        run = self.run
        loader = run.val_loader
        variants = run.spec.eval_variants(run.model_args) if run.spec.eval_variants is not None else [("", {})]
        steps = self.cfg.validation.steps if self.cfg.validation.steps >= 0 else loader.num_windows // loader.global_batch_size
        run.model.eval()
        results: dict[str, float] = {}
        for suffix, kwargs in variants:
            ce, n = torch.zeros((), device=run.device), torch.zeros((), device=run.device)
            aux_sums: dict[str, torch.Tensor] = {}
            batches = 0
            loader.load_state_dict(self.val_start)
            for i, (inputs, labels) in enumerate(loader):
                if i >= max(steps, 1):
                    break
                inputs, labels = inputs.to(run.device), labels.to(run.device)
                with self._autocast():
                    out = run.model(inputs, **kwargs)
                ce += run.spec.loss_sum(out.logits, labels)
                n += (labels != IGNORE_INDEX).sum()
                batches += 1
                if not suffix:
                    for key, value in out.aux.items():
                        aux_sums[key] = aux_sums.get(key, 0) + value.detach().float()
            keys = sorted(aux_sums)
            total = all_reduce_sum(torch.stack([ce, n.float()] + [aux_sums[k] for k in keys]).double()).tolist()
            if total[1] == 0:
                raise NoLabelsError(
                    f"validation: {loader.dataset.description} holds no label tokens (every target is PAD) in "
                    f"its first {batches} batches; fix the val split or set validation.enable = false"
                )
            loss = total[0] / total[1]
            results[f"val_loss{suffix}"] = loss
            results[f"val_bpb{suffix}"] = loss / LN2
            for j, key in enumerate(keys):
                results[f"val_{key}"] = total[j + 2] / (batches * self.world_size)
        run.model.train()
        return results

    def _fold_flops(self) -> float:
        """Add the FLOPs of the steps since the last fold (all ranks) to the train state; returns them."""
        flops = all_reduce_sum(self.pending_flops).item()
        self.pending_flops.zero_()
        self.state.flops += flops
        return flops

    def train(self) -> None:
        run, cfg = self.run, self.cfg
        t = cfg.training
        local_tokens_per_step = t.local_batch_size * t.gradient_accumulation_steps * t.seq_len
        tokens_per_step = local_tokens_per_step * run.parallel_dims.dp_degree
        # FLOPs per byte: the model's own figure for the step actually run when it reports one
        # (Spider: from its segmentation), else the spec's formula. Summed on the device.
        formula_flops = run.spec.flops_per_token(run.model_args, t.seq_len)
        self.pending_flops = torch.zeros((), dtype=torch.float64, device=run.device)
        peak = peak_flops(run.device)
        start_step = self.state.step
        self.t_start = time.perf_counter()
        step_time: float | None = None  # smoothed seconds per training step (validation excluded)
        val_time = 0.0
        interval_flops = 0.0
        self.throughput.reset()
        while self.state.step < run.total_steps:
            step = self.state.step + 1
            metrics = self.train_step(self.next_micro_batches(), step)
            fpb = metrics.get("aux.flops_per_byte")
            self.pending_flops += (fpb.double() if fpb is not None else formula_flops) * local_tokens_per_step
            self.state.step = step
            self.state.tokens_seen += tokens_per_step
            self.throughput.add(tokens_per_step)
            last = step == run.total_steps
            log_now = step % cfg.metrics.log_freq == 0 or step == start_step + 1 or last
            val_now = run.val_loader is not None and (step % cfg.validation.freq == 0 or last)
            stopping = not last and self.stop.requested()
            save_now = self.checkpointer.save_due(step, last=last, stopping=stopping)
            if log_now or val_now or save_now:
                self.check_health(step)  # never log, validate or save past a bad step
                interval_flops += self._fold_flops()
            if log_now:
                scalars = self.reduce_metrics(metrics)
                tps, sps = self.throughput.rates()
                step_time = sps if step_time is None else 0.7 * step_time + 0.3 * sps
                remaining = run.total_steps - step
                vals_left = remaining // cfg.validation.freq + 1 if run.val_loader is not None and remaining else 0
                flops_per_byte = interval_flops / max(self.throughput.tokens, 1)
                scalars.update(
                    total_steps=run.total_steps,
                    elapsed_s=time.perf_counter() - self.t_start,
                    eta_s=remaining * step_time + vals_left * val_time,
                    lr=run.lr_scheduler.get_last_lr()[0],
                    tokens_per_s=tps,
                    tokens_seen=self.state.tokens_seen,
                    train_flops=self.state.flops,
                    tflops=flops_per_byte * tps / self.world_size / 1e12,
                    memory_gib=memory_gib(run.device),
                )
                if peak:
                    scalars["mfu"] = flops_per_byte * tps / self.world_size / peak
                run.metric_logger.log(step, scalars)
                self.throughput.reset()
                interval_flops = 0.0
            if val_now:
                t0 = time.perf_counter()
                val = self.validate()
                val_time = time.perf_counter() - t0
                val.update(tokens_seen=self.state.tokens_seen, train_flops=self.state.flops,
                           elapsed_s=time.perf_counter() - self.t_start)
                run.metric_logger.log(step, val)
                if self.best_val is None or val["val_bpb"] < self.best_val[0]:
                    self.best_val = (val["val_bpb"], step)
                self.throughput.reset()
                interval_flops = 0.0
            self.checkpointer.maybe_save(step, last=last, stopping=stopping)
            if stopping:
                if cfg.checkpoint.enable:
                    logger.warning("stopped at step %d with a checkpoint; run the same command to resume", step)
                else:
                    logger.warning("stopped at step %d; nothing saved (checkpoint.enable = false)", step)
                return
        self.log_end_block()

    def log_end_block(self) -> None:
        """What the run produced and how to use it, once at the end."""
        elapsed = time.perf_counter() - self.t_start
        logger.info("done: %d steps, %d bytes, %.3g training FLOPs in %s", self.state.step, self.state.tokens_seen,
                    self.state.flops, format_duration(elapsed))
        if self.best_val is not None:
            logger.info("best val bpb %.4f at step %d", *self.best_val)
        if self.cfg.metrics.enable_jsonl:
            logger.info("metrics: %s (plot: python scripts/plot.py %s)", self.dump_folder / "metrics.jsonl", self.dump_folder)
        good = self.checkpointer.latest_good()
        if good is not None:
            logger.info("last checkpoint: %s", good[1])
        if self.cfg.checkpoint.export_at_end:
            export = self.dump_folder / "export"
            logger.info("export: %s", export)
            logger.info("sample from it: python scripts/generate.py --model %s --prompt 'def ' --max_new_bytes 200",
                        export)

    def close(self) -> None:
        stop = getattr(self, "stop", None)
        if stop is not None:
            stop.restore()
        checkpointer = getattr(self, "checkpointer", None)
        if checkpointer is not None:
            checkpointer.close()
        run = getattr(self, "run", None)
        if run is not None:
            run.metric_logger.close()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


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
        for line in e.problems:
            print(f"config error: {line}", file=sys.stderr)
        return 2
    if "--print_config" in argv:  # the resolved config as TOML; nothing is built
        print(to_toml(cfg), end="")
        return 0
    command = "python -m spider_titan.train " + shlex.join(argv)
    trainer = None
    try:
        try:
            trainer = Trainer(cfg, command=command)
        except (ValueError, FileNotFoundError) as e:
            # Start-up problems caused by the config or the data: one line, no traceback.
            logger.debug("start-up failed", exc_info=True)
            print(f"error: {e}", file=sys.stderr)
            return 2
        if from_cli:
            trainer.stop.install()
        try:
            trainer.train()
        except (FloatingPointError, NoLabelsError) as e:  # a diverged run or empty data: say where
            if trainer.rank == 0:  # every rank stops at the same step with the same message
                print(f"error: {e}", file=sys.stderr)
            return 1
        except DataError as e:  # a bad token in a shard, seen by the rank that read it
            print(f"error: {e}", file=sys.stderr)
            return 1
        if trainer.stop.signum is not None:
            return 128 + trainer.stop.signum
    finally:
        if trainer is not None:
            trainer.close()
        elif dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
