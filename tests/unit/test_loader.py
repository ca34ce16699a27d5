"""The token datasets and ByteDataLoader, checked against a straightforward reference sampler."""

from __future__ import annotations

import itertools
import json
import logging
import pickle

import numpy as np
import pytest
import torch

from spider_titan.data.loader import (
    ByteDataLoader,
    TokenDataset,
    build_builtin_dataset,
    build_bytes_dataset,
    build_mock_dataset,
    build_text_dataset,
)
from spider_titan.data.shards import DataError, read_metadata, read_shard, write_shard
from spider_titan.data.tokenizer import decode, encode
from spider_titan.vocab import IGNORE_INDEX, PAD_ID
from tests.utils import tiny_run

SEQ = 16


def _stream_dataset(num_windows: int = 64, pieces: int = 5, seed: int = 0) -> tuple[TokenDataset, np.ndarray]:
    """A dataset of random tokens (PAD included) split into uneven arrays, and its flat reference."""
    flat = np.random.default_rng(seed).integers(0, 272, size=num_windows * SEQ + 1).astype(np.uint16)
    cuts = np.sort(np.random.default_rng(seed + 1).choice(np.arange(1, flat.size), size=pieces - 1, replace=False))
    return TokenDataset(np.split(flat, cuts), description="test stream"), flat


def _reference_samples(flat: np.ndarray, seed: int, first: int, count: int) -> np.ndarray:
    """Global samples [first, first + count) written out from the documented sampling rule."""
    n = (flat.size - 1) // SEQ
    rows = []
    for s in range(first, first + count):
        epoch, pos = divmod(s, n)
        w = np.random.default_rng(seed + epoch).permutation(n)[pos]
        rows.append(flat[w * SEQ : w * SEQ + SEQ + 1])
    return np.stack(rows).astype(np.int64)


def _loader(ds, *, batch=2, rank=0, world=1, seed=0, workers=0) -> ByteDataLoader:
    return ByteDataLoader(
        ds, seq_len=SEQ, local_batch_size=batch, dp_rank=rank, dp_world_size=world, seed=seed, num_workers=workers
    )


def _take(loader: ByteDataLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(iter(loader), n))


def test_window_crosses_array_borders():
    ds, flat = _stream_dataset()
    assert ds.num_tokens == flat.size
    for start, length in [(0, 1), (0, flat.size), (100, 300), (flat.size - 5, 5), (7, 0)]:
        np.testing.assert_array_equal(ds.window(start, length), flat[start : start + length])
    with pytest.raises(IndexError):
        ds.window(flat.size - 2, 3)


def test_batches_follow_the_reference_across_epochs():
    ds, flat = _stream_dataset(num_windows=10)
    batches = _take(_loader(ds, batch=4, seed=3), 6)  # 24 samples: crosses two epoch borders
    for g, (x, y) in enumerate(batches):
        ref = _reference_samples(flat, 3, g * 4, 4)
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (4, SEQ)
        np.testing.assert_array_equal(x.numpy(), ref[:, :-1])
        np.testing.assert_array_equal(y.numpy(), np.where(ref[:, 1:] == PAD_ID, IGNORE_INDEX, ref[:, 1:]))


@pytest.mark.parametrize("batch", [1, 3])  # batch 1: labels once shared the inputs' storage
def test_labels_are_shifted_inputs_and_pad_is_ignored(batch):
    flat = np.tile(np.array([1, 2, PAD_ID, 3], dtype=np.uint16), 40)
    ds = TokenDataset([flat], description="pads")
    x, y = next(iter(_loader(ds, batch=batch)))
    assert (y == IGNORE_INDEX).any() and not (y == PAD_ID).any()
    assert (x >= 0).all() and (x == PAD_ID).any()  # the inputs keep their PAD tokens
    kept = y != IGNORE_INDEX
    torch.testing.assert_close(y[:, :-1][kept[:, :-1]], x[:, 1:][kept[:, :-1]])
    torch.testing.assert_close(kept[:, :-1], x[:, 1:] != PAD_ID)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_read_disjoint_slices_that_cover_the_global_batch(world):
    ds, flat = _stream_dataset(num_windows=64)
    batch, steps = 2, 64 // (2 * world)  # exactly one epoch
    per_rank = [_take(_loader(ds, batch=batch, rank=r, world=world, seed=5), steps) for r in range(world)]
    starts = []
    for g in range(steps):
        global_inputs = torch.cat([per_rank[r][g][0] for r in range(world)])
        ref = _reference_samples(flat, 5, g * batch * world, batch * world)
        np.testing.assert_array_equal(global_inputs.numpy(), ref[:, :-1])
        starts += [_window_id(flat, row) for row in global_inputs.numpy()]
    assert sorted(starts) == list(range(64))  # every window once over the epoch, no rank overlap


