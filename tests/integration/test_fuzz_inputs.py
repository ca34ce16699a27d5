"""Seeded fuzz test of the trainer's inputs: random bytes in token shards and in TOML configs.

Each case writes its inputs into its own folder and runs the trainer's ``main(argv)`` in this
process (no subprocess per case; a case that happens to be valid trains one or two steps of the
debug model on 16-byte samples). Whatever the input, the run must end in exit 0, 1 or 2; a non-zero
exit prints one line on stderr (a config error: one ``config error:`` line per problem, as in
test_hostile.py), never a traceback; and nothing outside the case's folder changes.

The cases are drawn from ``random.Random(FUZZ_SEED * 1000 + case)``: a failing case names its
number, and ``FUZZ_SEED=<seed> pytest -k <id>`` replays it. Run more seeds to look for new bugs.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from spider_titan import registry
from spider_titan.config.parse import sections
from spider_titan.data.shards import HEADER_MAGIC, HEADER_VERSION, HEADER_WORDS, write_shard
from spider_titan.data.tokenizer import encode
from spider_titan.train import main
from spider_titan.vocab import PAD_ID
from tests.utils import REPO

FUZZ_SEED = int(os.environ.get("FUZZ_SEED", "0"))
SHARD_CASES, CONFIG_CASES = 70, 85

# Every case runs the debug model on tiny batches; these CLI values (which override the TOML) keep
# a valid case to a second, whatever the fuzzed TOML says about run length or data.
FAST = [
    "--training.steps",
    "1",
    "--training.target_tokens",
    "0",
    "--training.seq_len",
    "16",
    "--training.local_batch_size",
    "2",
    "--training.gradient_accumulation_steps",
    "1",
    "--training.compile",
    "false",
    "--validation.steps",
    "1",
    "--validation.local_batch_size",
    "0",
    "--checkpoint.export_at_end",
    "false",
    "--metrics.enable_tensorboard",
    "false",
]


# ---------------------------------------------------------------- token shards


def _text_tokens(rnd: random.Random, n_docs: int) -> np.ndarray:
    words = ["def", "return", "x", "+", "1", "spider", "ünïcode", "\n", "    ", "import"]
    docs = [encode(" ".join(rnd.choice(words) for _ in range(rnd.randint(5, 80)))) for _ in range(n_docs)]
    return np.array([t for d in docs for t in d], dtype=np.uint16)


def _header(count: int, version: int = HEADER_VERSION, magic: int = HEADER_MAGIC) -> bytes:
    words = np.zeros(HEADER_WORDS, dtype="<i4")
    words[:3] = (magic, version, count)
    return words.tobytes()


BAD_KINDS = [
    "random-bytes",
    "uint16",
    "sprinkled",
    "sprinkled",
    "truncated",
    "header-garbage",
    "pad",
    "empty",
    "text-renamed",
]


def _shard_bytes(rnd: random.Random, kind: str) -> bytes:
    """One shard file's bytes of the given kind (``valid`` or one of BAD_KINDS)."""
    tokens = _text_tokens(rnd, rnd.randint(1, 12))
    if kind == "valid":
        data = tokens.astype("<u2").tobytes()
    elif kind == "random-bytes":
        data = rnd.randbytes(rnd.randint(1, 6000))
    elif kind == "uint16":
        data = np.array([rnd.randrange(65536) for _ in range(rnd.randint(1, 3000))], dtype="<u2").tobytes()
    elif kind == "sprinkled":  # mostly valid, a few ids outside the vocabulary anywhere in the file
        for _ in range(rnd.randint(1, 3)):
            tokens[rnd.randrange(tokens.size)] = rnd.randrange(272, 65536)
        data = tokens.astype("<u2").tobytes()
    elif kind == "truncated":
        whole = _header(tokens.size) + tokens.astype("<u2").tobytes()
        data = whole[: rnd.randrange(len(whole))]
    elif kind == "header-garbage":
        header = _header(rnd.randrange(-(2**31), 2**31), rnd.choice([0, 1, 2, -1]), HEADER_MAGIC)
        data = header + tokens.astype("<u2").tobytes()
    elif kind == "pad":
        data = np.full(rnd.randint(1, 5000), PAD_ID, dtype="<u2").tobytes()
    elif kind == "empty":
        data = b""
    else:  # a text file renamed .bin
        words = (rnd.choice(["lorem", "ipsum", "dolor", "sit", "amet\n"]) for _ in range(rnd.randint(1, 900)))
        data = " ".join(words).encode()
    if kind in ("valid", "sprinkled") and rnd.random() < 0.5:
        data = _header(len(data) // 2) + data
    return data


def _shard_case(rnd: random.Random, folder: Path) -> list[str]:
    """1-3 train and 0-2 val shards, all valid or (more often) one of them of a bad kind."""
    data = folder / "data"
    files = [
        data / split / f"{split}_{i}.bin"
        for split, low in (("train", 1), ("val", 0))
        for i in range(rnd.randint(low, 2 + low))
    ]
    bad = rnd.randrange(len(files)) if rnd.random() < 0.7 else None
    for i, path in enumerate(files):
        kind = rnd.choice(BAD_KINDS) if i == bad else "valid"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_shard_bytes(rnd, kind))
    return [
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--training.dataset",
        "bytes",
        "--training.dataset_path",
        str(data),
        "--validation.enable",
        rnd.choice(["true", "false", "false"]),
        "--training.num_workers",
        rnd.choice(["0", "0", "0", "0", "0", "1"]),
        *FAST,
        "--training.local_batch_size",
        "4",
        "--training.steps",
        str(rnd.randint(1, 2)),
    ]


