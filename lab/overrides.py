"""Trainer overrides, written one way: a mapping of ``section.key`` to a value, turned into the trainer's
``--section.key value`` arguments by :func:`trainer_flags` (and read from a tool's repeatable
``--set section.key=value`` by :func:`parse_sets`). Every lab tool that builds a trainer command line
or config goes through these two, so a flag is spelled the way ``python -m spider_titan.train --help``
prints it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from spider_titan.config.parse import toml_value


def cli_value(value: object) -> str:
    """A value as the trainer's command line reads it: ``true``/``false``, numbers as Python writes them,
    lists as TOML (``[0, 1]``, ``["*=2", "core=1"]``), a string or a path as it is."""
    return str(value) if isinstance(value, (str, os.PathLike)) else toml_value(value)


def trainer_flags(overrides: Mapping[str, object]) -> list[str]:
    """``{"training.seq_len": 1024, "model.engram_layers": [0, 1]}`` ->
    ``["--training.seq_len", "1024", "--model.engram_layers", "[0, 1]"]``, in the mapping's order."""
    flags = []
    for key, value in overrides.items():
        section, dot, name = key.partition(".")
        if not (section and dot and name) or key.startswith("-"):
            raise ValueError(f"trainer override {key!r}: expected section.key (e.g. training.seq_len)")
        flags += [f"--{key}", cli_value(value)]
    return flags


def parse_sets(items: Iterable[str], flag: str = "--set") -> dict[str, str]:
    """``["training.seq_len=1024", "model.n_loops=2"]`` (a tool's repeatable ``--set``) as a mapping, later
    items winning; ValueError in one line for an item that is not ``section.key=value``."""
    out: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not (eq and section and dot and name) or key.startswith("-"):
            raise ValueError(f"{flag} {item!r}: expected section.key=value, e.g. {flag} training.seq_len=1024")
        out[key] = value
    return out
