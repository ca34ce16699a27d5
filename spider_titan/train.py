"""Entry point: parse config -> build the run -> train loop.

    torchrun --nproc_per_node=N -m spider_titan.train --job.config_file train_configs/<job>.toml [--section.key value ...]

The trainer is a straight line: ``Trainer.__init__`` builds everything through the builder, then
``train`` runs ``train_step`` until the step budget is spent, and ``main`` always calls ``close``.
"""

from __future__ import annotations

import logging
import math
import os
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
from spider_titan.config.manager import ConfigError, help_text, parse_args, to_toml
from spider_titan.config.job_config import JobConfig
from spider_titan.metrics.logger import Throughput, memory_gib, peak_flops, setup_logging
from spider_titan.models.common import IGNORE_INDEX, lm_loss_sum
from spider_titan.parallel.utils import all_reduce_sum, clip_grad_norm_

logger = logging.getLogger("spider_titan")

LN2 = math.log(2.0)


class TrainState:
    """Step counter and tokens seen: a Stateful, checkpointed with the run."""

    def __init__(self):
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])


class StopSignal:
    """SIGTERM / SIGINT (preemption, Ctrl-C) ask the run to stop at the next step boundary.

    The handler only sets a flag; the train loop finishes its step, every rank agrees on the same
    stop step (a max all-reduce over a CPU gloo group, so no GPU sync per step), a checkpoint is
    written, and the process exits with 128 + the signal. A second signal interrupts at once.
    """

    def __init__(self, world_size: int):
        self.signum: int | None = None
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.previous = {}
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
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
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
        # Validation replays the same batches every time: remember where its loader starts.
        self.val_start = self.run.val_loader.state_dict() if self.run.val_loader is not None else None
        self.throughput = Throughput(self.run.device)
        t = cfg.training
        logger.info(
            "training %d steps: global batch %d x %d bytes (%d per rank x %d accumulation x %d ranks) on %s",
            self.run.total_steps,
            t.local_batch_size * t.gradient_accumulation_steps * self.run.parallel_dims.dp_degree,
            t.seq_len, t.local_batch_size, t.gradient_accumulation_steps, self.run.parallel_dims.dp_degree,
            self.run.device,
        )

    # ------------------------------------------------------------------ steps

    def _autocast(self):
        dtype = self.run.autocast_dtype
        return torch.autocast(self.run.device.type, dtype=dtype) if dtype is not None else nullcontext()

    def next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(inputs, labels, sample_ids)`` per micro-batch; sample_ids key the model's training
        noise by global sample index (offset by the seed), independent of the parallel layout."""
        batches = []
        loader, device = self.run.train_loader, self.run.device
        for _ in range(self.cfg.training.gradient_accumulation_steps):
            ids = loader.next_sample_ids() + (self.cfg.training.seed << 40)
            inputs, labels = next(self.data_iter)
            batches.append((inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True), ids.to(device)))
        return batches

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One optimizer step over ``micro_batches``; returns detached metrics (not yet reduced).

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
        global_tokens = all_reduce_sum(local_tokens.float()).clamp(min=1.0)

        ce_total = torch.zeros((), device=run.device)
        aux_totals: dict[str, torch.Tensor] = {}
        for inputs, labels, sample_ids in micro_batches:
            with self._autocast():
                out = model(inputs, sample_ids=sample_ids)
            ce = lm_loss_sum(out.logits, labels)
            loss = ce * (dp / global_tokens)
            if out.aux_loss is not None:
                loss = loss + out.aux_loss / accum
            loss.backward()
            ce_total += ce.detach()
            for key, value in out.aux.items():
                aux_totals[key] = aux_totals.get(key, 0) + value.detach().float() / accum

        grad_norm = clip_grad_norm_(list(model.parameters()), self.cfg.training.max_norm)
        run.optimizer.step()
        run.lr_scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        for hook in run.post_step_hooks:
            hook()

        metrics = {"ce_sum": ce_total, "label_tokens": global_tokens, "grad_norm": grad_norm}
        metrics.update({f"aux.{k}": v for k, v in aux_totals.items()})
        return metrics

    def reduce_metrics(self, metrics: dict[str, torch.Tensor]) -> dict[str, float]:
        """Global means of the step's metrics (one all-reduce), as floats."""
        keys = sorted(k for k in metrics if k.startswith("aux."))
        local = torch.stack([metrics["ce_sum"]] + [metrics[k].reshape(()) for k in keys]).float()
        total = all_reduce_sum(local)
        ws = self.world_size
        lm_loss = (total[0] / metrics["label_tokens"]).item()
        out = {"loss": lm_loss, "bpb": lm_loss / LN2, "grad_norm": float(metrics["grad_norm"])}
        out.update({k[4:]: (total[i + 1] / ws).item() for i, k in enumerate(keys) if k != "aux.lm_loss"})
        return out

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Loss and bits per byte on the validation split (the same batches every time)."""
        run = self.run
        loader = run.val_loader
        run.model.eval()
        ce, n = torch.zeros((), device=run.device), torch.zeros((), device=run.device)
        steps = self.cfg.validation.steps if self.cfg.validation.steps >= 0 else loader.num_windows // loader.global_batch_size
        loader.load_state_dict(self.val_start)
        for i, (inputs, labels) in enumerate(loader):
            if steps >= 0 and i >= steps:
                break
            inputs, labels = inputs.to(run.device), labels.to(run.device)
            with self._autocast():
                out = run.model(inputs)
            ce += lm_loss_sum(out.logits, labels)
            n += (labels != IGNORE_INDEX).sum()
        run.model.train()
        total = all_reduce_sum(torch.stack([ce, n.float()]))
        loss = (total[0] / total[1].clamp(min=1)).item()
        return {"val_loss": loss, "val_bpb": loss / LN2}

    def train(self) -> None:
        run, cfg = self.run, self.cfg
        t = cfg.training
        tokens_per_step = t.local_batch_size * t.gradient_accumulation_steps * run.parallel_dims.dp_degree * t.seq_len
        flops_per_token = run.spec.flops_per_token(run.model_args, t.seq_len)
        peak = peak_flops(run.device)
        self.throughput.reset()
        while self.state.step < run.total_steps:
            metrics = self.train_step(self.next_micro_batches())
            self.state.step += 1
            self.state.tokens_seen += tokens_per_step
            self.throughput.add(tokens_per_step)
            step = self.state.step
            if step % cfg.metrics.log_freq == 0 or step == 1 or step == run.total_steps:
                scalars = self.reduce_metrics(metrics)
                if not math.isfinite(scalars["loss"]):
                    raise FloatingPointError(f"step {step}: loss is {scalars['loss']}; lower optimizer.lr or check the data")
                tps, _ = self.throughput.rates()
                scalars.update(
                    lr=run.lr_scheduler.get_last_lr()[0],
                    tokens_per_s=tps,
                    tflops=flops_per_token * tps / self.world_size / 1e12,
                    memory_gib=memory_gib(run.device),
                )
                if peak:
                    scalars["mfu"] = flops_per_token * tps / self.world_size / peak
                run.metric_logger.log(step, scalars)
                self.throughput.reset()
            if run.val_loader is not None and (step % cfg.validation.freq == 0 or step == run.total_steps):
                run.metric_logger.log(step, self.validate())
                self.throughput.reset()
            stopping = step < run.total_steps and self.stop.requested()
            self.checkpointer.maybe_save(step, last=step == run.total_steps, stopping=stopping)
            if stopping:
                if cfg.checkpoint.enable:
                    logger.warning("stopped at step %d with a checkpoint; run the same command to resume", step)
                else:
                    logger.warning("stopped at step %d; nothing saved (checkpoint.enable = false)", step)
                return
        logger.info("done: %d steps, %d tokens", self.state.step, self.state.tokens_seen)

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
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        for line in e.problems:
            print(f"config error: {line}", file=sys.stderr)
        return 2
    trainer = None
    try:
        try:
            trainer = Trainer(cfg)
        except (ValueError, FileNotFoundError) as e:
            # Start-up problems caused by the config or the data: one line, no traceback.
            logger.debug("start-up failed", exc_info=True)
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            trainer.train()
        except FloatingPointError as e:  # a diverged run: say where, without a traceback
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
