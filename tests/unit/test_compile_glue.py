"""The compile component's glue regions (ModelSpec.compiled_modules, parallel/compile.py): each named
module present is compiled in place beside the blocks, a missing one is skipped, and names do not move."""

from __future__ import annotations

import pytest

from spider_titan.models.spider import SPIDER_SPEC
from spider_titan.parallel.compile import apply_compile


@pytest.mark.parametrize(
    "predictor, ngrams, glue",
    [
        ("cosine", [], ["boundary_predictor"]),
        ("fixed", [], []),
        ("cosine", [3, 4], ["boundary_predictor", "byte_ngrams"]),
    ],
)
def test_named_glue_is_compiled_in_place_and_a_missing_module_is_skipped(predictor, ngrams, glue):
    args = SPIDER_SPEC.build_args("debug", {"boundary_predictor": predictor, "byte_ngram_orders": ngrams})
    model, plain = SPIDER_SPEC.model_cls(args), SPIDER_SPEC.model_cls(args)
    n_blocks = apply_compile(model, SPIDER_SPEC)
    assert n_blocks == len(SPIDER_SPEC.blocks(plain))
    assert [fqn for fqn, _ in SPIDER_SPEC.compiled_extras(model)] == glue
    compiled = {name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None}
    assert compiled == {fqn for fqn, _ in SPIDER_SPEC.blocks(plain)} | set(glue)
    assert list(model.state_dict()) == list(plain.state_dict())  # checkpoints and exports keep their keys


@pytest.mark.slow
def test_compiled_byte_ngrams_equal_eager():
    """The n-gram hash's int64 arithmetic compiled by Inductor gives the eager buckets and rows exactly."""
    import torch

    from spider_titan.models.common import ByteNgrams

    ngrams = ByteNgrams([3, 4, 8], n_buckets=8192, dim=16)
    for table in ngrams.tables:
        torch.nn.init.normal_(table.weight)
    ids = torch.randint(0, 272, (2, 300), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(ngrams, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(ids), ngrams(ids))