# ---------------------------------------------------------------- configs

BASE_TOML = """\
[job]
description = "fuzz"

[model]
name = "spider"
flavor = "debug"
n_loops = 2

[training]
dataset = "mock"
seq_len = 16
steps = 1
seed = 3
max_norm = 1.0

[optimizer]
name = "AdamW"
lr = 0.001
weight_decay = 0.1

[lr_scheduler]
warmup_steps = 2
decay_type = "cosine"
min_lr_factor = 0.1

[activation_checkpoint]
mode = "none"

[moe]
backend = "torch"
aux_loss_coeff = 0.01

[checkpoint]
enable = false
interval = 5

[validation]
enable = false
freq = 10

[metrics]
log_freq = 1
enable_jsonl = true
"""
# Values spliced into the TOML. No absolute paths and no '..': a fuzzed folder key must stay in the case's folder.
VALUES = [
    "-1",
    "0",
    "1",
    "2",
    "3",
    "-7",
    "0.5",
    "-0.5",
    "1.5",
    "nan",
    "inf",
    "-inf",
    "1e309",
    "2147483648",
    "18446744073709551616",
    '""',
    '"x"',
    '"auto"',
    '"none"',
    '"op"',
    '"2"',
    '"full"',
    '"float8"',
    "true",
    "false",
    "[]",
    "[1, 2]",
    '["float8"]',
    '["x=true"]',
    "{}",
    "{a = 1}",
    "2026-11-23",
    '"\\u00e9 ✓"',
    '"' + "y" * 300 + '"',
    "[[1], 2]",
    "'''multi\nline'''",
]


def _fields() -> list[tuple[str, str]]:
    """Every (section, key) of the JobConfig, and the spider model's args under [model]."""
    keys = [(name, key) for name, cls in sections().items() for key in cls.__dataclass_fields__ if key != "overrides"]
    return keys + [("model", key) for key in registry.get("model", "spider").args_cls.__dataclass_fields__]


