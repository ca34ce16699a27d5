"""Incremental decoding (models/spider/decode.py) against the full forward: the same logits at every
position, fp32, for the boundary rules and loop counts, with rows of different lengths."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spider_titan.models.spider import Spider
from spider_titan.models.spider.decode import decode, new_cache
from spider_titan.vocab import BOS_ID
from tests.unit.test_spider_model import DEBUG

TEXT = (
    b"Spider reads bytes. A learned boundary closes a segment; the core loops over segments, "
    b"and every byte reads the segment that ended before its own began. def f(x):\n    return x * 2\n"
)


def _model(**overrides) -> Spider:
    torch.manual_seed(0)
    args = dataclasses.replace(DEBUG, **overrides)  # two loops, cached apart
    with torch.device("meta"):
        model = Spider(args)
    model.to_empty(device="cpu")
    model.init_weights()
    if model.boundary_predictor is not None:
        # identity projections give every byte the same score; random ones make the predictor fire
        torch.nn.init.normal_(model.boundary_predictor.q_proj.weight, std=0.2)
        torch.nn.init.normal_(model.boundary_predictor.k_proj.weight, std=0.2)
    if model.byte_ngrams is not None:  # zero tables add nothing; random ones show a window that reads wrong bytes
        for table in model.byte_ngrams.tables:
            torch.nn.init.normal_(table.weight, std=0.5)
    return model.eval()


def _row(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    body = (TEXT * 8)[: n - 1]
    noise = torch.randint(0, 256, (len(body),), generator=g).tolist()
    return [BOS_ID] + [b if i % 7 else c for i, (b, c) in enumerate(zip(body, noise))]


@pytest.mark.parametrize(
    "predictor, n_loops, convention, ngrams",
    [
        ("cosine", 1, "mean", []),
        ("cosine", 3, "mean", []),
        ("fixed", 2, "mean", []),
        ("cosine", 2, "first", []),
        ("fixed", 2, "first", []),
        ("cosine", 4, "first", []),
        ("cosine", 2, "first", [2, 3, 6]),  # hashed byte n-grams: each new byte's window of earlier bytes
    ],
    ids=str,
)
def test_cached_logits_equal_the_full_forward_at_every_position(predictor, n_loops, convention, ngrams):
    """A 520-byte row (an 8-byte prompt, 64 bytes one by one, then 448 at once): every position's logits, with our segment
    convention (``mean``) and with H-Net's (``first``: chunk starts), learned segments (dechunk
    smoothing and the confidence factor) and fixed ones (neither), and with hashed byte n-grams (each
    new byte's n-grams read the bytes before it)."""
    model = _model(boundary_predictor=predictor, chunk_convention=convention, byte_ngram_orders=ngrams)
    ids = torch.tensor([_row(520, 1)])
    with torch.no_grad():
        full = model(ids, n_loops=n_loops).logits
        segments = model(ids, n_loops=n_loops).aux["bytes_per_segment"]
    assert 2.0 < float(segments) < 12.0  # the rule really cuts (a realistic rate, not every byte)
    cache = new_cache(model, 1, n_loops=n_loops)
    # a prompt at once, then 64 bytes one at a time (generation), then the rest at once (a next turn)
    pieces = [decode(model, ids[:, :8], cache)]
    pieces += [decode(model, ids[:, j : j + 1], cache) for j in range(8, 72)]
    pieces.append(decode(model, ids[:, 72:], cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_rows_of_different_lengths_and_chunked_appends():
    """A batch of 3 prompts of different lengths (``lengths``), then uneven chunks: every row's
    logits equal its own full forward."""
    model = _model()
    rows = [_row(n, seed) for n, seed in ((300, 2), (120, 3), (211, 4))]
    cache = new_cache(model, 3)
    prompts = [40, 7, 23]
    width = max(prompts)
    padded = torch.tensor([r[:p] + [0] * (width - p) for r, p in zip(rows, prompts)])
    first = decode(model, padded, cache, lengths=prompts)
    pieces = {i: [first[i : i + 1, :p]] for i, p in enumerate(prompts)}
    starts = list(prompts)
    for size in (1, 5, 17, 64, 1000):
        chunk = [r[s : s + size] for r, s in zip(rows, starts)]
        n = [len(c) for c in chunk]
        if not any(n):
            break
        width = max(n)
        out = decode(model, torch.tensor([c + [0] * (width - len(c)) for c in chunk]), cache, lengths=n)
        for i in range(3):
            pieces[i].append(out[i : i + 1, : n[i]])
            starts[i] += n[i]
    assert cache.length == [len(r) for r in rows]
    with torch.no_grad():
        for i, r in enumerate(rows):
            torch.testing.assert_close(
                torch.cat(pieces[i], dim=1), model(torch.tensor([r])).logits, rtol=1e-5, atol=1e-5
            )


def test_generation_with_the_cache_samples_what_recomputing_samples():
    """generation.generate: the cached path draws the same bytes as the reference that recomputes
    the context every step (same seed, top-k and top-p), at the trained and at more loops."""
    from spider_titan.generation import generate, generate_batch

    model = _model()
    for n_loops in (None, 4):
        kw = dict(max_new_bytes=40, temperature=0.8, top_k=50, top_p=0.95, seed=5, n_loops=n_loops)
        cached = generate(model, b"Spider reads", **kw)
        assert cached == generate(model, b"Spider reads", use_cache=False, **kw)
        assert len(cached) > 0
    batch = generate_batch(model, [b"ab", b"a much longer prompt", b""], max_new_bytes=12, temperature=0)
    assert batch[1] == generate(model, b"a much longer prompt", max_new_bytes=12, temperature=0, use_cache=False)


def test_a_conversation_keeps_its_caches_between_turns():
    """generation.Conversation (scripts/generate.py --interactive): each turn writes what sampling
    from the whole document so far writes, though the decoder is fed only each turn's new bytes."""
    from spider_titan.generation import Conversation, generate

    model = _model()
    conv = Conversation(model, temperature=0.8, top_k=50, seed=3)
    first = bytes(conv.turn(b"Spider reads", 24))
    assert first == generate(model, b"Spider reads", max_new_bytes=24, temperature=0.8, top_k=50, seed=3)
    conv = Conversation(model, temperature=0)
    first, second = bytes(conv.turn(b"Spider reads", 24)), bytes(conv.turn(b" and", 24))
    assert len(first) > 0 and len(second) > 0
    whole = b"Spider reads" + first + b" and"
    assert second == generate(model, whole, max_new_bytes=24, temperature=0, use_cache=False)
    assert conv.cache.length == [len(conv.ids) - 1]  # every byte fed once (the newest is fed next turn)
    conv.reset()
    assert bytes(conv.turn(b"Spider reads", 24)) == first