def _window_id(flat: np.ndarray, row: np.ndarray) -> int:
    matches = [w for w in range((flat.size - 1) // SEQ) if np.array_equal(flat[w * SEQ : w * SEQ + SEQ], row)]
    assert len(matches) == 1
    return matches[0]


def test_workers_yield_the_same_sequence():
    ds, _ = _stream_dataset(num_windows=40)
    plain = _take(_loader(ds, batch=3, seed=1), 7)
    loader = _loader(ds, batch=3, seed=1, workers=2)
    with_workers = _take(loader, 7)
    for (x0, y0), (x1, y1) in zip(plain, with_workers, strict=True):
        torch.testing.assert_close(x0, x1)
        torch.testing.assert_close(y0, y1)
    assert loader.samples_consumed == 7 * 3


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_yields_the_uninterrupted_batches(workers):
    ds, _ = _stream_dataset(num_windows=30)
    reference = _take(_loader(ds, batch=4, seed=2), 12)
    first = _loader(ds, batch=4, seed=2, workers=workers)
    _take(first, 5)
    resumed = _loader(ds, batch=4, seed=2, workers=workers)
    resumed.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    for (x0, y0), (x1, y1) in zip(reference[5:], _take(resumed, 7), strict=True):
        torch.testing.assert_close(x0, x1)
        torch.testing.assert_close(y0, y1)


def test_resume_on_another_world_size_continues_the_global_sequence():
    ds, _ = _stream_dataset(num_windows=48)
    two = [_loader(ds, batch=2, rank=r, world=2, seed=4) for r in range(2)]
    iters = [iter(loader) for loader in two]
    for _ in range(5):
        for it in iters:
            next(it)
    saved = two[0].state_dict()
    assert saved == two[1].state_dict()  # the state does not depend on the rank
    uninterrupted = [torch.cat([next(it)[0] for it in iters]) for _ in range(6)]

    one = _loader(ds, batch=4, seed=4)
    one.load_state_dict(saved)
    for expected, (x, _) in zip(uninterrupted, _take(one, 6), strict=True):
        torch.testing.assert_close(x, expected)


@pytest.mark.parametrize("key", ["seq_len", "seed"])
def test_load_state_dict_rejects_another_seq_len_or_seed(key):
    ds, _ = _stream_dataset()
    state = _loader(ds).state_dict()
    state[key] += 1
    with pytest.raises(ValueError, match=key):
        _loader(ds).load_state_dict(state)


def test_too_little_data_names_the_numbers():
    ds, _ = _stream_dataset(num_windows=6)
    with pytest.raises(ValueError, match=r"6 samples.*local_batch_size\(2\) \* dp_world_size\(4\) = 8"):
        _loader(ds, batch=2, world=4)


def test_token_dataset_pickles_memmaps_as_paths(tmp_path):
    tokens = np.arange(500, dtype=np.uint16)
    ds = TokenDataset(
        [read_shard(write_shard(tmp_path / "a.bin", tokens, header=True)), tokens[:7]], description="pickled"
    )
    payload = pickle.dumps(ds)
    assert len(payload) < tokens.nbytes  # the shard travels as its path
    clone = pickle.loads(payload)
    np.testing.assert_array_equal(clone.window(0, clone.num_tokens), ds.window(0, ds.num_tokens))


def test_bytes_dataset_uses_train_and_val_folders(tmp_path):
    train = [np.full(50, i, dtype=np.uint16) for i in range(3)]
    for i, t in enumerate(train):
        write_shard(tmp_path / "train" / f"part_{i}.bin", t, header=i % 2 == 0)
    write_shard(tmp_path / "val" / "part_0.bin", np.full(30, 9, dtype=np.uint16))
    tr = build_bytes_dataset(str(tmp_path), split="train", seed=0)
    np.testing.assert_array_equal(tr.window(0, tr.num_tokens), np.concatenate(train))
    assert build_bytes_dataset(str(tmp_path), split="val", seed=0).num_tokens == 30


def test_bytes_dataset_splits_by_file_name(tmp_path):
    write_shard(tmp_path / "data_train_000.bin", np.zeros(40, dtype=np.uint16))
    write_shard(tmp_path / "nested" / "data_val_000.bin", np.ones(20, dtype=np.uint16))
    assert build_bytes_dataset(str(tmp_path), split="train", seed=0).num_tokens == 40
    assert build_bytes_dataset(str(tmp_path), split="val", seed=0).num_tokens == 20


def test_bytes_dataset_without_val_shards_is_a_one_line_error(tmp_path):
    write_shard(tmp_path / "data_000.bin", np.zeros(40, dtype=np.uint16))
    with pytest.raises(FileNotFoundError) as info:
        build_bytes_dataset(str(tmp_path), split="val", seed=0)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def test_bytes_dataset_on_a_text_file_says_it_is_a_file_and_text_reads_it(tmp_path):
    corpus = tmp_path / "notes.md"
    corpus.write_text("plain prose. " * 400)
    for split in ("train", "val"):
        with pytest.raises(FileNotFoundError) as info:
            build_bytes_dataset(str(corpus), split=split, seed=0)
        message = str(info.value)
        assert "\n" not in message and "does not exist" not in message
        assert f"{corpus} is a file, not a folder of *.bin token shards" in message and "prepare_data.py" in message
    # the text dataset takes the same file as it is
    assert build_text_dataset(str(corpus), split="train", seed=0).num_tokens > 0


def test_text_dataset_splits_documents(tmp_path):
    docs = [f"document number {i} " * (i + 1) for i in range(45)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    parts = {s: build_text_dataset(str(tmp_path), split=s, seed=0) for s in ("train", "val")}
    texts = {s: _documents(ds) for s, ds in parts.items()}
    assert texts["val"] == [d for i, d in enumerate(docs) if i % 20 == 1]
    assert texts["train"] == [d for i, d in enumerate(docs) if i % 20 != 1]
    assert texts == {s: _documents(build_text_dataset(str(tmp_path), split=s, seed=7)) for s in parts}


def test_text_dataset_cuts_a_single_document(tmp_path):
    text = "one long document. " * 200
    (tmp_path / "one.txt").write_text(text)
    train = build_text_dataset(str(tmp_path / "one.txt"), split="train", seed=0)
    val = build_text_dataset(str(tmp_path / "one.txt"), split="val", seed=0)
    assert val.num_tokens > 0
    joined = np.concatenate([train.window(0, train.num_tokens), val.window(0, val.num_tokens)])
    np.testing.assert_array_equal(joined, np.array(encode(text), dtype=np.uint16))


def _documents(ds: TokenDataset) -> list[str]:
    """The decoded documents of a dataset, split at BOS."""
    ids = ds.window(0, ds.num_tokens)
    bos = encode("")[0]
    return [decode(d) for d in np.split(ids, np.flatnonzero(ids == bos))[1:]]


def test_mock_dataset_is_deterministic_and_seeded():
    a = build_mock_dataset(None, split="train", seed=0)
    b = build_mock_dataset(None, split="train", seed=0)
    np.testing.assert_array_equal(a.window(0, a.num_tokens), b.window(0, b.num_tokens))
    c = build_mock_dataset(None, split="train", seed=1)
    assert not np.array_equal(a.window(0, 1000), c.window(0, 1000))
    val = build_mock_dataset(None, split="val", seed=0)
    assert 0 < val.num_tokens < a.num_tokens < 4 * 2**20
    successors: dict[str, set[str]] = {}
    for doc in _documents(a):
        words = doc.rstrip(".").split(" ")
        for prev, nxt in zip(words, words[1:]):
            successors.setdefault(prev, set()).add(nxt)
    assert len(successors) <= 512 and max(len(s) for s in successors.values()) <= 4  # learnable structure


def test_builtin_corpus_builds_once_into_the_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPIDER_TITAN_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="spider_titan"):
        train = build_builtin_dataset(None, split="train", seed=0)
    assert any("building the built-in corpus" in r.getMessage() for r in caplog.records)
    folder = tmp_path / "builtin_v1"
    meta = read_metadata(folder)
    assert meta["splits"]["train"]["tokens"] == train.num_tokens
    assert meta["documents"] == meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"]
    assert meta["splits"]["val"]["documents"] == -(-meta["documents"] // 50)
    assert [p.name for p in tmp_path.iterdir()] == ["builtin_v1"]  # no temp folder left behind
    stamp = (folder / "metadata.json").stat().st_mtime_ns

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="spider_titan"):
        val = build_builtin_dataset(None, split="val", seed=0)
    assert not caplog.records
    assert (folder / "metadata.json").stat().st_mtime_ns == stamp
    assert val.num_tokens == meta["splits"]["val"]["tokens"]
    assert "import" in decode(train.window(0, min(train.num_tokens, 200_000)))


def test_a_dataset_of_only_pad_is_an_error_naming_it():
    with pytest.raises(ValueError, match="only pad: no tokens other than PAD"):
        TokenDataset([np.full(100, PAD_ID, dtype=np.uint16)], description="only pad")


def test_an_all_pad_shard_among_good_ones_is_named(tmp_path):
    write_shard(tmp_path / "train" / "a.bin", np.array(encode("hello world " * 20), dtype=np.uint16))
    write_shard(tmp_path / "train" / "b.bin", np.full(3 << 16, PAD_ID, dtype=np.uint16))  # past the probes
    write_shard(tmp_path / "val" / "c.bin", np.array(encode("hello"), dtype=np.uint16))
    with pytest.raises(ValueError, match=r"b\.bin: every token is PAD"):
        build_bytes_dataset(str(tmp_path), split="train", seed=0)


def test_pad_probe_finds_one_real_token_anywhere():
    from spider_titan.data.loader import holds_labels

    tokens = np.full(5 << 20, PAD_ID, dtype=np.uint16)
    assert not holds_labels(tokens)
    for where in (0, 12345, (5 << 20) - 1):
        tokens[where] = 7
        assert holds_labels(tokens)
        tokens[where] = PAD_ID


# ---------------------------------------------------------------- token ids outside the vocabulary


def test_start_up_probe_names_the_file_offset_and_value_of_an_id_outside_the_vocabulary(tmp_path):
    """A text file renamed .bin (two ASCII bytes read as one uint16 id) and a header shard with one
    bad id inside a probed block: both are named with the byte offset of the bad id."""
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "notes.bin").write_bytes(b"plain text, not tokens!\n")  # an even size
    write_shard(tmp_path / "val" / "v.bin", np.array(encode("hello"), dtype=np.uint16))
    with pytest.raises(DataError) as info:
        build_bytes_dataset(str(tmp_path), split="train", seed=0)
    assert str(info.value).startswith(
        f"{tmp_path / 'train' / 'notes.bin'}: token id {ord('p') | ord('l') << 8} at byte offset 0 "
    )
    assert "scripts/prepare_data.py" in str(info.value) and "\n" not in str(info.value)

    tokens = np.array(encode("x" * 3000), dtype=np.uint16)
    tokens[1234] = 300
    write_shard(tmp_path / "train" / "notes.bin", tokens, header=True)
    with pytest.raises(DataError, match=f"notes.bin: token id 300 at byte offset {1024 + 2 * 1234} "):
        build_bytes_dataset(str(tmp_path), split="train", seed=0)


@pytest.mark.parametrize("workers", [0, 1])
def test_an_id_past_the_probes_stops_the_batch_that_reads_it(tmp_path, monkeypatch, workers):
    """The start-up probe samples a few blocks; a bad id between them is caught by the batch check,
    named (file, byte offset, value) in one line, from a worker process too."""
    from spider_titan.data import loader as loader_module

    monkeypatch.setattr(loader_module, "_PROBE_BLOCK", 8)  # probes read tokens [0, 8), [625, 633), ...
    tokens = np.array(encode("some text to learn from. " * 400), dtype=np.uint16)
    bad = 5100  # between the probed blocks [5000, 5008) and [5625, 5633)
    tokens[bad] = 4096
    write_shard(tmp_path / "train" / "deep.bin", tokens, header=True)
    write_shard(tmp_path / "val" / "v.bin", np.array(encode("hello"), dtype=np.uint16))
    ds = build_bytes_dataset(str(tmp_path), split="train", seed=0)  # the probe does not see it
    loader = _loader(ds, batch=4, workers=workers)
    batches = iter(loader)
    with pytest.raises(DataError) as info:
        for _ in range(loader.num_windows):  # one epoch reads every window
            next(batches)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'train' / 'deep.bin'}: token id 4096 at byte offset {1024 + 2 * bad} ")
    assert "Traceback" not in message and "\n" not in message


