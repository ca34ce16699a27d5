"""The config's public entry: :func:`parse_args` reads a JobConfig (config/parse.py: TOML, then
CLI overrides; precedence CLI > TOML > defaults), checks it (config/validate.py) and raises every
problem found together as one :class:`ConfigError`, whose lines each name the key, the value and
the fix. ``train.main`` prints them and exits with status 2, no traceback. ``--help`` and the TOML
rendering are in config/help.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from spider_titan.config.parse import parse
from spider_titan.config.validate import validate
from spider_titan.job_config import JobConfig


class ConfigError(ValueError):
    """One or more configuration problems; ``problems`` holds one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def parse_args(argv: list[str] | None = None, *, env: Mapping[str, str] | None = None) -> JobConfig:
    """Build and validate the JobConfig for ``argv`` (without the program name); ``env`` gives
    WORLD_SIZE (default: this process's environment)."""
    cfg, problems = parse(list(sys.argv[1:] if argv is None else argv))
    if cfg is not None:  # None: the config file itself is unreadable, its one problem says why
        problems += validate(cfg, env=os.environ if env is None else env)
    if problems:
        raise ConfigError(problems)
    return cfg
