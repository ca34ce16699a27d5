"""Reading a JobConfig: the TOML file, then ``--section.key value`` overrides, each value converted
to its field's type. Precedence (stated once): CLI ``--section.key value`` / ``--section.key=value``
> TOML > defaults. Problems are collected, not raised: :func:`spider_titan.config.manager.parse_args`
adds the validator's and reports them all together.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

try:  # Python >= 3.11: the standard library's (the lent GPU machine's Python has no tomli)
    import tomllib as tomli
except ModuleNotFoundError:  # Python 3.10
    import tomli

from spider_titan import registry
from spider_titan.job_config import JobConfig


def sections() -> dict[str, type]:
    """TOML table name -> dataclass."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


# ``Model.overrides`` holds the [model] keys that are the chosen model's own args: they stand in the
# [model] table directly, typed by the model's args dataclass, so the field itself is no key.
MODEL_ARGS_FIELD = "overrides"


# Keys that were renamed or folded into others: a config that still uses one gets the new spelling.
RENAMED_KEYS: dict[str, str] = {
    "parallelism.fsdp_enabled": "renamed to parallelism.fsdp (same values: auto, always, never)",
    "training.precision": (
        'removed: float8 is chosen by one list, model.converters = ["float8"] (float8.fallback = "warn" '
        'stays in bf16 where fp8 cannot run, as precision = "auto" did)'
    ),
}


def table_keys(section: str, cls: type) -> dict[str, Any]:
    """The keys a TOML table ``[section]`` holds for dataclass ``cls``, with their types (every
    typed field, less ``Model.overrides``, whose entries are keys of their own)."""
    hints = typing.get_type_hints(cls)
    return {k: tp for k, tp in hints.items() if not (section == "model" and k == MODEL_ARGS_FIELD)}


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


def type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if origin in (list, tuple):
        return f"list[{', '.join(type_name(a) for a in get_args(tp) if a is not Ellipsis)}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


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
        raise ValueError(f"expected {type_name(tp)}, got {value!r}")
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
            raise ValueError(f"expected a list of {type_name(item_tp)}, got {value!r}")
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


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if v is None:
        raise ValueError("TOML has no null")
    raise TypeError(f"cannot write {v!r} to TOML")


def show(value: Any) -> str:
    """A value as TOML writes it (``none`` for an unset optional)."""
    return "none" if value is None else toml_value(value)


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


def parse(argv: list[str]) -> tuple[JobConfig | None, list[str]]:
    """The JobConfig ``argv`` (without the program name) asks for, and every problem found reading
    it (unknown section or key, wrong type, bad choice); None when the config file itself cannot be
    read. Precedence: CLI > TOML > defaults."""
    pairs, problems = split_cli(argv)

    # 1) the TOML file, when one is named
    toml_data: dict[str, Any] = {}
    config_file = next((v for k, v in pairs if k == "job.config_file"), "")
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            return None, [f"job.config_file: {config_file!r} does not exist (give the path of a TOML file)"]
        try:
            toml_data = tomli.loads(path.read_bytes().decode("utf-8"))
        except OSError as e:
            return None, [f"job.config_file: cannot read {config_file!r} ({e.strerror}); check its permissions"]
        except UnicodeDecodeError as e:
            return None, [
                f"job.config_file: {config_file!r} is not UTF-8 text (byte {e.start}: "
                f"{e.object[e.start : e.start + 1]!r}); TOML files are UTF-8, save it as such"
            ]
        except tomli.TOMLDecodeError as e:
            return None, [f"job.config_file: {config_file!r} is not valid TOML: {e}"]

    cfg = JobConfig()
    secs = sections()
    raw_model_extra: dict[str, tuple[Any, bool, str]] = {}  # key -> (value, from_cli, origin)

    def assign(section: str, key: str, value: Any, *, from_cli: bool, origin: str) -> None:
        if section not in secs:
            problems.append(f"{origin}: unknown section [{section}]; sections: {', '.join(secs)}")
            return
        hints = table_keys(section, secs[section])
        if key not in hints:
            if section == "model":  # one of the model's own args, typed once the model is known
                raw_model_extra[key] = (value, from_cli, origin)
                return
            if f"{section}.{key}" in RENAMED_KEYS:
                problems.append(f"{origin}: {section}.{key} was {RENAMED_KEYS[f'{section}.{key}']}")
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

    # 2b) the run's length: steps given on the command line outrank the TOML's target_tokens (which
    # otherwise decide it), as every CLI key outranks the TOML; both on the command line is a conflict
    given = {dotted for dotted, _ in pairs}
    if "training.steps" in given and cfg.training.target_tokens > 0:
        if "training.target_tokens" in given:
            problems.append(
                f"--training.steps {cfg.training.steps} and --training.target_tokens {cfg.training.target_tokens} "
                "both set the run's length; keep one"
            )
        else:
            cfg.training.target_tokens = 0

    # 3) extra [model] keys are the model args' overrides, typed by the model's args dataclass
    model_fields = _model_args_fields(cfg.model.name)
    if model_fields is not None:
        for key, (value, from_cli, origin) in raw_model_extra.items():
            if key not in model_fields:
                retired = registry.get("model", cfg.model.name).saved.retired.get(key)
                if retired is not None:
                    problems.append(
                        f"{origin}: model.{key} has left {cfg.model.name} (last in {retired[1]}; "
                        "lab/DECISIONS.md says why); remove it"
                    )
                    continue
                problems.append(
                    f"{origin}: unknown key model.{key}; keys of [model]: name, flavor, converters, "
                    f"and the {cfg.model.name} args: {', '.join(model_fields)}"
                )
                continue
            try:
                cfg.model.overrides[key] = convert(value, model_fields[key], from_cli=from_cli)
            except ValueError as e:
                problems.append(f"{origin}: model.{key}: {e}")

    return cfg, problems