def test_text_dataset_reads_compressed_jsonl_as_prepare_data_does(tmp_path):
    """A .jsonl.gz yields its documents' bytes (not the compressed bytes), in the same tokens as
    prepare_data's reader, and a .txt.gz is one decompressed document."""
    import gzip

    docs = [f"gzipped document {i}: ✓ text" for i in range(25)]
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    parts = {s: build_text_dataset(str(tmp_path / "docs.jsonl.gz"), split=s, seed=0) for s in ("train", "val")}
    assert _documents(parts["val"]) == [d for i, d in enumerate(docs) if i % 20 == 1]
    assert _documents(parts["train"]) == [d for i, d in enumerate(docs) if i % 20 != 1]
    np.testing.assert_array_equal(parts["train"].arrays[0], np.array(encode(docs[0]), dtype=np.uint16))

    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "note.txt.gz").write_bytes(gzip.compress(b"a gzipped note. " * 100))
    train = build_text_dataset(str(tmp_path / "one" / "note.txt.gz"), split="train", seed=0)
    assert decode(train.window(0, train.num_tokens)).startswith("a gzipped note. a gzipped note.")


def test_text_dataset_with_a_truncated_gzip_is_a_one_line_error(tmp_path):
    import gzip

    data = gzip.compress(b"".join(json.dumps({"text": f"doc {i} " * 50}).encode() + b"\n" for i in range(200)))
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as info:
        build_text_dataset(str(tmp_path / "cut.jsonl.gz"), split="train", seed=0)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'cut.jsonl.gz'}: ") and "truncated" in message and "\n" not in message


