"""The validation pass (training/validation.py): the whole split with ``steps = -1`` (its last
partial batch and the windows' tail included) and one pass per distinct eval variant."""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spider_titan.data.loader import ByteDataLoader, TokenDataset
from spider_titan.job_config import Validation
from spider_titan.protocol import ModelOutput, ModelSpec, Training
from spider_titan.training import validation
from spider_titan.training.signals import StopSignal
from spider_titan.training.validation import Validator, whole_split_batch_count, whole_split_batches
from spider_titan.vocab import IGNORE_INDEX, VOCAB_SIZE


class Bigram(nn.Module):
    """Logits from the current byte only, so the loss of a prediction does not depend on how the
    stream is cut into windows: a pass over the split can be checked against the stream directly.
    ``scale`` (an eval variant's kwarg) sharpens the logits; ``calls`` counts forwards per scale."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(VOCAB_SIZE, VOCAB_SIZE)
        self.calls: dict[float, int] = {}

    def forward(self, input_ids: torch.Tensor, scale: float = 1.0) -> ModelOutput:
        self.calls[scale] = self.calls.get(scale, 0) + 1
        logits = self.table(input_ids) * scale
        return ModelOutput(logits=logits, aux={"mean_input": input_ids.float().mean()})


def spec(variants) -> ModelSpec:
    return ModelSpec(
        name="bigram",
        args_cls=dict,
        flavors={},
        model_cls=Bigram,
        block_containers=(),
        flops_per_token=lambda args, seq_len: 0.0,
        training=Training(eval_variants=(lambda args: variants) if variants is not None else None),
    )


def stream(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, n).astype(np.uint16)


def loader(tokens: np.ndarray, *, batch: int, rank: int = 0, world: int = 1) -> ByteDataLoader:
    ds = TokenDataset([tokens], description="test val split")
    return ByteDataLoader(ds, seq_len=16, local_batch_size=batch, dp_rank=rank, dp_world_size=world, seed=0)


def direct_loss(model: Bigram, tokens: np.ndarray, scale: float = 1.0) -> float:
    t = torch.from_numpy(tokens.astype(np.int64))
    with torch.no_grad():
        return F.cross_entropy(model.table(t[:-1]).float() * scale, t[1:]).item()


def validator(model, variants, data: ByteDataLoader, steps: int) -> Validator:
    return Validator(
        model,
        spec(variants),
        {},
        data,
        Validation(enable=True, steps=steps),
        device=torch.device("cpu"),
        autocast=nullcontext,
        stop=StopSignal(world_size=1),
        world_size=1,
    )


@pytest.mark.parametrize("n_tokens", [200, 193])  # 12 windows and a 7-token tail; 12 windows and no tail
def test_whole_split_bpb_equals_the_direct_computation(n_tokens):
    """steps = -1 over 12 windows in batches of 5 (two full, one partial) plus the tail: the bpb of
    every one of the split's num_tokens - 1 predictions, as computed on the stream itself."""
    torch.manual_seed(0)
    model = Bigram()
    tokens = stream(n_tokens)
    data = loader(tokens, batch=5)
    assert data.num_windows == 12 and data.num_windows % data.global_batch_size
    results = validator(model, None, data, steps=-1)()
    assert results["val_bpb"] == pytest.approx(direct_loss(model, tokens) / math.log(2), rel=1e-6)
    assert model.calls[1.0] == 3  # ceil(12 (+ the tail row) / 5)


