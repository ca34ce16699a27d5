"""Parse a JobConfig from TOML and command-line overrides, validate it, write it back out.

Precedence (stated once): CLI ``--section.key value`` / ``--section.key=value`` > TOML > defaults.
Every problem found (unknown section or key, wrong type, bad choice, inconsistent values) is
collected and raised together as one :class:`ConfigError`, whose lines each name the key, the
value and the fix. ``train.main`` prints them and exits with status 2, no traceback.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import tomli

from spider_titan.components import registry
from spider_titan.config.job_config import JobConfig, Range

# Config keys whose value names registered components (a list names several), with their
# registry kind: validate() checks them and --help lists the names they accept.
REGISTRY_KEYS: dict[str, str] = {
    "model.name": "model",
    "optimizer.name": "optimizer",
    "lr_scheduler.decay_type": "lr_scheduler",
    "training.dataset": "dataset",
    "moe.backend": "moe_backend",
    "model.converters": "converter",
}

# Registry kinds no key names: the builder picks them, for the reason given here (shown by --help).
BUILDER_CHOSEN: dict[str, str] = {
    "metric_logger": "console always; jsonl and tensorboard by metrics.enable_jsonl / metrics.enable_tensorboard",
    "parallelize": "always applied; what it does follows [parallelism] and the world size",
}


class ConfigError(ValueError):
    """One or more configuration problems; ``problems`` holds one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


# ---------------------------------------------------------------- introspection

