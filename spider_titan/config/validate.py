"""Checking a parsed JobConfig: every rule a small function returning its problems, one line each
naming the key, the value and the fix. :func:`validate` runs them all, so a user sees every
problem at once. Rules that the parallel code also needs (degrees, expert split, FSDP) live once in
``parallel/mesh.py`` and are called from here.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

from spider_titan import registry
from spider_titan.config.parse import sections, show, table_keys
from spider_titan.job_config import JobConfig, Range
from spider_titan.optim.optimizers import parse_lr_multipliers, unmatched_prefixes
from spider_titan.parallel.mesh import ParallelDims, experts_split_problem, fsdp_problems, use_fsdp

# Config keys whose value names registered components (a list names several), with their
# registry kind: validate() checks them and --help lists the names they accept.
REGISTRY_KEYS: dict[str, str] = {
    "model.name": "model",
    "optimizer.name": "optimizer",
    "lr_scheduler.decay_type": "lr_scheduler",
    "training.dataset": "dataset",
    "moe.backend": "moe_backend",
    "model.converters": "converter",
    "parallelism.name": "parallelize",
}


def field_range(f: dataclasses.Field) -> Range:
    """The values a config field accepts (job_config.ranged); unbounded when it declares none."""
    return f.metadata.get("range", Range())


def range_problems(cfg: JobConfig) -> list[str]:
    """Every number field outside its declared :class:`Range`, or a float that is not finite."""
    problems = []
    for name, cls in sections().items():
        problems += out_of_range(name, getattr(cfg, name), table_keys(name, cls))
    return problems


def out_of_range(prefix: str, obj: Any, hints: dict[str, Any]) -> list[str]:
    """The int and float fields of dataclass ``obj`` (those in ``hints``, name -> type) outside their
    :class:`Range`, and its ``Literal`` fields outside their values, one line each as ``prefix.field``:
    for the config's sections and the model's args alike."""
    problems = []
    for f in dataclasses.fields(obj):
        tp = hints.get(f.name)
        value = getattr(obj, f.name)
        if tp in (int, float) and not field_range(f).allows(value):
            problems.append(f"{prefix}.{f.name} = {show(value)} is not allowed; use {field_range(f).describe(tp)}")
        elif typing.get_origin(tp) is typing.Literal and value not in typing.get_args(tp):
            problems.append(f"{prefix}.{f.name} = {value!r} is not one of {list(typing.get_args(tp))}")
    return problems


def registry_problems(cfg: JobConfig) -> list[str]:
    """Every key that names a component names a registered one."""
    problems = []
    for dotted, kind in REGISTRY_KEYS.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        for name in value if isinstance(value, list) else [value]:
            if name not in registry.names(kind):
                problems.append(f"{dotted}: {name!r} is not a registered {kind}; choose one of {registry.names(kind)}")
    return problems


def model_args_problems(spec: Any, args: Any, prefix: str = "model") -> list[str]:
    """Every problem of ``args``, model args of ``spec``: each field against its declared :class:`Range`
    (``job_config.ranged`` in the args dataclass), then the rules between fields (the args'
    ``validate()``), one line each as ``prefix.field``. The one check of model args: once per config
    parse (:func:`model_args_and_problems`), and for args read from a file."""
    problems = out_of_range(prefix, args, typing.get_type_hints(spec.args_cls))
    check = getattr(args, "validate", None)
    return problems + ([f"{prefix}.{p}" for p in check()] if check is not None else [])


def model_args_and_problems(cfg: JobConfig) -> tuple[Any, list[str]]:
    """The model's args (flavor + [model] overrides), or None, and their problems."""
    if cfg.model.name not in registry.names("model"):
        return None, []  # reported by registry_problems
    spec = registry.get("model", cfg.model.name)
    if cfg.model.flavor not in spec.flavors:
        return None, [
            f"model.flavor: {cfg.model.flavor!r} is not a flavor of {cfg.model.name}; choose one of {list(spec.flavors)}"
        ]
    args = spec.build_args(cfg.model.flavor, cfg.model.overrides)
    return args, model_args_problems(spec, args)


def training_problems(cfg: JobConfig, model_args: Any) -> list[str]:
    problems = []
    t = cfg.training
    # an unknown model name or flavor (model_args None) is reported by registry_problems / model_args_problems
    bound = registry.get("model", cfg.model.name).training.max_seq_len if model_args is not None else None
    max_seq_len = bound(model_args) if bound is not None else None
    if max_seq_len is not None and t.seq_len > max_seq_len:
        source = (
            "set in [model]"
            if "max_seq_len" in cfg.model.overrides
            else f"of {cfg.model.name} flavor {cfg.model.flavor!r}"
        )
        problems.append(
            f"training.seq_len = {t.seq_len} > model.max_seq_len = {max_seq_len} ({source}), the longest input the "
            f"model accepts; lower training.seq_len or set model.max_seq_len = {t.seq_len}"
        )
    if t.steps < 1 and t.target_tokens <= 0:
        problems.append(f"training.steps: {t.steps} must be >= 1 (or set training.target_tokens > 0)")
    if t.flops_budget > 0 and t.target_tokens > 0:
        problems.append(
            f"training.flops_budget = {show(t.flops_budget)} and training.target_tokens = {t.target_tokens} both "
            "set the run's length; keep one"
        )
    if t.dataset in ("bytes", "text") and not t.dataset_path:
        problems.append(
            f"training.dataset_path: required for training.dataset = {t.dataset!r}; set it to your data folder"
        )
    if not cfg.job.dump_folder.strip():
        problems.append(
            "job.dump_folder: empty; name the folder for the run's files, e.g. --job.dump_folder outputs/myrun"
        )
    if cfg.checkpoint.initial_load_model_only and not cfg.checkpoint.initial_load_path:
        problems.append("checkpoint.initial_load_model_only: needs checkpoint.initial_load_path")
    return problems


