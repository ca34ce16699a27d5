"""Make an export folder loadable by transformers: its modelling code is this package's own.

:func:`write_hf_files` copies the modules of a model's transformers classes (``Inference.hf_modules``)
and every ``spider_titan`` module they import (their import closure, found by reading the sources)
into the export folder as flat files, with
each ``from spider_titan.a.b import x`` rewritten to ``from .st_a_b import x`` (the form
transformers' dynamic-module loader follows and copies). Nothing is written by hand twice: the
files are the package's sources with their imports made relative (tests/integration/test_hf.py
checks it). :func:`hf_config_keys` are the keys config.json needs for the Auto classes.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from spider_titan.protocol import HFModules
from spider_titan.vocab import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../spider_titan
TOKENIZER_CONFIG = "tokenizer_config.json"
_IMPORT = re.compile(r"^(\s*)from spider_titan\.([\w.]+) import", re.MULTILINE)


def flat_name(module: str) -> str:
    """The file name (without .py) of ``module`` in an export: hf modules keep theirs, others ``st_*``."""
    parts = module.split(".")[1:]
    return parts[-1] if parts[0] == "hf" else "st_" + "_".join(parts)


def is_bundled_file(name: str) -> bool:
    """Whether ``name`` is a file :func:`write_hf_files` may write into an export: a package module's
    flat name (``st_*.py``, or the name of a module of spider_titan/hf/)."""
    if not name.endswith(".py"):
        return False
    stem = name.removesuffix(".py")
    return stem.startswith("st_") or (stem != "__init__" and (PACKAGE_ROOT / "hf" / name).is_file())


def _source(module: str) -> Path:
    path = PACKAGE_ROOT.joinpath(*module.split(".")[1:])
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"


def source_closure(modules: tuple[str, ...]) -> list[str]:
    """``modules`` and every spider_titan module their sources import (at any depth), sorted."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for node in ast.walk(ast.parse(_source(module).read_text())):
            if isinstance(node, ast.Import) and any(a.name.startswith("spider_titan") for a in node.names):
                raise ValueError(
                    f"{_source(module)}: write 'from spider_titan.x import y' (the bundle rewrites only that)"
                )
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spider_titan."):
                todo.append(node.module)
    return sorted(seen)


def bundled_source(module: str) -> str:
    """The source of ``module`` as the export holds it: spider_titan imports made relative."""
    text = _source(module).read_text()
    return _IMPORT.sub(lambda m: f"{m.group(1)}from .{flat_name('spider_titan.' + m.group(2))} import", text)


def _auto_class(target: str) -> str:
    """``"module:Class"`` as an ``auto_map`` entry names it in the export: ``flat_module.Class``."""
    module, cls = target.split(":")
    return f"{flat_name(module)}.{cls}"


def hf_config_keys(args: dict, hf: HFModules) -> dict:
    """What config.json adds for transformers: the model type, the Auto classes' map, the specials and
    the longest input (``max_position_embeddings``, which lm-evaluation-harness reads as its window)."""
    return {
        "max_position_embeddings": args["max_seq_len"],
        "model_type": "spider_titan",
        "architectures": [hf.model.split(":")[1]],
        "auto_map": {"AutoConfig": _auto_class(hf.config), "AutoModelForCausalLM": _auto_class(hf.model)},
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }


def write_hf_files(out: Path, hf: HFModules) -> list[str]:
    """Write the sources of ``hf``'s classes and the tokenizer config into the export folder ``out``;
    the names written."""
    names = []
    for module in source_closure(hf.modules):
        name = f"{flat_name(module)}.py"
        (out / name).write_text(bundled_source(module))
        names.append(name)
    tokenizer = {
        "tokenizer_class": hf.tokenizer.split(":")[1],
        "auto_map": {"AutoTokenizer": [_auto_class(hf.tokenizer), None]},
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "model_max_length": 1_000_000,
    }
    (out / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer, indent=1) + "\n")
    return [*names, TOKENIZER_CONFIG]
