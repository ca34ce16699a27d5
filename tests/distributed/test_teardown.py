"""A distributed run lets go of its process groups before the interpreter shuts down.

The gloo backends' threads (``gloo_tcp_loop``, ``pt_gloo_runloop``) used to outlive
``destroy_process_group``: DTensor's caches and the command line's signal handlers held the model,
its meshes and so the groups, which were then destroyed during the interpreter's shutdown, and a
rank aborted now and then ("terminate called without an active exception", 1 run in 25 of the
4-rank run in test_split_invariance, 2026-11-26). Here the command-line entry point runs under
torchrun and each rank lists its threads once ``main`` has returned.
"""

from __future__ import annotations

import sys

import pytest

from tests.utils import check_ok, run_train, tiny_run

pytestmark = pytest.mark.slow

# main() as the command line runs it (argv None: signal handlers installed), then the threads left,
# one file per rank (two ranks printing to one pipe interleave their lines).
LAUNCHER = """\
import os, pathlib, sys
from spider_titan.train import main
code = main()
names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
pathlib.Path(os.environ["THREADS_DIR"], f"threads_rank{os.environ['RANK']}.txt").write_text(",".join(names))
sys.exit(code)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lists threads from /proc")
def test_no_process_group_threads_outlive_main(tmp_path):
    """2 ranks, FSDP 2 (DTensor parameters), a few steps with the end-of-run export: after ``main``
    returns, each rank has no gloo thread left, only its main thread (and OpenMP's, if any)."""
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    args = tiny_run(training__steps=3, checkpoint__export_at_end=True)
    run = run_train(
        [*args, "--job.dump_folder", str(tmp_path / "run")],
        nprocs=2,
        timeout=300,
        script=launcher,
        env={"THREADS_DIR": str(tmp_path)},
    )
    check_ok(run)
    for rank in range(2):
        threads = (tmp_path / f"threads_rank{rank}.txt").read_text().split(",")
        assert not [t for t in threads if "gloo" in t], (rank, threads)
        assert "python" in threads, (rank, threads)
