"""The planner's command line: its own flags (:class:`PlanOptions`) beside the training config's."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from spider_titan.config.manager import ConfigError
from spider_titan.config.parse import convert, field_docs, parse, show, split_cli, type_name
from spider_titan.config.validate import field_range, validate
from spider_titan.job_config import JobConfig, Range, ranged

USAGE = (
    "usage: python -m spider_titan.plan --job.config_file FILE --ngpu N [--mfu 0.4] [--gpu_memory_gib 80] "
    "[--peak_tflops T] [--section.key value ...]"
)


@dataclass
class PlanOptions:
    """The plan's own flags: ``--key value``, ``--key=value`` or ``--plan.key value``, read with the
    config parser's own splitting and conversion (config/parse.py); every other flag is the training
    config's ``--section.key value``."""

    ngpu: int = field(metadata={"range": Range(low=1)})
    """GPUs (ranks) to plan for; required."""
    mfu: float = ranged(0.4, low=0, high=1, low_open=True)
    """Model FLOPs utilisation the step time assumes, a fraction (e.g. 0.4)."""
    gpu_memory_gib: float = ranged(80.0, low=0, low_open=True)
    """Memory of one GPU, GiB: the budget of the verdict and of keeping the recurrent core gathered."""
    peak_tflops: float | None = field(default=None, metadata={"range": Range(low=0, low_open=True)})
    """Peak dense TFLOP/s of one GPU; none: H100 bf16 (989), doubled with the float8 converter."""
    search_budget: bool = True
    """When checkpointing is needed and blocks are compiled: find the largest compiled memory budget
    (``activation_checkpoint.mode = "memory_budget"``) that fits, a measurement per budget tried."""


PLAN_SECTION = "plan"


def parse_plan_args(argv: list[str]) -> tuple[PlanOptions, JobConfig]:
    """The plan's flags and the training config ``argv`` asks for; ConfigError with every problem of
    both, one line each (the config is validated for ``--ngpu`` ranks once that is known)."""
    hints = typing.get_type_hints(PlanOptions)
    # the plan's flags are keys of a [plan] section, so the config's splitter reads both in one pass
    named = [f"--{PLAN_SECTION}.{a[2:]}" if a[:2] == "--" and a[2:].partition("=")[0] in hints else a for a in argv]
    pairs, problems = split_cli(named)
    problems = [p.replace(f"--{PLAN_SECTION}.", "--") for p in problems]
    values: dict[str, Any] = {}
    rest: list[str] = []
    for dotted, raw in pairs:
        section, _, key = dotted.partition(".")
        if section != PLAN_SECTION:
            rest.append(f"--{dotted}={raw}")
        elif key not in hints:
            problems.append(f"--{dotted}: unknown plan flag; plan flags: {', '.join('--' + k for k in hints)}")
        else:
            try:
                values[key] = convert(raw, hints[key], from_cli=True)
            except ValueError as e:
                problems.append(f"--{key}: {e}")
    for f in dataclasses.fields(PlanOptions):
        value = values.get(f.name)
        if value is not None and not field_range(f).allows(value):
            problems.append(f"--{f.name} {show(value)} is not allowed; use {field_range(f).describe(hints[f.name])}")
            del values[f.name]
    if "ngpu" not in values and not any(p.startswith("--ngpu") for p in problems):
        problems.append(f"--ngpu: required, the number of GPUs (ranks) to plan for ({USAGE})")
    cfg, config_problems = parse(rest)
    if cfg is not None and "ngpu" in values:  # the parallelism checks need the world size
        config_problems += validate(cfg, env={"WORLD_SIZE": str(values["ngpu"])})
    problems += config_problems
    if problems:
        raise ConfigError(problems)
    return PlanOptions(**values), cfg


def plan_flags_help() -> str:
    """``--help``'s lines for the plan's own flags, from their docstrings."""
    docs, hints = field_docs(PlanOptions), typing.get_type_hints(PlanOptions)
    lines = ["plan flags (--key value, --key=value or --plan.key value):"]
    for f in dataclasses.fields(PlanOptions):
        allowed = field_range(f).text()
        default = "" if f.default is dataclasses.MISSING else f", default {show(f.default)}"
        lines.append(
            f"  --{f.name} ({type_name(hints[f.name])}{' ' + allowed if allowed else ''}{default}): {docs[f.name]}"
        )
    lines.append("every other flag is the training config's: python -m spider_titan.train --help")
    return "\n".join(lines)
