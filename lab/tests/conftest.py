"""The suite's shared fixtures and hooks (tests/conftest.py), for the lab's tests too: pytest applies a
conftest only to the folder it is in, and the lab's tests sit beside the suite's, not under it."""

from tests.conftest import (  # noqa: F401
    corpus_cache,
    default_dtype_guard,
    in_process,
    pytest_collection_modifyitems,
    pytest_configure,
)
