"""The third scale of the quality study (issue 74): Spider ``medium`` and its dense partner sit between ``small``
and 1B, double ``small``'s widths and keep 1B's structure (docs/model.md, "Flavors")."""

from __future__ import annotations

import torch

from spider_titan.models.dense.model import DENSE_FLAVORS, DenseModel, dense_flops_per_token
from spider_titan.models.spider import SPIDER_FLAVORS, Spider, spider_flops_per_byte

WIDTHS = ("dim", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "inter_dim", "moe_inter_dim")
STRUCTURE = (
    "n_prelude",
    "n_core",
    "n_coda",
    "n_experts",
    "top_k",
    "engram_layers",
    "n_loops",
    "max_loops",
    "lora_rank",
    "boundary_predictor",
    "chunk_convention",
    "target_bytes_per_segment",
    "segment_bucket",
)


def test_medium_doubles_small_widths_and_keeps_1b_structure():
    small, medium, big = (SPIDER_FLAVORS[f] for f in ("small", "medium", "1B"))
    assert medium.validate() == []
    for key in WIDTHS:
        assert getattr(medium, key) == 2 * getattr(small, key), key
    assert medium.boundary_dim == 2 * small.boundary_dim
    for key in STRUCTURE:
        assert getattr(medium, key) == getattr(big, key), key
    assert medium.engram_dim * 4 == medium.dim and big.engram_dim * 4 == big.dim
    dense = DENSE_FLAVORS["medium"]
    assert dense.validate() == []
    assert dense.dim == medium.dim and dense.n_layers == medium.n_prelude + medium.n_core + medium.n_coda
    assert dense.dim // dense.n_heads == DENSE_FLAVORS["1B"].dim // DENSE_FLAVORS["1B"].n_heads
    for key in ("byte_ngram_orders", "byte_ngram_buckets", "byte_ngram_lr"):
        assert getattr(medium, key) == getattr(dense, key) == getattr(small, key), key


def test_medium_costs_between_small_and_1b_per_byte():
    """At seq 256 and 1024: >= 8x `small`'s training FLOPs per byte, <= 0.2x 1B's, for Spider (each at its own
    loops and bytes per segment) and dense; the two medium flavors within 20 % of each other."""
    for seq in (256, 1024):
        spider = [spider_flops_per_byte(SPIDER_FLAVORS[f], seq) for f in ("small", "medium", "1B")]
        dense = [dense_flops_per_token(DENSE_FLAVORS[f], seq) for f in ("small", "medium", "1B")]
        for s, m, b in (spider, dense):
            assert 8 * s <= m <= 0.2 * b, (seq, spider, dense)
        assert 0.8 < spider[1] / dense[1] < 1.2, (seq, spider[1], dense[1])


def test_medium_parameter_counts():
    """Built on the meta device: Spider medium 232.4 M (100.7 M of them byte n-gram tables), dense medium
    134.4 M, as docs/model.md's flavor table gives them (+- 1 %)."""
    with torch.device("meta"):
        spider = Spider(SPIDER_FLAVORS["medium"])
        dense = DenseModel(DENSE_FLAVORS["medium"])
    count = sum(p.numel() for p in spider.parameters())
    ngrams = sum(p.numel() for n, p in spider.named_parameters() if "byte_ngrams" in n)
    assert abs(count / 232.4e6 - 1) < 0.01 and abs(ngrams / 100.7e6 - 1) < 0.01, (count, ngrams)
    assert abs(sum(p.numel() for p in dense.parameters()) / 134.4e6 - 1) < 0.01
