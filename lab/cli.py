"""The lab tools' command lines, one style: argparse with ``--snake_case`` flags (:func:`parser`), every
mistake one line with exit status 1 or 2 and no traceback, and the checks each tool makes before any
work (:func:`refuse` and the ``check_*`` helpers). A tool that writes a file writes it whole or not at
all (:func:`write_whole`: a temporary name, renamed when complete)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from spider_titan.cli import ArgumentParser, replace_file


def parser(prog: str, doc: str | None, **kwargs) -> ArgumentParser:
    """The tool's parser: ``prog`` as a person types it (``python -m lab.bench.gpu``), the first paragraph
    of ``doc`` as its description; a usage mistake is one line (:class:`spider_titan.cli.ArgumentParser`)."""
    return ArgumentParser(prog=prog, description=(doc or "").split("\n\n")[0], **kwargs)


def refuse(prog: str, message: str) -> SystemExit:
    """The one line a tool exits with (status 1): ``raise refuse(PROG, "--seq_len 0: give a positive number")``."""
    return SystemExit(f"{prog}: error: {message}")


def check_positive(prog: str, **values: float | None) -> None:
    """Each of ``values`` (flag name without dashes -> value; None: not given) above zero."""
    for name, value in values.items():
        if value is not None and not value > 0:
            raise refuse(prog, f"--{name} {value:g}: give a positive number")


def check_not_negative(prog: str, **values: float | None) -> None:
    """Each of ``values`` zero or more."""
    for name, value in values.items():
        if value is not None and not value >= 0:
            raise refuse(prog, f"--{name} {value:g}: give zero or a positive number")


def check_folder(prog: str, flag: str, path: str | Path | None, *, what: str = "a folder") -> None:
    """``path`` (when given) is an existing folder."""
    if path is not None and not Path(path).is_dir():
        state = "is not a folder" if Path(path).exists() else "does not exist"
        raise refuse(prog, f"{flag} {path}: {state}; give {what}")


def check_data(prog: str, flag: str, data: str | Path | None) -> None:
    """``data`` (when given) is a bytes folder: one with a ``val/`` or ``train/`` split, or shards in it."""
    if data is None:
        return
    check_folder(prog, flag, data, what="a folder of token shards (python scripts/prepare_data.py makes one)")
    path = Path(data)
    if not any(path.glob("*.bin")) and not any((path / split).is_dir() for split in ("train", "val")):
        raise refuse(
            prog, f"{flag} {data}: no train/ or val/ split and no *.bin shards; make it with scripts/prepare_data.py"
        )


def check_output_file(prog: str, flag: str, path: str | Path | None, *inputs: str | Path) -> None:
    """``path`` (when given) can be written: its folder exists, it is not a folder, and it is none of
    ``inputs`` (an output that replaces its own input would lose it)."""
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        raise refuse(prog, f"{flag} {path}: is a folder; give a file name")
    if not out.parent.is_dir():
        raise refuse(prog, f"{flag} {path}: the folder {out.parent} does not exist; create it or write elsewhere")
    for source in inputs:
        if out.exists() and Path(source).exists() and os.path.samefile(out, source):
            raise refuse(prog, f"{flag} {path}: is the input {source}; write the output to another file")


def check_device(prog: str, device: str) -> str:
    """``auto``, ``cpu`` or ``cuda`` as a device this machine has (``auto``: CUDA when available)."""
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise refuse(prog, f"--device {device}: choose auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise refuse(prog, "--device cuda: torch sees no CUDA device here; use --device cpu (or auto)")
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def write_whole(path: str | Path, content: str | bytes | Callable[[Path], object]) -> None:
    """Write ``content`` (text, bytes, or a function that writes the file it is given, e.g. a figure's
    ``savefig`` with an explicit format) to ``path`` whole or not at all (:func:`spider_titan.cli.replace_file`)."""
    if isinstance(content, str):
        replace_file(Path(path), lambda tmp: tmp.write_text(content))
    elif isinstance(content, bytes):
        replace_file(Path(path), lambda tmp: tmp.write_bytes(content))
    else:
        replace_file(Path(path), content)
