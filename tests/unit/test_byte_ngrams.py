"""Hashed byte n-grams (models.common.ByteNgrams) in the dense baseline: zero tables change nothing, and
random ones read no later byte (Spider's own checks are in test_spider_model.py and test_decode_cache.py)."""

from __future__ import annotations

import dataclasses

import torch

from spider_titan.models.dense.model import DENSE_FLAVORS, DenseModel


def build(**overrides) -> DenseModel:
    with torch.device("meta"):
        model = DenseModel(dataclasses.replace(DENSE_FLAVORS["debug"], **overrides))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model.eval()


def test_dense_byte_ngrams_start_as_nothing_and_read_only_the_past():
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain, ngrams = build(), build(byte_ngram_orders=[2, 5])
        torch.testing.assert_close(ngrams(ids).logits, plain(ids).logits)
        for table in ngrams.byte_ngrams.tables:
            table.weight.normal_()
        base = ngrams(ids).logits
        assert (base - plain(ids).logits).abs().max() > 1e-2
        for u in (0, 7, 30, 47):
            changed = ids.clone()
            changed[:, u] = (ids[:, u] + 1) % 256
            logits = ngrams(changed).logits
            if u:
                assert (logits[:, :u] - base[:, :u]).abs().max() < 1e-5
            assert (logits[:, u:] - base[:, u:]).abs().max() > 1e-4
