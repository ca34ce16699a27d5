"""Two "nodes" on localhost: two torchrun agents (--nnodes 2, one process each) meet through a
c10d rendezvous started by scripts/run_train.sh, and train a few FSDP steps together."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.utils import REPO, read_metrics, tiny_run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_node_rendezvous_on_localhost(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    args = tiny_run(training__steps=3, job__dump_folder=tmp_path / "run")
    procs = []
    for node in (0, 1):
        env = {
            **os.environ,
            "NGPU": "1",
            "NNODES": "2",
            "NODE_RANK": str(node),
            "RDZV_ENDPOINT": endpoint,
            "RDZV_ID": f"test-{tmp_path.name}",
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHON": sys.executable,
        }
        procs.append(
            subprocess.Popen(
                ["bash", "scripts/run_train.sh", *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node} exited {p.returncode}:\n{out[-4000:]}"
    assert "(2 per rank x 1 accumulation x 2 ranks)" in outputs[0] + outputs[1]
    losses = [row["loss"] for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert len(losses) == 3 and all(loss == loss for loss in losses)
