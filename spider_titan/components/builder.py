"""Assemble a run from a JobConfig: every component, in one fixed order.

    1) parallel dims + device mesh
    2) data loaders (first, so a bad path or an unusable shard stops the run before any model work)
    3) model on the meta device (no memory), args = flavor + [model] overrides
    4) converters (e.g. float8) swap modules in place
    5) MoE backend set on every MoE layer
    6) activation checkpointing wraps blocks
    7) torch.compile per block
    8) materialise on the device + init_weights()
    9) parallelize: expert parallel, then FSDP2 / HSDP
    10) optimizer, 11) lr scheduler (over the steps, or over a FLOPs budget), 12) metric loggers
    (then the Trainer adds the checkpointer, which also needs its train state, and loads)

Why 8 before 9 (torchtitan materialises after sharding): a full-size init on every rank with the
same seed makes the initial weights independent of the parallel layout, so FSDP/HSDP/EP runs can
be compared bit for bit with a single process. DTensor's offset-based RNG gives that only on
CUDA. The cost is one unsharded fp32 copy per rank while starting (about 4 GB for the 1B flavors).

Each component gets only its own config section, the one its registry entry names
(``registry.section``). Components that must act after every optimizer step return post-step hooks
from their apply function; the builder collects them in ``Run.post_step_hooks`` and the train loop
runs them, so there is one such seam. The train loop only sees the ``Run``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spider_titan import registry
from spider_titan.data.loader import ByteDataLoader
from spider_titan.job_config import JobConfig, Parallelism
from spider_titan.metrics.logger import MetricLogger
from spider_titan.optim.lr_schedulers import FlopsBudget, build_lr_scheduler
from spider_titan.parallel.activation_checkpoint import apply_ac
from spider_titan.parallel.comm_counter import COMM_COUNTS_FILE, CommCounter
from spider_titan.parallel.compile import apply_compile
from spider_titan.parallel.fsdp import fsdp_wrapped
from spider_titan.parallel.mesh import ParallelDims
from spider_titan.parallel.precision import ComputeWeights, compute_precision
from spider_titan.protocol import DTYPES, ModelSpec, PostStepHook

logger = logging.getLogger("spider_titan")


@dataclass
class Run:
    """Everything the train loop needs, already assembled."""

    cfg: JobConfig
    device: torch.device
    rank: int
    world_size: int
    parallel_dims: ParallelDims
    meshes: dict[str, Any] | None
    spec: ModelSpec
    model_args: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: ByteDataLoader
    val_loader: ByteDataLoader | None
    metric_logger: MetricLogger
    total_steps: int  # with a FLOPs budget: the most steps the run may take
    autocast_dtype: torch.dtype | None
    compute_weights: ComputeWeights | None  # mixed_precision_mode "params", or cast_weights_once under autocast
    flops_budget: FlopsBudget | None  # training.flops_budget: the loop ends the run and the decay follows it
    # The one after-step seam: callables run after every optimizer step, in this order. Converters
    # (float8 scale precompute), the parallelize component (the comm counter's step) and load
    # balancers (the MoE bias update) each return theirs from their apply function; a hook may hand
    # back device scalars to log with the step (protocol.PostStepHook).
    post_step_hooks: list[PostStepHook] = field(default_factory=list)
    dump_folder: Path = Path(".")


def training_device(choice: str) -> torch.device:
    """``training.device`` (auto, cpu, cuda) as this rank's device: cuda is ``LOCAL_RANK``'s GPU."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("training.device: 'cuda' asked for but CUDA is not available; use 'auto' or 'cpu'")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def precision_dtypes(cfg: JobConfig, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(param/compute dtype, gradient-reduce dtype) for this device; CPU runs stay fp32."""
    if device.type == "cpu":
        if cfg.training.mixed_precision_param != "float32":
            logger.info("CPU run: parameters and compute stay fp32 (CPU bf16 matmuls are slower than fp32)")
        return torch.float32, torch.float32
    return DTYPES[cfg.training.mixed_precision_param], DTYPES[cfg.training.mixed_precision_reduce]