# Folders of a run's files that the config names relative to job.dump_folder (checkpoint.folder may be absolute).
RUN_SUBFOLDERS = ("checkpoint.folder", "metrics.save_tb_folder", "profiling.save_traces_folder")


def subfolder_problems(cfg: JobConfig) -> list[str]:
    """Each folder of :data:`RUN_SUBFOLDERS` is a folder of its own: not empty, not the dump folder itself
    nor one around it (``.``, ``..``, an absolute parent), where what it writes would mix with the run's
    other files and every later start would find the run folder holding files it does not know."""
    dump = Path(os.path.abspath(cfg.job.dump_folder)) if cfg.job.dump_folder.strip() else None
    problems = []
    for dotted in RUN_SUBFOLDERS:
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        default = getattr(getattr(JobConfig(), section), key)
        if not value.strip():
            problems.append(f"{dotted}: empty; name a folder of its own, e.g. {default!r} (the default)")
            continue
        if dump is None:
            continue
        where = Path(os.path.abspath(dump / value))
        if where == dump or where in dump.parents:
            how = "is the dump folder itself" if where == dump else f"holds the dump folder {dump}"
            problems.append(
                f"{dotted} = {value!r} {how}; its files would mix with the run's own and every later start "
                f"would refuse the folder: name a folder of its own, e.g. {default!r} (the default)"
            )
    return problems


def optimizer_problems(cfg: JobConfig, model_args: Any) -> list[str]:
    """``optimizer.lr_multipliers`` entries are PREFIX=FACTOR and every prefix names parameters of
    the model (built on the meta device, only when there are entries)."""
    rules, problems = parse_lr_multipliers(cfg.optimizer.lr_multipliers)
    if rules and not problems and model_args is not None:
        model = registry.get("model", cfg.model.name).build_on_meta(model_args)
        problems = unmatched_prefixes(rules, [n for n, _ in model.named_parameters()])
    return problems


def activation_checkpoint_problems(cfg: JobConfig) -> list[str]:
    ac = cfg.activation_checkpoint
    option = ac.selective_ac_option
    if ac.mode == "selective" and option != "op" and not (option.isdigit() and int(option) >= 1):
        return [f"activation_checkpoint.selective_ac_option: {option!r} must be 'op' or a positive integer"]
    if ac.mode == "memory_budget" and not cfg.training.compile:
        return [
            "activation_checkpoint.mode = 'memory_budget': the budget is applied by torch.compile's partitioner, "
            "so it needs training.compile = true (or use 'recurrent', 'full' or 'selective')"
        ]
    return []


def parallelism_problems(cfg: JobConfig, model_args: Any, world_size: int) -> list[str]:
    """The degrees against the world size, the experts against the EP degree, FSDP where it is
    needed: the rules of parallel/mesh.py, which the parallel code applies too."""
    par = cfg.parallelism
    dims = ParallelDims.from_config(par, world_size, check=False)
    problems = dims.problems()
    moe = registry.get("model", cfg.model.name).moe if model_args is not None else None
    if moe is not None:
        problem = experts_split_problem(moe.experts(model_args), par.expert_parallel_degree)
        if problem:
            problems.append(problem)
    problems.extend(fsdp_problems(par, dims))
    return problems


def float8_problems(cfg: JobConfig, world_size: int) -> list[str]:
    if not cfg.float8.enable_fsdp_float8_all_gather:
        return []
    if "float8" not in cfg.model.converters:
        return ['float8.enable_fsdp_float8_all_gather: needs the float8 converter (model.converters = ["float8"])']
    par = cfg.parallelism
    dims = ParallelDims.from_config(par, world_size, check=False)
    if not (world_size > 1 and use_fsdp(par, dims)):
        return [
            f"float8.enable_fsdp_float8_all_gather: needs FSDP, which is off (WORLD_SIZE={world_size}, "
            f"parallelism.fsdp = {par.fsdp!r}); launch with torchrun on 2+ ranks or set it to false"
        ]
    return []


def validate(cfg: JobConfig, *, env: Any) -> list[str]:
    """Every rule above; returns every problem found (``env`` gives WORLD_SIZE)."""
    world_size = int(env.get("WORLD_SIZE", "1"))
    model_args, model_problems = model_args_and_problems(cfg)
    problems = registry_problems(cfg) + model_problems + range_problems(cfg)
    problems += training_problems(cfg, model_args)
    problems += subfolder_problems(cfg)
    problems += optimizer_problems(cfg, None if model_problems else model_args)
    problems += activation_checkpoint_problems(cfg)
    problems += parallelism_problems(cfg, model_args, world_size)
    problems += float8_problems(cfg, world_size)
    if cfg.validation.ttt and not cfg.validation.enable:
        problems.append("validation.ttt: needs validation.enable = true (it runs after the final validation)")
    if cfg.validation.ttt and world_size > 1:
        problems.append(
            f"validation.ttt: runs on one process (WORLD_SIZE={world_size}); score the export with "
            "scripts/evaluate.py --ttt instead"
        )
    return problems
