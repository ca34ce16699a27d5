"""scripts/run_train.sh refuses its usual mistakes in one line (exit 2) before torchrun starts."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.utils import REPO

MISTAKES = [
    ({"NGPU": "0"}, "NGPU=0 is not a whole number >= 1"),
    ({"NGPU": "two"}, "NGPU=two is not a whole number >= 1"),
    ({"NNODES": "0"}, "NNODES=0 is not a whole number >= 1"),
    ({"NNODES": "2"}, "NNODES=2 needs RDZV_ENDPOINT"),
    ({"NNODES": "2", "NODE_RANK": "2", "RDZV_ENDPOINT": "h:1"}, "NODE_RANK=2 is outside 0..1"),
    ({"NODE_RANK": "-1"}, "NODE_RANK=-1 is not a whole number >= 0"),
    ({"RDZV_ENDPOINT": "node0"}, "RDZV_ENDPOINT=node0 is not host:port"),
    ({"MAX_RESTARTS": "many"}, "MAX_RESTARTS=many is not a whole number >= 0"),
]


@pytest.mark.parametrize("env,expect", MISTAKES, ids=[" ".join(f"{k}={v}" for k, v in e.items()) for e, _ in MISTAKES])
def test_a_mistake_is_one_line(env, expect):
    base = {k: v for k, v in os.environ.items() if k not in ("NGPU", "NNODES", "NODE_RANK", "RDZV_ENDPOINT")}
    # PYTHON=false: a mistake that got past the checks would start nothing and fail differently
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "run_train.sh")],
        env={**base, "NGPU": "1", "PYTHON": "false", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and expect in lines[0], (run.returncode, run.stderr)