def total_steps(cfg: JobConfig, dp_degree: int) -> int:
    """``training.steps``, or enough steps to reach ``training.target_tokens``."""
    t = cfg.training
    if t.target_tokens > 0:
        per_step = t.local_batch_size * t.gradient_accumulation_steps * dp_degree * t.seq_len
        return math.ceil(t.target_tokens / per_step)
    return t.steps


def build_model(cfg: JobConfig, post_step_hooks: list[PostStepHook] | None = None) -> tuple[ModelSpec, Any, nn.Module]:
    """Steps 3-7: the model on the meta device, converted, with its MoE backend, AC and compile."""
    spec = registry.get("model", cfg.model.name)
    args = spec.build_args(cfg.model.flavor, model_args_overrides(cfg))
    # 3) build on meta
    model = spec.build_on_meta(args)
    # 4) converters; their post-step hooks go to ``post_step_hooks`` when a list is given
    for name in cfg.model.converters:
        hooks = registry.get("converter", name)(model, spec, registry.section("converter", name, cfg))
        if post_step_hooks is not None:
            post_step_hooks.extend(hooks)
    # 5) MoE backend
    backend_cls = registry.get("moe_backend", cfg.moe.backend)
    n_moe = apply_moe_backend(model, backend_cls())
    if n_moe:
        logger.info("MoE backend %r on %d layers", cfg.moe.backend, n_moe)
    # 6) activation checkpointing
    apply_ac(model, spec, cfg.activation_checkpoint)
    # 7) torch.compile
    if cfg.training.compile:
        apply_compile(model, spec)
    return spec, args, model


def model_args_overrides(cfg: JobConfig) -> dict[str, Any]:
    """[model] overrides, plus the [moe] loss weight for models that have one (``MoEPart.aux_loss_coeff``)."""
    overrides = dict(cfg.model.overrides)
    moe = registry.get("model", cfg.model.name).moe
    if moe is not None and moe.aux_loss_coeff is not None:
        coeff = 0.0 if cfg.moe.load_balance == "aux_free" else cfg.moe.aux_loss_coeff
        for key, value in moe.aux_loss_coeff(coeff).items():
            overrides.setdefault(key, value)
    return overrides


def planned_parallelism(cfg: JobConfig, spec: ModelSpec, args: Any) -> Parallelism:
    """[parallelism] as this run applies it: with capacity dispatch and ``expert_capacity_tokens = 0``,
    the capacity planned for one MoE call's tokens (local batch x seq_len x the model's MoE tokens per
    byte). A new section: the config as written (``config.toml``, its hash in ``run.json``) keeps 0."""
    par = cfg.parallelism
    if par.expert_parallel_dispatch != "capacity" or par.expert_capacity_tokens != 0:
        return par
    per_byte = spec.moe.tokens_per_byte(args) if spec.moe is not None else 1.0
    tokens = math.ceil(cfg.training.local_batch_size * cfg.training.seq_len * per_byte)
    logger.info("expert parallel: capacity dispatch planned for %d tokens per MoE call", tokens)
    return dataclasses.replace(par, expert_capacity_tokens=tokens)