def test_whole_split_ranks_share_the_predictions_once():
    """Two data-parallel ranks yield the same number of batches and, together, every prediction
    once (the padding rows of the last global batch carry no labels)."""
    tokens = stream(200)
    per_rank = [list(whole_split_batches(loader(tokens, batch=3, rank=r, world=2))) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 3  # 13 rows in global batches of 6
    labels = [lab for batches in per_rank for _, lab in batches]
    assert sum(int((lab != IGNORE_INDEX).sum()) for lab in labels) == len(tokens) - 1
    seen = sorted(int(x) for lab in labels for x in lab[lab != IGNORE_INDEX])
    assert seen == sorted(int(x) for x in tokens[1:])


def test_equal_variants_run_once_and_report_under_each_suffix():
    """A default variant equal to a named one (Spider's trained loop count) is run once; the
    figures of both suffixes are that pass's, and the aux figures come with the plain one."""
    torch.manual_seed(0)
    model = Bigram()
    tokens = stream(400)
    variants = [("", {"scale": 2.0}), ("_x1", {"scale": 1.0}), ("_x2", {"scale": 2.0})]
    results = validator(model, variants, loader(tokens, batch=2), steps=3)()
    assert model.calls == {2.0: 3, 1.0: 3}
    assert results["val_bpb"] == results["val_bpb_x2"] != results["val_bpb_x1"]
    assert set(results) == {
        "val_loss",
        "val_bpb",
        "val_loss_x1",
        "val_bpb_x1",
        "val_loss_x2",
        "val_bpb_x2",
        "val_mean_input",
    }


@pytest.mark.parametrize("n_tokens,batch,world", [(200, 5, 1), (193, 5, 1), (200, 3, 2), (65, 4, 1), (400, 2, 3)])
def test_whole_split_batch_count_is_what_the_pass_yields(n_tokens, batch, world):
    data = [loader(stream(n_tokens), batch=batch, rank=r, world=world) for r in range(world)]
    assert {len(list(whole_split_batches(d))) for d in data} == {whole_split_batch_count(data[0])}


@pytest.mark.parametrize(("seconds_per_batch", "lines"), [(4.0, 4), (0.5, 0)])
def test_a_long_validation_logs_its_progress_and_a_short_one_nothing(monkeypatch, caplog, seconds_per_batch, lines):
    """A whole split of 7 batches and 2 variant groups: 14 forwards, each ``seconds_per_batch`` on a
    clock the forward advances (no waiting). At 4 s a batch the pass takes 56 s and logs every 10 s
    (after batches 3, 6, 9, 12; not the last: the results come next); at 0.5 s (7 s in all) nothing."""
    clock = [100.0]

    class Slow(Bigram):
        def forward(self, input_ids, scale: float = 1.0):
            clock[0] += seconds_per_batch
            return super().forward(input_ids, scale)

    monkeypatch.setattr(validation, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    caplog.set_level(logging.INFO, logger="spider_titan")
    model = Slow()
    check = validator(model, [("", {"scale": 1.0}), ("_x2", {"scale": 2.0})], loader(stream(200), batch=2), steps=-1)
    assert check.batches_per_pass() == 14
    assert check() is not None
    assert sum(model.calls.values()) == 14
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("validation:")]
    assert len(logged) == lines
    if lines:
        assert logged[0] == "validation: 3 of 14 batches | elapsed 12s | eta 44s"
        assert logged[-1] == "validation: 12 of 14 batches | elapsed 48s | eta 8s"


def test_eval_loops_paired_difference_matches_the_stream():
    """scripts/evaluate.py (and protocol.paired_difference, which the calibration uses): each count's bpb is the whole stream's loss (windows and tail), the
    paired difference is the difference of those losses, its standard error is 0 against itself and
    positive otherwise, and it shrinks as the split grows (about as 1/sqrt(windows))."""
    from scripts.evaluate import window_losses
    from spider_titan.protocol import paired_difference as paired

    class Looped(Bigram):
        def forward(self, input_ids, n_loops: int = 1):
            return super().forward(input_ids, scale=1.0 + 0.1 * n_loops)

    torch.manual_seed(0)
    model = Looped()
    ses = []
    for n_tokens in (1003, 16003):
        tokens = stream(n_tokens)
        data = loader(tokens, batch=3)
        base, count = window_losses(model, data, 2)
        more, _ = window_losses(model, data, 4)
        assert float(count.sum()) == n_tokens - 1
        want = [direct_loss(model, tokens, 1.0 + 0.1 * n) / math.log(2) for n in (2, 4)]
        assert float(base.sum() / count.sum()) / math.log(2) == pytest.approx(want[0], rel=1e-6)
        diff, se = paired(more, base, count)
        assert diff == pytest.approx(want[1] - want[0], abs=1e-6)
        assert paired(base, base, count) == (0.0, 0.0)
        assert se > 0
        ses.append(se)
    assert 2.0 < ses[0] / ses[1] < 8.0  # 16x the windows: about 4x smaller


def test_eval_loops_compares_models_as_trained(monkeypatch, tmp_path):
    """Several ``--model``: each runs as trained (no loop count, which a dense model would refuse) on the same
    windows, and each one's paired difference to the first is the difference of their bpb; ``--n_loops`` with
    several models is refused."""
    import json

    import scripts.evaluate as eval_loops

    torch.manual_seed(0)
    models = {"a": Bigram(), "b": Bigram()}
    for name in models:
        (tmp_path / name).mkdir()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    monkeypatch.setattr(eval_loops, "load_model", lambda path, device: (models[path.name], None))
    eval_loops.main(["--model", a, "--model", b, "--batch", "16", "--json", str(tmp_path / "rows.json")])
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["model"] for r in rows] == [a, b]
    assert (rows[0]["diff_bpb"], rows[0]["se_bpb"]) == (0.0, 0.0)
    assert rows[1]["diff_bpb"] == pytest.approx(rows[1]["val_bpb"] - rows[0]["val_bpb"], abs=1e-9)
    assert abs(rows[1]["diff_bpb"]) > 10 * rows[1]["se_bpb"] > 0  # two random tables: far apart
    with pytest.raises(SystemExit, match="one --model"):
        eval_loops.main(["--model", a, "--model", b, "--n_loops", "1,2"])
