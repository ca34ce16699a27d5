"""scripts/generate.py end to end on an export of a freshly initialised model."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from spider_titan.checkpoint.export import full_model_state_dict, write_export
from spider_titan.checkpoint.layout import ModelIdentity
from spider_titan.components import registry
from spider_titan.components.builder import materialize
from spider_titan.generation import generate, load_model
from tests.utils import REPO


def test_generate_cli_matches_the_library(tmp_path):
    spec = registry.get("model", "dense")
    args = spec.build_args("debug", {"n_layers": 1})
    with torch.device("meta"):
        model = spec.model_cls(args)
    materialize(model, torch.device("cpu"), seed=0)
    write_export(full_model_state_dict(model), ModelIdentity.of("dense", "debug", args), tmp_path, dtype=torch.float32)

    proc = subprocess.run(
        [
            sys.executable,
            "scripts/generate.py",
            "--model",
            str(tmp_path),
            "--prompt",
            "hello",
            "--max_new_bytes",
            "12",
            "--temperature",
            "0.7",
            "--top_k",
            "20",
            "--seed",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    loaded, _ = load_model(tmp_path)
    expected = generate(loaded, b"hello", max_new_bytes=12, temperature=0.7, top_k=20, seed=1)
    assert proc.stdout == "hello" + expected.decode("utf-8", errors="replace") + "\n"