@pytest.mark.gpu
def test_pinned_batches_for_a_cuda_run():
    """With pin_memory (the builder's choice on CUDA) batches and sample ids come pinned, so the
    train loop's non_blocking copies do not wait on the host; the values are unchanged."""
    ds, _ = _stream_dataset()
    plain, pinned = _loader(ds), _loader(ds)
    pinned.pin_memory = True
    for (x, y), (px, py) in zip(_take(plain, 3), _take(pinned, 3)):
        assert px.is_pinned() and py.is_pinned() and torch.equal(x, px) and torch.equal(y, py)
    assert pinned.next_sample_ids().is_pinned()


def test_the_train_loop_copies_batches_without_blocking(monkeypatch, in_process, tmp_path):
    """Every host-to-device copy of a micro-batch (inputs, labels, sample ids) is non_blocking: on a
    GPU a blocking one waits for the host, a sync per micro-batch."""
    from spider_titan.config.manager import parse_args
    from spider_titan.train import Trainer

    cfg = parse_args(
        tiny_run(training__gradient_accumulation_steps=2, job__dump_folder=tmp_path / "run"),
        env={},
    )
    trainer = Trainer(cfg)
    try:
        calls = []
        real_to = torch.Tensor.to

        def recording_to(self, *args, **kwargs):
            calls.append(kwargs.get("non_blocking", False))
            return real_to(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", recording_to)
        batches = trainer.next_micro_batches()
    finally:
        trainer.close()
    assert len(batches) == 2 and len(calls) == 6 and all(calls), calls


def test_closing_the_trainer_ends_its_data_workers_at_once(in_process, tmp_path):
    """Trainer.close() ends the DataLoader workers itself. Left to the garbage collector (the run's
    objects form cycles), the workers' queues could be finalised before their iterator, which then
    never sent the stop message: every run with ``training.num_workers > 0`` ended 5 s late."""
    import multiprocessing

    from spider_titan.config.manager import parse_args
    from spider_titan.train import Trainer

    argv = ["--job.config_file", "train_configs/debug_model.toml", "--training.dataset", "mock"]
    argv += ["--training.num_workers", "1", "--validation.enable", "false", "--job.dump_folder", str(tmp_path)]
    trainer = Trainer(parse_args(argv, env={}))
    try:
        trainer.next_micro_batches()
        workers = multiprocessing.active_children()
        assert len(workers) == 1, workers  # the control: the worker runs
    finally:
        trainer.close()
    assert not any(w.is_alive() for w in workers), workers  # gone at close, no timeout waited out
