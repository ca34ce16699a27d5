"""Shared fixtures: a per-session built-in corpus cache, a CUDA skip for ``gpu`` tests, a trainer
built in-process, and SIGTERM ending the suite."""

from __future__ import annotations

import logging
import os
import signal
import threading

# One inductor compile thread per process (read when torch._inductor.config is first imported, and
# inherited by every run a test starts): the suite already keeps both cores busy, and the default (a
# worker pool per process on this 2-core machine) only adds processes. Measured on the compiled
# expert-parallel run: 163 CPU-seconds against 181.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Scalar C++ kernels from inductor on CPU: the tests check graph breaks, recompiles, launch counts and
# compiled-against-eager numbers, none of which the SIMD variant of a CPU kernel changes, and g++ builds
# scalar kernels faster. Measured (2-core CPU, cold cache, the two precision-compile cases and the
# recompile walk on two workers): 195 s against 254 s wall, 229 against 307 CPU-seconds.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# One intra-op thread in the test processes too, as the runs they start already have (tests/utils.py):
# with both cores taken by the two pytest workers, a second OpenMP thread only spins against the other
# worker (a decode test measured 18.6 s with two threads against 6.8 s with one, on a loaded machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.utils import REPO  # noqa: E402

torch.set_num_threads(1)  # in case torch was imported before this file (a plugin)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")


def pytest_configure(config):
    """SIGTERM (a CI time-out, ``timeout -s TERM``) ends the run as Ctrl-C does: the running test
    is interrupted, fixtures are torn down (subprocesses killed), pytest prints its summary and
    exits 2. Python's default would kill pytest without any teardown."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the mark, not a keyword (a folder named gpu is one)
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def corpus_cache(tmp_path_factory):
    """Point the built-in corpus cache at one folder per session (built once, then reused)."""
    old = os.environ.get("SPIDER_TITAN_CACHE")
    path = os.environ.get("SPIDER_TITAN_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    os.environ["SPIDER_TITAN_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("SPIDER_TITAN_CACHE", None)
    else:
        os.environ["SPIDER_TITAN_CACHE"] = old


@pytest.fixture
def default_dtype_guard():
    """Restore the default dtype after a test that changes it."""
    old = torch.get_default_dtype()
    yield
    torch.set_default_dtype(old)


@pytest.fixture
def in_process(monkeypatch):
    """For a trainer built in this process: the repo as cwd, one intra-op thread as the subprocess runs
    have (``OMP_NUM_THREADS=1``, tests/utils.py), so a run here and one in a subprocess compute the
    same floats whatever an earlier test left the thread count at, and the package logger restored
    after (its handler would otherwise keep writing to this test's captured stdout)."""
    monkeypatch.chdir(REPO)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    log = logging.getLogger("spider_titan")
    monkeypatch.setattr(log, "handlers", [])
    monkeypatch.setattr(log, "level", log.level)
    monkeypatch.setattr(log, "propagate", log.propagate)
    yield
    torch.set_num_threads(threads)
