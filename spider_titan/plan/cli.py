"""``python -m spider_titan.plan``: parse, plan, print; exit 0 when the plan fits, 1 when it does not,
2 on a config error."""

from __future__ import annotations

import logging
import sys

from spider_titan.config.manager import ConfigError
from spider_titan.plan.estimate import make_plan
from spider_titan.plan.options import USAGE, parse_plan_args, plan_flags_help
from spider_titan.plan.report import format_plan


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(sys.modules[__package__].__doc__)  # the package docstring: what the plan counts
        print(USAGE)
        print(plan_flags_help())
        return 0
    try:
        opts, cfg = parse_plan_args(argv)
    except ConfigError as e:
        for line in e.problems:
            print(f"config error: {line}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        plan = make_plan(cfg, opts)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan, cfg))
    return 0 if plan.total_bytes <= plan.gpu_memory_bytes else 1
