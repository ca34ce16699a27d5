"""Shared fixtures: a per-session built-in corpus cache, a CUDA skip for ``gpu`` tests."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
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
