"""The one place where component names map to their builders.

Every pluggable part of a run is chosen by name in the TOML file. The names live here, once,
as ``kind -> name -> Component("module:attribute", section)``; the attribute is imported only
when a run asks for it, so importing the registry has no side effects and optional heavy
dependencies (Triton, torchao) are only touched by the runs that use them. ``section`` names the
JobConfig section the component is handed (each component gets its own section, never the whole
config). Adding a component means adding a line here, or calling :func:`register` from outside;
the train loop never changes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Component:
    """One registered component.

    target:  ``"module:attribute"``, imported when a run asks for it
    section: the JobConfig section (attribute name) handed to it, None when it takes none
    """

    target: str
    section: str | None = None


COMPONENTS: dict[str, dict[str, Component]] = {
    # ModelSpec objects: how to build a model of that name, its flavors, its block containers.
    "model": {
        "dense": Component("spider_titan.models.dense.model:DENSE_SPEC", "model"),
        "spider": Component("spider_titan.models.spider.model:SPIDER_SPEC", "model"),
    },
    # build_optimizer(model, cfg: Optimizer) -> torch.optim.Optimizer
    "optimizer": {
        "AdamW": Component("spider_titan.optim.optimizers:build_adamw", "optimizer"),
        "Muon": Component("spider_titan.optim.optimizers:build_muon", "optimizer"),
    },
    # LR decay after warmup: (progress in [0, 1], cfg: LRScheduler) -> multiplier; the builder
    # hands the chosen one to build_lr_scheduler
    "lr_scheduler": {
        "linear": Component("spider_titan.optim.lr_schedulers:linear_decay", "lr_scheduler"),
        "cosine": Component("spider_titan.optim.lr_schedulers:cosine_decay", "lr_scheduler"),
        "wsd": Component("spider_titan.optim.lr_schedulers:wsd_decay", "lr_scheduler"),
    },
    # build_*_dataset(path: str | None, *, split: 'train' | 'val', seed: int) -> TokenDataset
    "dataset": {
        "bytes": Component("spider_titan.data.loader:build_bytes_dataset", "training"),
        "text": Component("spider_titan.data.loader:build_text_dataset", "training"),
        "builtin": Component("spider_titan.data.loader:build_builtin_dataset", "training"),
        "mock": Component("spider_titan.data.loader:build_mock_dataset", "training"),
    },
    # build_metric_logger(cfg: Metrics, *, log_dir, rank) -> MetricLogger
    "metric_logger": {
        "console": Component("spider_titan.metrics.logger:build_console_logger", "metrics"),
        "jsonl": Component("spider_titan.metrics.logger:build_jsonl_logger", "metrics"),
        "tensorboard": Component("spider_titan.metrics.logger:build_tensorboard_logger", "metrics"),
    },
    # apply_*(model, spec, dims, meshes, cfg: Parallelism, *, param_dtype, reduce_dtype, counter)
    # -> post-step hooks; applied to the materialised model. One that wraps the model's root in
    # FSDP2 casts the parameters with its MixedPrecisionPolicy (the builder then skips autocast)
    "parallelize": {
        "fsdp": Component("spider_titan.parallel.parallelize:apply_parallelism", "parallelism"),
    },
    # [model] converters: apply_*(model, spec, cfg) -> post-step hooks; swap modules in place after
    # building on meta (the spec says what the model asks of them, e.g. ModelSpec.acceleration.float8_skip_fqns)
    "converter": {
        "float8": Component("spider_titan.quantization.float8:apply_float8", "float8"),
    },
    # [moe] load_balance: apply_*(model, cfg: MoE) -> post-step hooks
    "load_balance": {
        "aux_loss": Component("spider_titan.moe.load_balance:apply_aux_loss_balancing", "moe"),
        "aux_free": Component("spider_titan.moe.load_balance:apply_aux_free_balancing", "moe"),
        "both": Component("spider_titan.moe.load_balance:apply_aux_free_balancing", "moe"),
    },
    # MoE backends: classes implementing spider_titan.moe.base.MoEBackend (build_map / expand /
    # reduce, and the static ``prepare(device)`` the builder calls before the first one is built)
    "moe_backend": {
        "torch": Component("spider_titan.moe.torch_backend:TorchMoEBackend", "moe"),
        "triton": Component("spider_titan.moe.triton_backend:TritonMoEBackend", "moe"),
    },
}


def register(kind: str, name: str, target: str, section: str | None = None) -> None:
    """Add (or replace) a component: how an extension outside this file plugs in
    (docs/extension.md). ``target`` is ``"module:attribute"``."""
    if kind not in COMPONENTS:
        raise KeyError(f"unknown component kind {kind!r}; kinds: {sorted(COMPONENTS)}")
    COMPONENTS[kind][name] = Component(target, section)


def names(kind: str) -> list[str]:
    """The registered names of one component kind, in registration order."""
    if kind not in COMPONENTS:
        raise KeyError(f"unknown component kind {kind!r}; kinds: {sorted(COMPONENTS)}")
    return list(COMPONENTS[kind])


def _entry(kind: str, name: str) -> Component:
    table = COMPONENTS.get(kind)
    if table is None:
        raise KeyError(f"unknown component kind {kind!r}; kinds: {sorted(COMPONENTS)}")
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {list(table)}")
    return table[name]


def get(kind: str, name: str) -> Any:
    """Import and return the builder registered as ``name`` for ``kind``.

    Raises ValueError naming the allowed choices when ``name`` is not registered.
    """
    module_name, attr = _entry(kind, name).target.split(":")
    return getattr(importlib.import_module(module_name), attr)


def section(kind: str, name: str, cfg: Any) -> Any:
    """The config section component ``name`` of ``kind`` takes, read from the JobConfig ``cfg``."""
    attr = _entry(kind, name).section
    return getattr(cfg, attr) if attr is not None else None
