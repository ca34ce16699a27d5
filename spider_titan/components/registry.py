"""The one place where component names map to their builders.

Every pluggable part of a run is chosen by name in the TOML file. The names live here, once,
as ``kind -> name -> "module:attribute"``; the attribute is imported only when a run asks for
it, so importing the registry has no side effects and optional heavy dependencies (Triton,
torchao) are only touched by the runs that use them. Adding a component means adding a line
here; the train loop never changes.
"""

from __future__ import annotations

import importlib
from typing import Any

COMPONENTS: dict[str, dict[str, str]] = {
    # ModelSpec objects: how to build a model of that name, its flavors, its block containers.
    "model": {
        "dense": "spider_titan.models.dense.model:DENSE_SPEC",
        "spider": "spider_titan.models.spider.model:SPIDER_SPEC",
    },
    # build_optimizer(model, cfg: OptimizerConfig) -> torch.optim.Optimizer
    "optimizer": {
        "AdamW": "spider_titan.optim.optimizers:build_adamw",
        "Muon": "spider_titan.optim.optimizers:build_muon",
    },
    # lr multiplier functions (step, cfg, total_steps) -> float
    "lr_scheduler": {
        "linear": "spider_titan.optim.lr_schedulers:linear_decay",
        "cosine": "spider_titan.optim.lr_schedulers:cosine_decay",
        "wsd": "spider_titan.optim.lr_schedulers:wsd_decay",
    },
    # build_*_dataset(path: str | None, *, split: 'train' | 'val', seed: int) -> TokenDataset
    "dataset": {
        "bytes": "spider_titan.data.loader:build_bytes_dataset",
        "text": "spider_titan.data.loader:build_text_dataset",
        "builtin": "spider_titan.data.loader:build_builtin_dataset",
        "mock": "spider_titan.data.loader:build_mock_dataset",
    },
    # build_metric_logger(cfg: MetricsConfig, *, log_dir, rank) -> MetricLogger
    "metric_logger": {
        "console": "spider_titan.metrics.logger:build_console_logger",
        "jsonl": "spider_titan.metrics.logger:build_jsonl_logger",
        "tensorboard": "spider_titan.metrics.logger:build_tensorboard_logger",
    },
    # apply_parallelism(model, spec, dims, meshes, cfg, *, param_dtype, reduce_dtype, dump_folder) -> CommCounter | None
    "parallelize": {
        "fsdp": "spider_titan.parallel.parallelize:apply_parallelism",
    },
    # apply_*(model, cfg) -> report: swap modules in place after building on meta; the report's
    # ``post_step_hooks`` (if any) run after every optimizer step
    "converter": {
        "float8": "spider_titan.quantization.float8:apply_float8",
    },
    # apply_*(model, cfg: MoEConfig) -> list of post-step hooks: [moe] load_balance
    "load_balance": {
        "aux_loss": "spider_titan.moe.load_balance:apply_aux_loss_balancing",
        "aux_free": "spider_titan.moe.load_balance:apply_aux_free_balancing",
        "both": "spider_titan.moe.load_balance:apply_aux_free_balancing",
    },
    # MoE backends: classes implementing spider_titan.moe.base.MoEBackend, with a static
    # ``prepare(device)`` for process-wide set-up before the first one is built
    "moe_backend": {
        "torch": "spider_titan.moe.torch_backend:TorchMoEBackend",
        "triton": "spider_titan.moe.triton_backend:TritonMoEBackend",
    },
}


def names(kind: str) -> list[str]:
    """The registered names of one component kind, in registration order."""
    if kind not in COMPONENTS:
        raise KeyError(f"unknown component kind {kind!r}; kinds: {sorted(COMPONENTS)}")
    return list(COMPONENTS[kind])


def get(kind: str, name: str) -> Any:
    """Import and return the builder registered as ``name`` for ``kind``.

    Raises ValueError naming the allowed choices when ``name`` is not registered.
    """
    table = COMPONENTS.get(kind)
    if table is None:
        raise KeyError(f"unknown component kind {kind!r}; kinds: {sorted(COMPONENTS)}")
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {list(table)}")
    module_name, attr = table[name].split(":")
    return getattr(importlib.import_module(module_name), attr)