def _mutate(rnd: random.Random, lines: list[str]) -> list[str]:
    lines = list(lines)
    op = rnd.choice(["delete", "duplicate", "swap", "value", "value", "value", "add", "add", "bytes", "truncate"])
    i = rnd.randrange(len(lines))
    if op == "delete":
        del lines[i]
    elif op == "duplicate":
        lines.insert(i, lines[i])
    elif op == "swap":
        j = rnd.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif op == "value" and any(" = " in line for line in lines):
        k = rnd.choice([k for k, line in enumerate(lines) if " = " in line])
        lines[k] = lines[k].split(" = ")[0] + " = " + rnd.choice(VALUES)
    elif op in ("add", "value"):  # any key of any section, with a hostile value, in a table of its own
        section, key = rnd.choice(_fields())
        lines[i:i] = [f"[{section}]", f"{key} = {rnd.choice(VALUES)}"]
    elif op == "bytes":
        line = lines[i]
        at = rnd.randrange(len(line) + 1)
        lines[i] = line[:at] + rnd.randbytes(rnd.randint(1, 8)).decode("latin-1") + line[at:]
    else:
        lines = lines[:i]
    return lines


def _config_case(rnd: random.Random, folder: Path) -> list[str]:
    """A fuzzed TOML; valid ones train on the small shared corpus (the mock one takes 0.3 s to make)."""
    path = folder / "job.toml"
    if rnd.random() < 0.1:
        path.write_bytes(rnd.randbytes(rnd.randint(0, 400)))
    else:
        lines = BASE_TOML.splitlines()
        for _ in range(rnd.randint(1, 3)):
            lines = _mutate(rnd, lines) or ["[job]"]
        path.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape"))
    return [
        "--job.config_file",
        str(path),
        *FAST,
        "--training.dataset",
        "bytes",
        "--training.dataset_path",
        str(folder.parent / "corpus"),
    ]


# ---------------------------------------------------------------- the test

CASES: list[tuple[str, Callable[[random.Random, Path], list[str]]]] = [
    (f"shard-{i}", _shard_case) for i in range(SHARD_CASES)
] + [(f"config-{i}", _config_case) for i in range(SHARD_CASES, SHARD_CASES + CONFIG_CASES)]


def _snapshot(roots: list[Path], skip: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under ``roots`` except under ``skip`` (the running case's folder)."""
    out = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [
                d
                for d in dirnames
                if d not in (".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache")
                and Path(dirpath, d) != skip
            ]
            for name in filenames:
                st = os.stat(os.path.join(dirpath, name))
                out[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory) -> Path:
    """The cases' folders, and the small corpus the config cases share (read-only to them)."""
    root = tmp_path_factory.mktemp("fuzz")
    rnd = random.Random(FUZZ_SEED)
    for split in ("train", "val"):
        write_shard(root / "corpus" / split / "data_000000.bin", _text_tokens(rnd, 40))
    return root


@pytest.mark.parametrize("case_id, make", CASES, ids=[c for c, _ in CASES])
@pytest.mark.slow  # a trainer start per fuzzed case
def test_fuzzed_input_ends_in_one_clean_line(case_id, make, fuzz_root, in_process, capsys, corpus_cache, monkeypatch):
    from spider_titan.data import loader

    # The start-up probe reads 8-token blocks instead of 64K: on these KB-sized shards it then
    # samples a few percent, and the ids it misses must be caught by the batch check.
    monkeypatch.setattr(loader, "_PROBE_BLOCK", 8)
    number = int(case_id.split("-")[1])
    rnd = random.Random(FUZZ_SEED * 1000 + number)
    folder = fuzz_root / case_id
    folder.mkdir()
    argv = make(rnd, folder)
    roots = [REPO, fuzz_root, Path(corpus_cache)]
    before = _snapshot(roots, folder)
    with torch.random.fork_rng():
        code = main(argv + ["--job.dump_folder", str(folder / "run")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    where = f"case {case_id} (FUZZ_SEED={FUZZ_SEED}): {argv}\n{err[-3000:]}"
    assert code in (0, 1, 2), where
    assert "Traceback" not in err, where
    if code != 0:
        assert len(lines) == 1 or all(line.startswith("config error: ") for line in lines), where
    assert _snapshot(roots, folder) == before, where
