"""Shard files: both formats round-trip and are detected, corruption is reported, folders are searched."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from spider_titan.data.shards import (
    HEADER_BYTES,
    HEADER_MAGIC,
    DataError,
    ShardWriter,
    find_shards,
    read_metadata,
    read_shard,
    write_metadata,
    write_shard,
)


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 272, size=n).astype(np.uint16)


@pytest.mark.parametrize("header", [False, True])
@pytest.mark.parametrize("n", [0, 1, 1000, 5000])
def test_round_trip_and_detection(tmp_path, header, n):
    tokens = _tokens(n)
    path = write_shard(tmp_path / "s.bin", tokens, header=header)
    assert path.stat().st_size == 2 * n + (HEADER_BYTES if header else 0)
    got = read_shard(path)
    assert got.dtype == np.uint16
    assert not got.flags.writeable
    np.testing.assert_array_equal(got, tokens)


def test_raw_file_from_numpy_is_read_as_raw(tmp_path):
    tokens = _tokens(2000, seed=1)
    tokens.astype("<u2").tofile(tmp_path / "seed.bin")  # how the seed scripts write shards
    got = read_shard(tmp_path / "seed.bin")
    assert isinstance(got, np.memmap)
    np.testing.assert_array_equal(got, tokens)


def test_header_layout_matches_llm_c(tmp_path):
    tokens = _tokens(600)
    path = write_shard(tmp_path / "h.bin", tokens, header=True)
    words = np.fromfile(path, dtype="<i4", count=256)
    assert words[:3].tolist() == [HEADER_MAGIC, 1, 600]
    assert not words[3:].any()
    np.testing.assert_array_equal(np.fromfile(path, dtype="<u2", offset=HEADER_BYTES), tokens)


def test_odd_size_is_an_error(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="odd.bin.*odd size"):
        read_shard(path)


def test_truncated_header_shard_is_an_error(tmp_path):
    path = write_shard(tmp_path / "cut.bin", _tokens(1000), header=True)
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(ValueError, match="cut.bin.*1000 tokens.*900"):
        read_shard(path)


def test_unknown_header_version_is_an_error(tmp_path):
    path = write_shard(tmp_path / "v2.bin", _tokens(10), header=True)
    data = bytearray(path.read_bytes())
    data[4:8] = np.array([2], dtype="<i4").tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="v2.bin.*version 2"):
        read_shard(path)


def test_write_rejects_ids_beyond_uint16(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        write_shard(tmp_path / "x.bin", np.array([1, 70000]))


def test_find_shards_is_recursive_and_sorted(tmp_path):
    names = ["b/2.bin", "a/1.bin", "a/sub/0.bin", "c.bin"]
    for name in names:
        write_shard(tmp_path / name, _tokens(4))
    (tmp_path / "notes.txt").write_text("not a shard")
    assert find_shards(tmp_path) == sorted(tmp_path / n for n in names)
    assert find_shards(tmp_path / "c.bin") == [tmp_path / "c.bin"]


@pytest.mark.parametrize("make", [True, False])
def test_no_shards_is_a_one_line_error(tmp_path, make):
    folder = tmp_path / "data"
    if make:
        folder.mkdir()
    with pytest.raises(FileNotFoundError) as info:
        find_shards(folder)
    message = str(info.value)
    assert "\n" not in message and str(folder) in message and "*.bin" in message


def test_a_file_that_is_not_a_shard_is_named_as_a_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text, not token shards")
    with pytest.raises(FileNotFoundError) as info:
        find_shards(corpus)
    message = str(info.value)
    assert "\n" not in message and "does not exist" not in message
    assert f"{corpus} is a file, not a folder of *.bin token shards" in message
    assert f"prepare_data.py --input {corpus} --out" in message


def test_metadata_round_trip(tmp_path):
    assert read_metadata(tmp_path) is None
    meta = {"vocab_size": 272, "splits": {"train": {"tokens": 5}}}
    write_metadata(tmp_path, meta)
    assert read_metadata(tmp_path) == meta
    (tmp_path / "metadata.json").write_text("{broken")
    with pytest.raises(ValueError, match="metadata.json"):
        read_metadata(tmp_path)


def test_shard_writer_splits_the_stream(tmp_path):
    pieces = [_tokens(n, seed=n) for n in (5, 17, 1, 40, 3)]
    writer = ShardWriter(tmp_path, "train", shard_tokens=16, header=True)
    for piece in pieces:
        writer.add(piece)
    writer.close()
    expected = np.concatenate(pieces)
    sizes = [read_shard(p).size for p in writer.paths]
    assert sizes == [16, 16, 16, 16, expected.size - 64]
    assert [p.name for p in writer.paths] == [f"train_{i:06d}.bin" for i in range(5)]
    np.testing.assert_array_equal(np.concatenate([read_shard(p) for p in find_shards(tmp_path)]), expected)
    assert writer.num_tokens == expected.size


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to an unprivileged user")
def test_an_unreadable_shard_is_named(tmp_path):
    """Root reads any file, so the read runs with the effective uid of 'nobody' (65534)."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="shard-unreadable-"))  # outside pytest's private (0700) tmp folder
    try:
        base.chmod(0o755)
        path = write_shard(base / "s.bin", _tokens(100))
        path.chmod(0o600)
        os.seteuid(65534)
        try:
            with pytest.raises(DataError, match=f"{path}: cannot read it \\(permission denied\\)"):
                read_shard(path)
        finally:
            os.seteuid(0)
    finally:
        shutil.rmtree(base)
