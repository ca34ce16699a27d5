"""spider_titan.errors: which failures get one line, and what the line says."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest
import safetensors
import safetensors.torch
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


# safetensors (Rust) on a full disk: a SafetensorError, not an OSError. The first is the text 0.8.0
# raised on a full tmpfs (test_a_real_safetensors_write_to_a_full_disk), the second the Debug form of
# the same Rust io::Error that older versions wrote.
SAFETENSORS_ENOSPC = [
    "Error while serializing: I/O error: No space left on device (os error 28)",
    'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })',
]


@pytest.mark.parametrize("text", SAFETENSORS_ENOSPC, ids=["display", "debug"])
def test_the_os_error_is_read_from_safetensors_text(text, tmp_path):
    e = safetensors.SafetensorError(text)
    assert not isinstance(e, OSError)
    wrapped = RuntimeError("export failed")
    wrapped.__cause__ = e
    for raised in (e, wrapped):  # itself, or as the cause of another error
        cause = find_os_error(raised, tmp_path)
        assert cause.errno == errno.ENOSPC and cause.filename == str(tmp_path)
        assert describe_os_error(cause).startswith(f"{tmp_path}: no space left on device (ENOSPC); ")
    assert find_os_error(RuntimeError("expected 28 elements, got 27 (error 28)"), tmp_path) is None


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs: a real disk to fill (root with CAP_SYS_ADMIN only; skipped elsewhere)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
def test_a_real_safetensors_write_to_a_full_disk(small_tmpfs):
    """4 MiB into 2 MiB: safetensors deletes its partial file, so the disk has room again afterwards and
    only the error's text tells ENOSPC (the free-space test alone would miss it)."""
    with pytest.raises(safetensors.SafetensorError) as err:
        safetensors.torch.save_file({"w": torch.ones(1 << 20)}, small_tmpfs / "w.safetensors")
    assert list(small_tmpfs.iterdir()) == [] and errors.free_bytes(small_tmpfs) >= errors.FULL_DISK_BYTES
    cause = find_os_error(err.value, small_tmpfs)
    assert cause is not None and cause.errno == errno.ENOSPC, err.value


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
