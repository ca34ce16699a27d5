"""Writing a JobConfig back out: ``--help`` (every key with what it accepts, its default, its doc
and the value this command line resolves it to), and the resolved config as TOML
(``--print_config`` and ``<dump_folder>/config.toml``, which ``parse_args`` reads back equal).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, get_origin

from spider_titan import registry
from spider_titan.config.manager import ConfigError, parse_args
from spider_titan.config.parse import field_docs, sections, show, table_keys, toml_value, type_name
from spider_titan.config.validate import REGISTRY_KEYS, field_range
from spider_titan.job_config import JobConfig

# Registry kinds no key names: the builder picks them, for the reason given here (shown by --help).
BUILDER_CHOSEN: dict[str, str] = {
    "metric_logger": "console always; jsonl and tensorboard by metrics.enable_jsonl / metrics.enable_tensorboard",
}


def to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The resolved config as TOML-shaped tables (model overrides folded into [model])."""
    out = {}
    for name, cls in sections().items():
        section = getattr(cfg, name)
        table = {key: getattr(section, key) for key in table_keys(name, cls)}
        if name == "model":
            table.update(cfg.model.overrides)
        out[name] = table
    return out


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that ``parse_args`` reads back to an equal JobConfig."""
    lines = []
    for name, table in to_dict(cfg).items():
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None)
        lines.append("")
    return "\n".join(lines)


INFO_FLAGS = ("--help", "-h", "--print_config")
"""Flags ``train.main`` handles before training: they ask for text, never start a run."""


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
    return type_name(tp)


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
    ranges = {f.name: field_range(f).text() for f in dataclasses.fields(spec.args_cls)}
    header = ["key", "type", *spec.flavors] + (["this config"] if resolved is not None else [])
    rows = []
    for key in hints:
        row = [f"--model.{key}", type_name(hints[key]) + (f", {ranges[key]}" if ranges.get(key) else "")]
        row += [show(getattr(args, key)) for args in spec.flavors.values()]
        if resolved is not None:
            row.append(show(getattr(resolved, key)))
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
        hints = table_keys(name, cls)
        defaults = dataclasses.asdict(cls())
        resolved = dataclasses.asdict(getattr(cfg, name)) if cfg is not None else {}
        ranges = {f.name: field_range(f).text() for f in dataclasses.fields(cls)}
        for key in hints:
            shown = f"default {show(defaults[key])}"
            if key in resolved and resolved[key] != defaults[key]:
                shown += f"; this config: {show(resolved[key])}"
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
    lines.append("Registered components (spider_titan/registry.py):")
    width = max(map(len, registry.COMPONENTS))
    for kind in registry.COMPONENTS:
        lines.append(f"  {kind.ljust(width)}  {', '.join(registry.names(kind))}  ({chosen_by.get(kind, 'built in')})")
    return "\n".join(lines)
