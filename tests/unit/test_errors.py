"""spider_titan.errors: which failures get one line, and what the line says."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from spider_titan import errors
from spider_titan.errors import WriteFailed, describe_failure, describe_os_error, find_os_error, is_out_of_memory


@pytest.mark.parametrize(
    "code, named",
    [
        (errno.ENOSPC, "no space left on device (ENOSPC)"),
        (errno.EDQUOT, "disk quota exceeded (EDQUOT)"),
        (errno.EROFS, "read-only file system (EROFS)"),
        (errno.EACCES, "permission denied (EACCES)"),
        (errno.EPERM, "operation not permitted (EPERM)"),
    ],
)
def test_each_disk_error_is_named_with_its_fix(code, named):
    e = OSError(code, os.strerror(code), "/data/run/config.toml")
    line = describe_failure(e, "start-up")
    assert line == describe_os_error(e) and line.startswith(f"/data/run/config.toml: {named}; ")
    assert "job.dump_folder" in line
    assert describe_os_error(e, "/data/out", setting="--out").startswith(f"/data/out: {named}; ")
    assert "--out" in describe_os_error(e, "/data/out", setting="--out")


def test_other_errors_are_left_to_their_traceback():
    assert describe_failure(FileNotFoundError(errno.ENOENT, "gone", "/x"), "step 3") is None
    assert describe_failure(RuntimeError("shape mismatch"), "step 3") is None
    line = "checkpoint step 2 not saved (...)"
    assert describe_failure(WriteFailed(line), "step 3") == line


def test_the_os_error_is_found_inside_dcp_s_wrapper(tmp_path, monkeypatch):
    inner = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    wrapped = CheckpointException("write", {1: (inner, [])})
    assert find_os_error(wrapped, tmp_path) is inner
    short = CheckpointException("write", {0: (RuntimeError("unexpected pos 704 vs 598"), [])})
    assert find_os_error(short, tmp_path) is None  # this disk has room: not a full disk, a bug
    monkeypatch.setattr(errors, "free_bytes", lambda path: 100)
    assert find_os_error(short, tmp_path).errno == errno.ENOSPC


def test_out_of_memory_of_either_allocator():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(RuntimeError) as cpu:
        torch.empty(1 << 50, dtype=torch.uint8)
    assert is_out_of_memory(cpu.value) and is_out_of_memory(MemoryError())
    with pytest.raises(RuntimeError) as huge:  # --model.dim 2147483648: too large to even size
        torch.empty(2**31, 2**31, 2**31, dtype=torch.float32, device="meta").to_empty(device="cpu")
    assert is_out_of_memory(huge.value), huge.value
    assert not is_out_of_memory(RuntimeError("expected scalar type Float"))
    line = describe_failure(cpu.value, "step 7")
    assert line.startswith("step 7: out of memory (DefaultCPUAllocator: can't allocate memory")
    assert "training.local_batch_size" in line and "activation_checkpoint.mode" in line