def sections() -> dict[str, type]:
    """TOML table name -> dataclass."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, read from its source with ast."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if origin in (list, tuple):
        return f"list[{', '.join(_type_name(a) for a in get_args(tp) if a is not Ellipsis)}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------- value conversion

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def convert(value: Any, tp: Any, *, from_cli: bool) -> Any:
    """Convert ``value`` (a CLI string or a TOML value) to type ``tp``; ValueError explains why not."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = get_args(tp)
        if type(None) in members and (value is None or (from_cli and str(value).lower() in ("none", "null"))):
            return None
        errors = []
        for member in members:
            if member is type(None):
                continue
            try:
                return convert(value, member, from_cli=from_cli)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        v = value
        if from_cli or not isinstance(value, str):
            v = str(value)
        if v not in choices:
            raise ValueError(f"{value!r} is not one of {list(choices)}")
        return v
    if origin in (list, tuple):
        (item_tp, *_) = get_args(tp) or (str,)
        if from_cli and isinstance(value, str):
            text = value.strip().strip("[]")
            items = [s.strip().strip("'\"") for s in text.split(",") if s.strip()]
            return [convert(i, item_tp, from_cli=True) for i in items]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"expected a list of {_type_name(item_tp)}, got {value!r}")
        return [convert(i, item_tp, from_cli=from_cli) for i in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        raise ValueError(f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if from_cli:
            try:
                return int(str(value).replace("_", ""))
            except ValueError:
                pass
        raise ValueError(f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli:
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"expected a string, got {value!r}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise ValueError(f"expected a table, got {value!r}")
    raise ValueError(f"unsupported field type {tp!r}")


# ---------------------------------------------------------------- parsing

def split_cli(argv: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """``--a.b v`` / ``--a.b=v`` pairs in order, and the problems found while splitting."""
    pairs, problems = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            problems.append(f"argument {arg!r}: expected --section.key value (see --help)")
            i += 1
            continue
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            key = arg[2:]
            if i + 1 >= len(argv):
                problems.append(f"--{key}: missing value")
                break
            value = argv[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs, problems


def _model_args_fields(model_name: str) -> dict[str, Any] | None:
    """Type hints of the named model's args dataclass, or None when the model is unknown."""
    try:
        spec = registry.get("model", model_name)
    except (ValueError, ImportError):
        return None
    return typing.get_type_hints(spec.args_cls)


def parse_args(argv: list[str] | None = None, *, env: dict[str, str] | None = None) -> JobConfig:
    """Build and validate the JobConfig for ``argv`` (without the program name)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs, problems = split_cli(argv)

    # 1) the TOML file, when one is named
    toml_data: dict[str, Any] = {}
    config_file = next((v for k, v in pairs if k == "job.config_file"), "")
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError([f"job.config_file: {config_file!r} does not exist (give the path of a TOML file)"])
        try:
            toml_data = tomli.loads(path.read_bytes().decode("utf-8"))
        except OSError as e:
            raise ConfigError(
                [f"job.config_file: cannot read {config_file!r} ({e.strerror}); check its permissions"]
            ) from None
        except UnicodeDecodeError as e:
            raise ConfigError([f"job.config_file: {config_file!r} is not UTF-8 text (byte {e.start}: "
                               f"{e.object[e.start:e.start + 1]!r}); TOML files are UTF-8, save it as such"]) from None
        except tomli.TOMLDecodeError as e:
            raise ConfigError([f"job.config_file: {config_file!r} is not valid TOML: {e}"]) from None

    cfg = JobConfig()
    secs = sections()
    raw_model_extra: dict[str, tuple[Any, bool, str]] = {}  # key -> (value, from_cli, origin)

    def assign(section: str, key: str, value: Any, *, from_cli: bool, origin: str) -> None:
        if section not in secs:
            problems.append(f"{origin}: unknown section [{section}]; sections: {', '.join(secs)}")
            return
        cls = secs[section]
        hints = typing.get_type_hints(cls)
        if key not in hints or key == "overrides" and section == "model":
            if section == "model":
                raw_model_extra[key] = (value, from_cli, origin)
                return
            known = ", ".join(hints)
            problems.append(f"{origin}: unknown key {section}.{key}; keys of [{section}]: {known}")
            return
        try:
            setattr(getattr(cfg, section), key, convert(value, hints[key], from_cli=from_cli))
        except ValueError as e:
            problems.append(f"{origin}: {section}.{key}: {e}")

    for section, table in toml_data.items():
        if not isinstance(table, dict):
            problems.append(f"{config_file}: top-level key {section!r} must be a [table]")
            continue
        for key, value in table.items():
            assign(section, key, value, from_cli=False, origin=config_file)
    # 2) CLI overrides on top
    for dotted, value in pairs:
        section, _, key = dotted.partition(".")
        if "." in key:
            problems.append(f"--{dotted}: expected --section.key")
            continue
        assign(section, key, value, from_cli=True, origin=f"--{dotted}")

    # 3) extra [model] keys are the model args' overrides, typed by the model's args dataclass
    model_fields = _model_args_fields(cfg.model.name)
    if model_fields is not None:
        for key, (value, from_cli, origin) in raw_model_extra.items():
            if key not in model_fields:
                problems.append(
                    f"{origin}: unknown key model.{key}; keys of [model]: name, flavor, converters, "
                    f"and the {cfg.model.name} args: {', '.join(model_fields)}"
                )
                continue
            try:
                cfg.model.overrides[key] = convert(value, model_fields[key], from_cli=from_cli)
            except ValueError as e:
                problems.append(f"{origin}: model.{key}: {e}")

    problems.extend(validate(cfg, env=os.environ if env is None else env))
    if problems:
        raise ConfigError(problems)
    return cfg


# ---------------------------------------------------------------- validation

def field_range(f: dataclasses.Field) -> Range:
    """The values a config field accepts (job_config.ranged); unbounded when it declares none."""
    return f.metadata.get("range", Range())


def range_problems(cfg: JobConfig) -> list[str]:
    """Every number field outside its declared :class:`Range`, or a float that is not finite."""
    problems = []
    for name, cls in sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, value = hints[f.name], getattr(getattr(cfg, name), f.name)
            if tp in (int, float) and not field_range(f).allows(value):
                problems.append(f"{name}.{f.name} = {_show(value)} is not allowed; use {field_range(f).describe(tp)}")
    return problems


def validate(cfg: JobConfig, *, env: Any) -> list[str]:
    """Cross-field and component-name checks; returns every problem found."""
    problems = []

    for dotted, kind in REGISTRY_KEYS.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        for name in value if isinstance(value, list) else [value]:
            if name not in registry.names(kind):
                problems.append(f"{dotted}: {name!r} is not a registered {kind}; choose one of {registry.names(kind)}")

    model_args = None

    if cfg.model.name in registry.names("model"):
        spec = registry.get("model", cfg.model.name)
        if cfg.model.flavor not in spec.flavors:
            problems.append(
                f"model.flavor: {cfg.model.flavor!r} is not a flavor of {cfg.model.name}; choose one of {list(spec.flavors)}"
            )
        else:
            args = model_args = spec.build_args(cfg.model.flavor, cfg.model.overrides)
            check = getattr(args, "validate", None)
            if check is not None:
                problems.extend(f"model.{p}" for p in check())

    problems.extend(range_problems(cfg))
    t = cfg.training
    max_seq_len = getattr(model_args, "max_seq_len", None)
    if isinstance(max_seq_len, int) and t.seq_len > max_seq_len:
        source = ("set in [model]" if "max_seq_len" in cfg.model.overrides
                  else f"of {cfg.model.name} flavor {cfg.model.flavor!r}")
        problems.append(
            f"training.seq_len = {t.seq_len} > model.max_seq_len = {max_seq_len} ({source}), the longest input the "
            f"model accepts; lower training.seq_len or set model.max_seq_len = {t.seq_len}"
        )
    if t.steps < 1 and t.target_tokens <= 0:
        problems.append(f"training.steps: {t.steps} must be >= 1 (or set training.target_tokens > 0)")
    if t.dataset in ("bytes", "text") and not t.dataset_path:
        problems.append(f"training.dataset_path: required for training.dataset = {t.dataset!r}; set it to your data folder")
    if cfg.checkpoint.initial_load_model_only and not cfg.checkpoint.initial_load_path:
        problems.append("checkpoint.initial_load_model_only: needs checkpoint.initial_load_path")
    ac = cfg.activation_checkpoint
    option = ac.selective_ac_option
    if ac.mode == "selective" and option != "op" and not (option.isdigit() and int(option) >= 1):
        problems.append(
            f"activation_checkpoint.selective_ac_option: {ac.selective_ac_option!r} must be 'op' or a positive integer"
        )

    from spider_titan.parallel.mesh import ParallelDims, use_fsdp

    world_size = int(env.get("WORLD_SIZE", "1"))
    par = cfg.parallelism
    dims = ParallelDims.from_config(par, world_size, check=False)
    problems.extend(dims.problems())
    n_experts = getattr(model_args, "n_experts", None)
    if par.expert_parallel_degree > 1 and n_experts is not None and n_experts % par.expert_parallel_degree:
        problems.append(
            f"parallelism.expert_parallel_degree: n_experts({n_experts}) = experts_per_rank * "
            f"expert_parallel_degree({par.expert_parallel_degree}) has no whole-number experts_per_rank; "
            "choose a degree that divides the expert count"
        )
    if par.expert_parallel_degree > 1 and par.fsdp_enabled == "never":
        problems.append("parallelism.expert_parallel_degree > 1 needs FSDP; set parallelism.fsdp_enabled = \"auto\"")
    elif world_size > 1 and par.fsdp_enabled == "never":
        # FSDP is what averages gradients over the data-parallel ranks here; without it every
        # rank would silently train its own model.
        problems.append(
            f"parallelism.fsdp_enabled: 'never' with WORLD_SIZE={world_size} leaves the ranks' gradients "
            "unsynchronised; set it to \"auto\" or run one process"
        )
    fp8_all_gather = cfg.float8.enable_fsdp_float8_all_gather
    if fp8_all_gather and "float8" not in cfg.model.converters and t.precision != "fp8":
        problems.append("float8.enable_fsdp_float8_all_gather: needs the float8 converter (model.converters = [\"float8\"])")
    elif fp8_all_gather and not (world_size > 1 and use_fsdp(par, dims)):
        problems.append(
            f"float8.enable_fsdp_float8_all_gather: needs FSDP, which is off (WORLD_SIZE={world_size}, "
            f"parallelism.fsdp_enabled = {par.fsdp_enabled!r}); launch with torchrun on 2+ ranks or set it to false"
        )
    return problems


# ---------------------------------------------------------------- output

def to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The resolved config as TOML-shaped tables (model overrides folded into [model])."""
    out = {}
    for name in sections():
        table = dataclasses.asdict(getattr(cfg, name))
        if name == "model":
            table.update(table.pop("overrides"))
        out[name] = table
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if v is None:
        raise ValueError("TOML has no null")
    raise TypeError(f"cannot write {v!r} to TOML")


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that ``parse_args`` reads back to an equal JobConfig."""
    lines = []
    for name, table in to_dict(cfg).items():
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None)
        lines.append("")
    return "\n".join(lines)


INFO_FLAGS = ("--help", "-h", "--print_config")
"""Flags ``train.main`` handles before training: they ask for text, never start a run."""


def _show(value: Any) -> str:
    """A value as TOML writes it (``none`` for an unset optional)."""
    return "none" if value is None else _toml_value(value)


def _key_label(section: str, key: str, tp: Any) -> str:
    """What a key accepts: the registered names for registry keys, else its type."""
    kind = REGISTRY_KEYS.get(f"{section}.{key}")
    if kind is not None:
        names = "|".join(registry.names(kind))
        return f"list of {kind}: {names}" if get_origin(tp) in (list, tuple) else f"{kind}: {names}"
    if (section, key) == ("model", "flavor"):
        return "flavor of model.name: " + "; ".join(
            f"{m}: {'|'.join(registry.get('model', m).flavors)}" for m in registry.names("model")
        )
    return _type_name(tp)


def _resolve_for_help(argv: list[str]) -> tuple[JobConfig | None, list[str]]:
    """The config that ``argv`` (less the info flags) resolves to, or None and the problems."""
    rest = [a for a in argv if a not in INFO_FLAGS]
    if not rest:
        return None, []
    try:
        return parse_args(rest), []
    except ConfigError as e:
        return None, e.problems


def _model_table(spec: Any, resolved: Any | None) -> list[str]:
    """Every arg of one registered model with its value in each flavor (and in this config)."""
    hints = typing.get_type_hints(spec.args_cls)
    docs = field_docs(spec.args_cls)
    header = ["key", "type", *spec.flavors] + (["this config"] if resolved is not None else [])
    rows = []
    for key in hints:
        row = [f"--model.{key}", _type_name(hints[key])]
        row += [_show(getattr(args, key)) for args in spec.flavors.values()]
        if resolved is not None:
            row.append(_show(getattr(resolved, key)))
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        return "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    lines = [fmt(header)]
    for key, row in zip(hints, rows):
        lines.append(fmt(row))
        if docs.get(key):
            lines.append(f"      {docs[key]}")
    return lines


def help_text(argv: list[str] | None = None) -> str:
    """Every section and key with what it accepts, its default and its doc (what ``--help`` prints).

    Registry keys list their registered names; each model's args are a table of their value in
    every flavor. ``argv`` is the rest of the command line: when it names a config file or
    overrides, each key also shows the value they resolve to.
    """
    cfg, problems = _resolve_for_help(argv or [])
    lines = [
        "usage: python -m spider_titan.train [--job.config_file FILE] [--section.key value ...] [--print_config]",
        "Precedence: command line > TOML file > defaults. --section.key=value works too.",
        "--print_config prints the resolved config as TOML and exits without building anything;",
        "--help after a config file and overrides also shows the values they resolve to.",
        "",
    ]
    if cfg is not None:
        lines += ["Values of this config (as resolved from the command line) are shown after 'this config:'.", ""]
    for problem in problems:
        lines.append(f"config error (values of this config not shown): {problem}")
    if problems:
        lines.append("")
    for name, cls in sections().items():
        lines.append(f"[{name}]")
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        defaults = dataclasses.asdict(cls())
        resolved = dataclasses.asdict(getattr(cfg, name)) if cfg is not None else {}
        ranges = {f.name: field_range(f).text() for f in dataclasses.fields(cls)}
        for key in hints:
            if name == "model" and key == "overrides":
                continue
            shown = f"default {_show(defaults[key])}"
            if key in resolved and resolved[key] != defaults[key]:
                shown += f"; this config: {_show(resolved[key])}"
            label = _key_label(name, key, hints[key]) + (f", {ranges[key]}" if ranges[key] else "")
            lines.append(f"  --{name}.{key} ({label}; {shown})")
            if docs.get(key):
                lines.append(f"      {docs[key]}")
        lines.append("")
    for model_name in registry.names("model"):
        spec = registry.get("model", model_name)
        resolved_args = None
        if cfg is not None and cfg.model.name == model_name:
            resolved_args = spec.build_args(cfg.model.flavor, cfg.model.overrides)
        lines.append(f"[model] args of {model_name!r}: any of them set in [model] overrides the flavor's value")
        lines.extend(_model_table(spec, resolved_args))
        lines.append("")
    chosen_by = {kind: f"--{key}" for key, kind in REGISTRY_KEYS.items()} | BUILDER_CHOSEN
    lines.append("Registered components (spider_titan/components/registry.py):")
    width = max(map(len, registry.COMPONENTS))
    for kind in registry.COMPONENTS:
        lines.append(f"  {kind.ljust(width)}  {', '.join(registry.names(kind))}  ({chosen_by.get(kind, 'built in')})")
    return "\n".join(lines)