def apply_moe_backend(model: nn.Module, backend) -> int:
    """Point every MoE layer at ``backend``; returns how many layers there are."""
    from spider_titan.moe.layer import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.backend = backend
    return len(layers)


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Step 8: allocate on ``device`` and initialise; the same seed on every rank."""
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        with torch.no_grad():
            model.init_weights()


def build_run(cfg: JobConfig, *, rank: int, world_size: int, dump_folder: Path) -> Run:
    # the datasets are read before anything else: a missing folder or an unusable shard is said in one
    # line before the device, the mesh or the MoE backend does any work (or logs a line)
    t = cfg.training
    build_dataset = registry.get("dataset", t.dataset)
    path = t.dataset_path or None
    train_data = build_dataset(path, split="train", seed=t.seed)
    val_data = build_dataset(path, split="val", seed=t.seed) if cfg.validation.enable else None

    device = training_device(cfg.training.device)
    param_dtype, reduce_dtype = precision_dtypes(cfg, device)

    # 1) parallel dims + device mesh
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    meshes = dims.build_meshes(device.type) if world_size > 1 else None

    registry.get("moe_backend", cfg.moe.backend).prepare(device)  # process-wide, before any backend is built

    # 2) data: every rank loads its own slice ("dp" covers all ranks)
    dp_rank = meshes["world"].get_local_rank() if meshes is not None else 0
    train_loader = ByteDataLoader(
        train_data,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dims.dp_degree,
        seed=t.seed,
        num_workers=t.num_workers,
        pin_memory=device.type == "cuda",  # the train loop's host-to-device copies are non_blocking
    )
    val_loader = None
    if cfg.validation.enable:
        val_loader = ByteDataLoader(
            val_data,
            seq_len=t.seq_len,
            local_batch_size=cfg.validation.local_batch_size or t.local_batch_size,
            dp_rank=dp_rank,
            dp_world_size=dims.dp_degree,
            seed=t.seed,
            pin_memory=device.type == "cuda",
        )

    # 3)-7) model on meta, converters, MoE backend, activation checkpointing, compile
    post_step_hooks: list[PostStepHook] = []  # run after every optimizer step, in this order
    spec, args, model = build_model(cfg, post_step_hooks)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model %s/%s: %.2f M parameters", cfg.model.name, cfg.model.flavor, n_params / 1e6)

    # 8) materialise + init (see the module docstring for why before parallelize)
    materialize(model, device, cfg.training.seed)

    # 9) parallelize; the comm counter (optional) closes its step in the post-step hooks
    counter = CommCounter(dump_folder / COMM_COUNTS_FILE) if cfg.parallelism.comm_counter else None
    parallelize = cfg.parallelism.name
    planned = dataclasses.replace(cfg, parallelism=planned_parallelism(cfg, spec, args))  # cfg itself stays as written
    post_step_hooks.extend(
        registry.get("parallelize", parallelize)(
            model,
            spec,
            dims,
            meshes,
            registry.section("parallelize", parallelize, planned),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            counter=counter,
        )
    )
    # FSDP's MixedPrecisionPolicy casts parameters itself; without it, the train step casts them
    # once per step as FSDP would (mixed_precision_mode "params"), or autocast does the job.
    casts = device.type == "cuda" and param_dtype != torch.float32 and not fsdp_wrapped(model)
    autocast_dtype, compute_weights = compute_precision(model, cfg.training, param_dtype if casts else None)

    # 10) optimizer, 11) lr scheduler
    optimizer = registry.get("optimizer", cfg.optimizer.name)(
        model, registry.section("optimizer", cfg.optimizer.name, cfg)
    )
    balance = cfg.moe.load_balance
    post_step_hooks.extend(registry.get("load_balance", balance)(model, registry.section("load_balance", balance, cfg)))
    steps = total_steps(cfg, dims.dp_degree)
    decay = registry.get("lr_scheduler", cfg.lr_scheduler.decay_type)
    budget = FlopsBudget(t.flops_budget) if t.flops_budget > 0 else None
    lr_scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, steps, decay, budget)

    # 12) metric loggers (rank 0 only unless asked otherwise)
    backends = []
    if rank == 0 or not cfg.metrics.rank_0_only:
        backends.append(registry.get("metric_logger", "console")(cfg.metrics, log_dir=dump_folder, rank=rank))
        if cfg.metrics.enable_jsonl:
            backends.append(registry.get("metric_logger", "jsonl")(cfg.metrics, log_dir=dump_folder, rank=rank))
        if cfg.metrics.enable_tensorboard:
            backends.append(
                registry.get("metric_logger", "tensorboard")(
                    cfg.metrics, log_dir=dump_folder / cfg.metrics.save_tb_folder, rank=rank
                )
            )

    return Run(
        cfg=cfg,
        device=device,
        rank=rank,
        world_size=world_size,
        parallel_dims=dims,
        meshes=meshes,
        spec=spec,
        model_args=args,
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        train_loader=train_loader,
        val_loader=val_loader,
        metric_logger=MetricLogger(backends),
        total_steps=steps,
        autocast_dtype=autocast_dtype,
        compute_weights=compute_weights,
        flops_budget=budget,
        post_step_hooks=post_step_hooks,
        dump_folder=dump_folder,
    )
