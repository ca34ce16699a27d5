"""Spider model: causality, segmentation / hashing / pooling against plain-Python references,
edge cases (ragged segmentations, PAD, idle experts, loops at eval), losses, init.

All on the debug flavor, CPU, fp32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spider_titan.models.common import ByteNgrams
from spider_titan.models.spider import SPIDER_FLAVORS, Spider
from spider_titan.models.spider import engram as engram_mod
from spider_titan.models.spider import segmentation as seg_mod
from spider_titan.models.spider.segmentation import boundary_loss, downsample, segment_bytes, upsample
from spider_titan.vocab import BOS_ID, EOS_ID, IGNORE_INDEX, PAD_ID, VOCAB_SIZE

# Two core loops where the shipped debug flavor trains one (lab/log/2026-11-29-one-core-loop.md): the model's tests exercise what runs between loops (inject, per-loop LoRA, the extra-loop gains).
DEBUG = dataclasses.replace(SPIDER_FLAVORS["debug"], n_loops=2)
# The mean convention (a segment is the mean of its bytes, each byte reads the segment before its own),
# named where a test is about it, so a change of default cannot make the test vacuous. With a learned
# predictor H-Net's smoothing and confidence factor apply under either convention.
MEAN_PATH = {"chunk_convention": "mean"}
_pad = torch.nn.functional.pad


def build(seed: int = 0, **overrides) -> Spider:
    """The framework's path: build on meta, materialise, init_weights."""
    args = dataclasses.replace(DEBUG, **overrides)
    with torch.device("meta"):
        model = Spider(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def sample_ids(seed: int, B: int = 2, T: int = 40) -> torch.Tensor:
    """Random bytes with documents (BOS ... EOS BOS ...) and a PAD tail on the last row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    ids[:, 0] = BOS_ID
    ids[0, T // 2] = EOS_ID
    ids[0, T // 2 + 1] = BOS_ID
    ids[-1, T - 7 :] = PAD_ID
    return ids


def content_predictor(h: torch.Tensor) -> torch.Tensor:
    """A boundary predictor that depends on the (causal) prelude state: ragged segments that move
    when the bytes change."""
    return 4.0 * h[..., 0].float()


def constant_predictor(value: float):
    return lambda h: torch.full(h.shape[:-1], value, dtype=torch.float32)


def run_logits(model: Spider, ids: torch.Tensor, *, train: bool) -> torch.Tensor:
    model.train(train)
    with torch.no_grad():
        return model(ids).logits


# ------------------------------------------------------------------------------------- causality


def causality_gaps(model: Spider, ids: torch.Tensor, *, train: bool, seed: int, positions) -> list[tuple]:
    """For each u: (largest change of logits before u, largest change at or after u) when byte u changes."""
    base = run_logits(model, ids, train=train)
    g = torch.Generator().manual_seed(1000 + seed)
    out = []
    for u in positions:
        changed = ids.clone()
        changed[:, u] = (ids[:, u] + 1 + torch.randint(0, 250, (ids.shape[0],), generator=g)) % 256
        logits = run_logits(model, changed, train=train)
        before = (logits[:, :u] - base[:, :u]).abs().max().item() if u > 0 else 0.0
        after = (logits[:, u:] - base[:, u:]).abs().max().item()
        out.append((u, before, after))
    return out


def open_residual(model: Spider) -> None:
    """``residual_proj`` starts at zero, so a byte's own prelude state reaches its logits only through the
    core; a random one opens the direct path, where a leak into a byte's embedding shows under either convention."""
    with torch.no_grad():
        model.residual_proj.weight.copy_(torch.randn(model.residual_proj.weight.shape) * 0.1)


def randomize_engram_tables(model: Spider) -> None:
    """Engram and byte n-gram tables start at zero (adding nothing); random ones make a leak through their
    hashes visible."""
    g = torch.Generator().manual_seed(99)
    tables = [t for b in model.core.layers if b.engram is not None for t in (b.engram.table1, b.engram.table2)]
    tables += [] if model.byte_ngrams is None else list(model.byte_ngrams.tables)
    with torch.no_grad():
        for table in tables:
            table.weight.copy_(torch.randn(table.weight.shape, generator=g))


# Every boundary configuration (learned or fixed segments x chunk convention; a learned predictor
# brings H-Net's smoothing and confidence factor under either convention) plus forced predictors
# that make the segmentation ragged / extreme.
BOUNDARY_CONFIGS = {
    # H-Net's path (chunk = first byte, each byte reads its own chunk): the shipped default
    "first": {"boundary_predictor": "cosine", "chunk_convention": "first"},
    "mean": {"boundary_predictor": "cosine", **MEAN_PATH},
    "fixed": {"boundary_predictor": "fixed", **MEAN_PATH},
    "first_fixed": {"boundary_predictor": "fixed", "chunk_convention": "first"},
}


# Hashed byte n-grams at the input (models.common.ByteNgrams), under both conventions
NGRAMS = {"byte_ngram_orders": [2, 3, 6]}
NGRAM_CONFIGS = {"ngrams_first": {"chunk_convention": "first", **NGRAMS}, "ngrams_mean": {**MEAN_PATH, **NGRAMS}}


@pytest.mark.parametrize("predictor", [*BOUNDARY_CONFIGS, "content", "every_byte", "content_first", *NGRAM_CONFIGS])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_causality(monkeypatch, predictor, train):
    # the forced predictors with either convention: ragged segments under both read only the past
    config = NGRAM_CONFIGS.get(predictor) or (
        {"chunk_convention": "first"} if predictor == "content_first" else BOUNDARY_CONFIGS.get(predictor, MEAN_PATH)
    )
    model = build(seed=1, **config)
    randomize_engram_tables(model)
    if predictor in NGRAM_CONFIGS:
        open_residual(model)
    if predictor in ("content", "content_first"):
        monkeypatch.setattr(model.boundary_predictor, "forward", content_predictor)
    elif predictor == "every_byte":
        monkeypatch.setattr(model.boundary_predictor, "forward", constant_predictor(20.0))
    for seed in range(2):
        ids = sample_ids(seed)
        for u, before, after in causality_gaps(
            model, ids, train=train, seed=seed, positions=[0, 3, 11, 19, 26, 33, 39]
        ):
            assert before < 1e-5, f"seed {seed}, u={u}: logits before u moved by {before}"
            assert after > 1e-4, f"seed {seed}, u={u}: changing byte u changed nothing (vacuous test)"


def build_for_leak(monkeypatch, segments: str, convention: str) -> Spider:
    """A model for the negative controls: learned segments made ragged by the content predictor, or fixed ones."""
    if segments == "fixed":
        return build(seed=1, boundary_predictor="fixed", chunk_convention=convention)
    model = build(seed=1, chunk_convention=convention)
    monkeypatch.setattr(model.boundary_predictor, "forward", content_predictor)
    return model


@pytest.mark.parametrize("segments", ["learned", "fixed"])
def test_causality_check_catches_a_missing_shift(monkeypatch, segments):
    """The same check flags a model of the mean convention whose upsample lets a byte read its own segment."""

    def leaky_upsample(y, seg):
        own = seg.seg_id[:, :, None] == torch.arange(seg.num_segments)[None, None, :]
        return torch.bmm(own.to(y.dtype), y)

    model = build_for_leak(monkeypatch, segments, "mean")
    monkeypatch.setattr(seg_mod, "upsample", leaky_upsample)
    gaps = causality_gaps(model, sample_ids(0), train=False, seed=0, positions=[3, 11, 19, 26, 33])
    assert max(before for _, before, _ in gaps) > 1e-3


@pytest.mark.parametrize("convention", ["first", "mean"])
def test_causality_check_catches_byte_ngrams_that_read_the_next_byte(monkeypatch, convention):
    """Each byte's n-gram buckets shifted one byte back (the n-gram ending at the next byte): the check flags it."""
    model = build(seed=1, **NGRAM_CONFIGS[f"ngrams_{convention}"])
    randomize_engram_tables(model)
    open_residual(model)
    own = ByteNgrams.bucket_ids
    monkeypatch.setattr(
        ByteNgrams, "bucket_ids", lambda self, ids, first=0: _pad(own(self, ids, first)[:, 1:], (0, 0, 0, 1))
    )
    gaps = causality_gaps(model, sample_ids(0), train=False, seed=0, positions=[3, 11, 19, 26, 33])
    assert max(before for _, before, _ in gaps) > 1e-3


@pytest.mark.parametrize("segments", ["learned", "fixed"])
@pytest.mark.parametrize("leak", ["mean_chunk", "last_byte_chunk", "unshifted_engram"])
def test_causality_check_catches_leaks_of_the_first_byte_convention(monkeypatch, leak, segments):
    """Under ``chunk_convention = "first"`` a byte reads its own chunk, so the chunk's vector may read
    nothing past the chunk's first byte: the check flags a chunk made of the segment mean, of its
    last byte, or an Engram that hashes the chunk's own bytes."""
    model = build_for_leak(monkeypatch, segments, "first")
    if leak == "mean_chunk":
        monkeypatch.setattr(seg_mod, "downsample_first", seg_mod.downsample)
    elif leak == "last_byte_chunk":
        monkeypatch.setattr(
            seg_mod,
            "downsample_first",
            lambda x, seg: x.gather(1, seg.ends[..., None].expand(-1, -1, x.shape[-1])),
        )
    else:
        randomize_engram_tables(model)
        own = seg_mod.engram_bucket_ids  # shifted back by one chunk: the Chunker's shift then hashes chunk k itself
        monkeypatch.setattr(seg_mod, "engram_bucket_ids", lambda *a: _pad(own(*a)[:, 1:], (0, 0, 0, 1)))
    gaps = causality_gaps(model, sample_ids(0), train=False, seed=0, positions=[3, 11, 19, 26, 33])
    assert max(before for _, before, _ in gaps) > 1e-3


# ------------------------------------------------------------------- segmentation vs reference


def reference_boundaries(ids: list[int], decide: list[bool], max_bytes: int) -> list[bool]:
    """The rules of segmentation.py, applied byte by byte."""
    out, run, T = [], 0, len(ids)
    for t in range(T):
        run += 1
        pad = ids[t] == PAD_ID
        next_pad = t + 1 < T and ids[t + 1] == PAD_ID
        b = (decide[t] and not pad) or ids[t] in (BOS_ID, EOS_ID) or pad != next_pad or t == T - 1 or run == max_bytes
        out.append(b)
        if b:
            run = 0
    return out


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5, 1.0])
def test_segmentation_matches_reference(rate):
    g = torch.Generator().manual_seed(7)
    B, T, L = 4, 90, 6
    ids = torch.randint(0, 256, (B, T), generator=g)
    ids[:, 0] = BOS_ID
    ids[1, 30] = EOS_ID
    ids[1, 31] = BOS_ID
    ids[2, 60:] = PAD_ID  # right padding, longer than L
    ids[3, 10:25] = PAD_ID  # a PAD run in the middle
    ids[3, :3] = PAD_ID  # left padding
    decide = torch.rand(B, T, generator=g) < rate
    logits = torch.where(decide, 5.0, -5.0)
    seg = segment_bytes(logits, ids, max_segment_bytes=L)

    ref = [reference_boundaries(ids[b].tolist(), decide[b].tolist(), L) for b in range(B)]
    assert seg.boundaries.tolist() == ref
    assert seg.num_segments == max(sum(r) for r in ref)
    for b in range(B):
        seg_id, pos, k, start = [], [], 0, 0
        ends = [t for t in range(T) if ref[b][t]]
        for t in range(T):
            seg_id.append(k)
            pos.append(t - start)
            if ref[b][t]:
                k, start = k + 1, t + 1
        assert seg.seg_id[b].tolist() == seg_id
        assert seg.pos_in_seg[b].tolist() == pos
        assert max(pos) < L
        n = len(ends)
        assert seg.ends[b, :n].tolist() == ends
        assert seg.seg_valid[b].tolist() == [s < n for s in range(seg.num_segments)]
        real = [s < n and ids[b, ends[s]].item() != PAD_ID for s in range(seg.num_segments)]
        assert seg.seg_real[b].tolist() == real
        # no segment mixes PAD and real bytes
        for s in range(n):
            lo = ends[s - 1] + 1 if s else 0
            kinds = {ids[b, t].item() == PAD_ID for t in range(lo, ends[s] + 1)}
            assert len(kinds) == 1


def test_pooling_matches_reference():
    g = torch.Generator().manual_seed(3)
    B, T, D = 2, 30, 8
    ids = torch.randint(0, 256, (B, T), generator=g)
    ids[1, 20:] = PAD_ID
    logits = torch.randn(B, T, generator=g) * 3
    seg = segment_bytes(logits, ids, max_segment_bytes=5)
    x = torch.randn(B, T, D, generator=g)
    s = downsample(x, seg)
    y = torch.randn(B, seg.num_segments, D, generator=g)
    up = upsample(y, seg)
    for b in range(B):
        for k in range(seg.num_segments):
            members = [t for t in range(T) if seg.seg_id[b, t] == k]
            want = x[b, members].mean(0) if members else torch.zeros(D)
            torch.testing.assert_close(s[b, k], want)
        for t in range(T):
            k = seg.seg_id[b, t].item()
            want = y[b, k - 1] if k > 0 else torch.zeros(D)
            torch.testing.assert_close(up[b, t], want)


def test_engram_hash_matches_reference():
    P, BASE, PAIR = engram_mod._P, engram_mod._BASE, engram_mod._PAIR
    g = torch.Generator().manual_seed(5)
    B, T, L, n_buckets = 2, 50, 7, 1024
    ids = torch.randint(0, 256, (B, T), generator=g)
    ids[0, 10:17] = ids[0, 30:37]  # a repeated chunk
    seg = segment_bytes(torch.randn(B, T, generator=g) * 2, ids, max_segment_bytes=L)
    got = engram_mod.engram_bucket_ids(ids, seg.pos_in_seg, seg.ends, n_buckets, L)
    for b in range(B):
        ends = [t for t in range(T) if seg.boundaries[b, t]]
        prev, lo = 0, 0
        for k, end in enumerate(ends):
            chunk = ids[b, lo : end + 1].tolist()
            h1 = sum((c + 1) * pow(BASE, j, P) for j, c in enumerate(chunk)) % P
            h2 = (prev * PAIR + h1 + 1) % P
            want = [
                (h1 * engram_mod._MIX[0] + engram_mod._ADD[0]) % P % n_buckets,
                (h2 * engram_mod._MIX[1] + engram_mod._ADD[1]) % P % n_buckets,
            ]
            assert got[b, k].tolist() == want
            prev, lo = h1, end + 1


def test_byte_ngram_hash_matches_reference():
    """Order n's bucket at byte p is a hash of bytes p-n+1..p alone (0 before the row's start), the same
    n-gram gets the same bucket anywhere, and a window from ``first`` gives the whole row's buckets there."""
    from spider_titan.models import common

    P, BASE = common.HASH_PRIME, common.HASH_BASE
    g = torch.Generator().manual_seed(6)
    orders, n_buckets = [2, 3, 5], 1000
    ngrams = common.ByteNgrams(orders, n_buckets, dim=4)
    ids = torch.randint(0, 272, (2, 40), generator=g)
    ids[1, 20:26] = ids[1, 4:10]  # a repeated 6-gram
    got = ngrams.bucket_ids(ids)
    assert got.shape == (2, 40, 3)
    for b in range(2):
        for p in range(40):
            for i, n in enumerate(orders):
                h = sum((ids[b, p - j].item() + 1 if p >= j else 0) * pow(BASE, j, P) for j in range(n)) % P
                want = (h * (common.HASH_MIX * (n + 1) % P) + common.HASH_ADD + n - 1) % P % n_buckets
                assert got[b, p, i].item() == want, (b, p, n)
    assert torch.equal(got[1, 25], got[1, 9])  # every order of the repeated 6-gram's last byte
    for first in (0, 1, 3, 4, 17, 39):
        assert torch.equal(ngrams.bucket_ids(ids, first), got[:, first:])


def test_byte_ngrams_start_as_nothing_and_learn():
    """Zero tables: the same logits as the model without them (the other weights drawn alike); one
    backward reaches every row the real bytes' n-grams hit (not the PAD tail's alone: no loss reads it)
    and no other, in every table; no weight decay on them."""
    from spider_titan.optim.optimizers import param_groups

    ids = sample_ids(0)
    plain, with_ngrams = build(seed=3), build(seed=3, **NGRAMS)
    torch.testing.assert_close(run_logits(with_ngrams, ids, train=False), run_logits(plain, ids, train=False))
    with_ngrams.train()
    with_ngrams(ids, labels=torch.roll(ids, -1, dims=1)).loss.backward()
    buckets = with_ngrams.byte_ngrams.bucket_ids(ids)
    real = ids != PAD_ID
    for i, table in enumerate(with_ngrams.byte_ngrams.tables):
        hit, hit_real = (torch.zeros(table.num_embeddings, dtype=torch.bool) for _ in range(2))
        hit[buckets[..., i].flatten()] = True
        hit_real[buckets[..., i][real]] = True
        row_grad = table.weight.grad.abs().sum(-1)
        assert (row_grad[hit_real] > 0).all() and (row_grad[~hit] == 0).all()
    tables = {id(t.weight) for t in with_ngrams.byte_ngrams.tables}
    groups = param_groups(with_ngrams, weight_decay=0.1, lr=1e-3)
    assert all(g["weight_decay"] == 0.0 for g in groups if any(id(p) in tables for p in g["params"]))


# ------------------------------------------------------------------------------ losses and aux


@pytest.mark.parametrize("config", ["first", "mean", "fixed"])
def test_forward_losses_and_aux(config):
    model = build(**BOUNDARY_CONFIGS[config])
    ids = sample_ids(0, B=3, T=48)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    out = model(ids, labels=labels)
    a = model.args
    assert out.logits.shape == (3, 48, VOCAB_SIZE)
    for key in (
        "lm_loss",
        "moe_aux_loss",
        "boundary_loss",
        "bytes_per_segment",
        "mean_loops",
        "loops_run",
        "expert_load_min",
        "expert_load_max",
        "flops_per_byte",
    ):
        assert out.aux[key].dim() == 0 and torch.isfinite(out.aux[key]), key
    want_aux = a.moe_aux_coeff * out.aux["moe_aux_loss"] + a.boundary_coeff * out.aux["boundary_loss"]
    torch.testing.assert_close(out.aux_loss.detach(), want_aux)
    torch.testing.assert_close(out.loss.detach(), out.aux["lm_loss"] + want_aux)
    assert out.aux["expert_load_min"] <= 1 / a.n_experts <= out.aux["expert_load_max"]
    assert 1.0 <= out.aux["bytes_per_segment"] <= a.max_segment_bytes
    assert out.aux["loops_run"] == a.n_loops == out.aux["mean_loops"]
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name

    # Without labels: no loss, the same auxiliary part.
    bare = model(ids)
    assert bare.loss is None and "lm_loss" not in bare.aux
    torch.testing.assert_close(bare.aux_loss, out.aux_loss)


def test_pad_labels_are_ignored():
    model = build().eval()
    ids = sample_ids(0)
    labels = torch.roll(ids, -1, dims=1)
    as_pad = model(ids, labels=labels).loss
    as_ignore = model(ids, labels=labels.masked_fill(labels == PAD_ID, IGNORE_INDEX)).loss
    torch.testing.assert_close(as_pad, as_ignore)


@pytest.mark.parametrize("predictor", [20.0, -20.0], ids=["every_byte", "forced_only"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_extreme_segmentations(monkeypatch, predictor, train):
    model = build().train(train)
    monkeypatch.setattr(model.boundary_predictor, "forward", constant_predictor(predictor))
    ids = sample_ids(2, B=2, T=45)
    labels = torch.roll(ids, -1, dims=1)
    out = model(ids, labels=labels)
    assert torch.isfinite(out.loss) and torch.isfinite(out.logits).all()
    n_real_bytes = (ids != PAD_ID).sum().item()
    decide = [[predictor > 0] * ids.shape[1]] * 2
    ref = [reference_boundaries(ids[b].tolist(), decide[b], DEBUG.max_segment_bytes) for b in range(2)]
    n_real_segments = sum(1 for b in range(2) for t in range(ids.shape[1]) if ref[b][t] and ids[b, t] != PAD_ID)
    torch.testing.assert_close(out.aux["bytes_per_segment"], torch.tensor(n_real_bytes / n_real_segments))
    if predictor > 0:
        assert out.aux["bytes_per_segment"] == 1.0
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_padding_segments_do_not_affect_other_rows(monkeypatch):
    """Row A alone vs next to a row with many more segments (and PAD): A's logits are the same,
    even though the batch pads A's segments."""
    model = build(seed=3).eval()
    monkeypatch.setattr(model.boundary_predictor, "forward", content_predictor)
    a = sample_ids(4, B=1, T=40)
    other = sample_ids(5, B=1, T=40)
    other[0, 1::3] = EOS_ID  # forced boundaries: many short segments
    other[0, -5:] = PAD_ID
    with torch.no_grad():
        alone = model(a, n_loops=4).logits
        batched = model(torch.cat([a, other]), n_loops=4).logits
    torch.testing.assert_close(batched[:1], alone, atol=1e-5, rtol=1e-5)


def test_idle_expert_gets_zero_gradient():
    model = build().train()
    for block in model.core.layers:
        block.moe.expert_bias[0] = -1e4  # expert 0 is never selected (selection only)
    ids = sample_ids(0)
    out = model(ids, labels=torch.roll(ids, -1, dims=1))
    assert out.aux["expert_load_min"] == 0.0
    out.loss.backward()
    for name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), name
    for block in model.core.layers:
        for w in (block.moe.experts.w1, block.moe.experts.w2, block.moe.experts.w3):
            assert (w.grad[0] == 0).all()
            assert w.grad[1:].abs().sum() > 0


# ------------------------------------------------------------------------------------- loops


def test_fixed_depth_runs_exactly_n_loops():
    """Eval runs exactly the n_loops asked for (up to max_loops, past it an error), and more loops
    change the output."""
    model = build().eval()
    ids = sample_ids(0)
    max_loops = model.args.max_loops
    with torch.no_grad():
        outs = {n: model(ids, n_loops=n) for n in (1, 2, max_loops)}
    for n, out in outs.items():
        assert out.aux["loops_run"] == n and out.aux["mean_loops"] == n
    # At init the core reaches the logits through a small up_proj (depth-scaled std), so the
    # change is small, but far above float noise (identical runs agree to ~1e-7).
    assert (outs[2].logits - outs[1].logits).abs().max() > 1e-5
    assert (outs[max_loops].logits - outs[2].logits).abs().max() > 1e-5
    with pytest.raises(ValueError, match="n_loops"):
        model(ids, n_loops=max_loops + 1)


# ------------------------------------------------------------------------------ build and init


def test_init_weights_sets_every_tensor():
    model = build()
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.fill_(float("nan"))
    torch.manual_seed(0)
    model.init_weights()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert torch.isfinite(t).all(), name
    zero = [model.core.loop_embedding.weight]
    for block in model.core.layers:
        zero += [block.lora.wq_b, block.lora.wo_b, block.moe.expert_bias]
        if block.engram is not None:
            zero += [block.engram.table1.weight, block.engram.table2.weight]
    assert all((t == 0).all() for t in zero)
    assert model.core.layers[1].engram is not None and model.core.layers[0].engram is None
    # deterministic for a seed
    again = build()
    for (n, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), n


def test_module_names():
    names = {n for n, _ in build().named_modules()}
    for want in (
        "embed_tokens",
        "prelude.layers.0",
        "boundary_predictor",
        "core.layers.1.engram",
        "core.loop_embedding",
        "core.layers.0.moe.router",
        "core.layers.0.moe.experts",
        "core.layers.0.attention.wq",
        "core.layers.0.attention.wo",
        "core.layers.0.attention.kv_norm",
        "coda.layers.0",
        "norm",
        "lm_head",
        "up_proj",
        "residual_proj",
    ):
        assert want in names, want
    assert isinstance(build().core.layers[0].attention.wq, torch.nn.Linear)


def test_bad_args_and_inputs_raise():
    """A field's own bounds (declared with ranged) and the rules between fields are checked in one place,
    config.validate.model_args_problems: at config parse and for a saved model's args."""
    from spider_titan.config.validate import model_args_problems
    from spider_titan.models.spider.model import SPIDER_SPEC

    assert model_args_problems(SPIDER_SPEC, DEBUG) == []
    assert any("n_loops" in p for p in model_args_problems(SPIDER_SPEC, dataclasses.replace(DEBUG, n_loops=9)))
    bad = model_args_problems(SPIDER_SPEC, dataclasses.replace(DEBUG, engram_layers=[5], dim=0, boundary_coeff=-1.0))
    assert any(p.startswith("model.engram_layers") for p in bad), bad
    assert any(p.startswith("model.dim = 0 is not allowed") for p in bad), bad
    assert any(p.startswith("model.boundary_coeff = -1.0 is not allowed") for p in bad), bad
    model = build(max_seq_len=32)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


# ----------------------------------------------------------- one boundary rule, pooling, objectives


def test_train_and_eval_segment_with_one_rule(monkeypatch):
    """Training and eval call the same rule (p >= 0.5) on the same probabilities, so a batch is
    segmented identically and, with fixed depth, gives the same logits."""
    calls = []
    real = seg_mod.segment_bytes

    def spy(*args, **kwargs):
        seg = real(*args, **kwargs)
        calls.append(seg.boundaries.clone())
        return seg

    monkeypatch.setattr(seg_mod, "segment_bytes", spy)
    model = build(seed=2)
    ids = sample_ids(3, B=3, T=64)
    with torch.no_grad():
        tr = model.train()(ids, sample_ids=torch.arange(3))
        ev = model.eval()(ids)
    assert len(calls) == 2 and torch.equal(calls[0], calls[1])
    assert 0 < calls[0].float().mean() < 1  # a real, ragged segmentation
    torch.testing.assert_close(tr.aux["bytes_per_segment"], ev.aux["bytes_per_segment"])
    torch.testing.assert_close(tr.logits, ev.logits)


def dense_pooling_reference(x, y, seg):
    """The pre-2026-11-23 pooling: dense (B, S, T) / (B, T, S) matrices and bmm."""
    S = seg.num_segments
    member = seg.seg_id[:, None, :] == torch.arange(S)[None, :, None]
    w = member.float()
    count = w.sum(dim=-1, keepdim=True)
    w = w / torch.where(member.any(dim=-1, keepdim=True), count, torch.ones_like(count))
    source = (seg.seg_id - 1)[:, :, None] == torch.arange(S)[None, None, :]
    return torch.bmm(w, x), torch.bmm(source.float(), y)


def test_scatter_pooling_equals_dense_reference_with_gradients():
    g = torch.Generator().manual_seed(4)
    B, T, D = 3, 70, 16
    ids = torch.randint(0, 256, (B, T), generator=g)
    ids[2, 50:] = PAD_ID
    outs = []
    for impl in ("scatter", "dense"):
        logits = (torch.randn(B, T, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_()
        x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(2)).requires_grad_()
        seg = segment_bytes(logits, ids, max_segment_bytes=6)
        y = torch.randn(B, seg.num_segments, D, generator=torch.Generator().manual_seed(3)).requires_grad_()
        s, up = (downsample(x, seg), upsample(y, seg)) if impl == "scatter" else dense_pooling_reference(x, y, seg)
        w = torch.randn(B, T, D, generator=torch.Generator().manual_seed(5))
        ((s * s).sum() + (up * w).sum()).backward()
        assert (
            logits.grad is None
        )  # pooling is hard: the predictor learns through the Chunker's smoothing and confidence
        outs.append((s, up, x.grad, y.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_ratio_loss():
    """The ratio loss (no band): minimum 1 at F = G = 1/N and pushes p both ways."""
    ids = torch.randint(0, 256, (1, 400), generator=torch.Generator().manual_seed(0))
    grads = []
    for rate in (0.05, 0.5):  # too few / too many boundaries, with target 4 bytes per segment
        logits = torch.full((1, 400), torch.logit(torch.tensor(rate)).item(), requires_grad=True)
        decide = torch.rand(1, 400, generator=torch.Generator().manual_seed(1)) < rate
        seg = segment_bytes(logits, ids, max_segment_bytes=400)
        seg.boundaries = decide | seg.boundaries & ~seg.decided
        loss = boundary_loss(seg, 4.0, 0.0, 1.0)
        loss.backward()
        grads.append(logits.grad.sum().item())
    assert grads[0] < 0 < grads[1]  # descending raises p when too few, lowers it when too many
    seg.probs = torch.full((1, 400), 0.25)
    seg.boundaries = torch.arange(400)[None] % 4 == 3
    torch.testing.assert_close(boundary_loss(seg, 4.0, 0.0, 1.0), torch.tensor(1.0))


def test_boundary_band_dead_zone():
    """The ratio loss's band: a row inside target * (1 +- band) gets value 1 and no gradient; a row outside gets
    the ratio loss aimed at the band's nearest edge (compared with the plain loss at that target), so
    it is pulled back towards the band."""
    T = 480
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))

    def loss_and_grad(every, target, band, upper=1.0):  # a boundary every `every` bytes, p = 0.3
        logits = torch.full((1, T), torch.logit(torch.tensor(0.3)).item(), requires_grad=True)
        seg = segment_bytes(logits, ids, max_segment_bytes=T)
        seg.boundaries = (torch.arange(T)[None] % every == every - 1) | seg.boundaries & ~seg.decided
        loss = boundary_loss(seg, target, band, upper)
        loss.backward()
        return loss.detach(), logits.grad

    # 5, 4 and 3 bytes per segment (T is a multiple of each) lie inside 4 +- 25 %, edges included
    for every in (5, 4, 3):
        loss, grad = loss_and_grad(every, 4.0, 0.25)
        plain_grad = loss_and_grad(every, 4.0, 0.0)[1]
        torch.testing.assert_close(loss, torch.tensor(1.0))
        assert grad.abs().max() < 1e-6
        assert (plain_grad.abs().max() > 1e-4) == (every != 4)  # the plain loss pulls off the target
    # outside the band: the plain loss at the nearest edge, pulling back (p down when too many boundaries)
    for every, edge in ((2, 3.0), (8, 5.0)):
        loss, grad = loss_and_grad(every, 4.0, 0.25)
        ref, ref_grad = loss_and_grad(every, edge, 0.0)
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(grad, ref_grad)
        assert (grad.sum() > 0) == (every == 2)  # descending lowers p when segments are too short
    # the upper weight: a row above the band (8 bytes) weighted by it, a row below (2 bytes) not
    for every, factor in ((8, 0.3), (2, 1.0)):
        loss, grad = loss_and_grad(every, 4.0, 0.25, upper=0.3)
        band_loss, band_grad = loss_and_grad(every, 4.0, 0.25)
        torch.testing.assert_close(loss, factor * band_loss)
        torch.testing.assert_close(grad, factor * band_grad)
    # the model's own loss is this one at RATIO_BAND / RATIO_BAND_UPPER, and a target whose band reaches
    # down to one byte per segment is refused in one line
    from spider_titan.models.spider.args import RATIO_BAND, RATIO_BAND_UPPER

    model = build(seed=1)
    seg = model.chunker.segment(model.chunker.logits(model.boundary_predictor, torch.randn(1, T, DEBUG.dim)), ids)
    torch.testing.assert_close(model.chunker.loss(seg), boundary_loss(seg, 4.0, RATIO_BAND, RATIO_BAND_UPPER))
    assert not torch.allclose(model.chunker.loss(seg), boundary_loss(seg, 4.0, 0.0, 1.0))
    assert dataclasses.replace(DEBUG, target_bytes_per_segment=1.3).validate() == []
    (problem,) = dataclasses.replace(DEBUG, target_bytes_per_segment=1.2).validate()
    assert problem.startswith("target_bytes_per_segment: 1.2 puts the ratio loss's band") and "above 1.25" in problem


def test_boundary_loss_trains_the_predictor_and_the_prelude(monkeypatch):
    """The boundary loss's gradient reaches the predictor and, through it, the prelude and its input
    embeddings (and nothing after the segmentation)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 48))
    caught = []
    real = seg_mod.boundary_loss
    monkeypatch.setattr(seg_mod, "boundary_loss", lambda *a: caught.append(real(*a)) or caught[-1])
    model = build(seed=1)
    model(ids)
    assert len(caught) == 1
    caught[0].backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any(n.startswith("prelude.") for n in grads)
    assert any(n.startswith("boundary_predictor.") for n in grads)
    assert any(n.startswith("byte_ngrams.") for n in grads)
    before = ("embed_tokens.", "byte_ngrams.", "prelude.", "boundary_predictor.")
    assert all(n.startswith(before) for n in grads), sorted(grads)


def test_eval_variants():
    from spider_titan.models.spider import SPIDER_SPEC

    variants = SPIDER_SPEC.training.eval_variants(DEBUG)
    # the default pass is the trained loop count: the validator runs it once with "_loops2"
    assert variants == [
        ("", {"n_loops": 2}),
        ("_loops1", {"n_loops": 1}),
        ("_loops2", {"n_loops": 2}),
        ("_loops4", {"n_loops": 4}),
    ]
    big = dataclasses.replace(DEBUG, max_loops=8)
    assert SPIDER_SPEC.training.eval_variants(big)[-1] == ("_loops8", {"n_loops": 8})


# ------------------------------------------------------------------------------ bucketed segment count


@pytest.mark.parametrize("config", ["first", "mean", "fixed"])
@pytest.mark.parametrize("n_loops", [1, 3])
def test_segment_bucket_changes_nothing_but_the_core_shape(config, n_loops):
    """S padded to a bucket of 64 (the core runs on 64 segments, not ~12-48): logits, every loss,
    every reported figure and every gradient equal the unbucketed model's within 1e-6 (fp32),
    in training and at eval. The pad segments sit after every real segment, so causal attention
    alone keeps them out of the real ones; the MoE statistics mask them."""
    ids = sample_ids(3, B=3, T=48)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    shapes = {}

    def record_shape(module, args, kwargs):
        shapes[module.args.segment_bucket] = args[0].shape

    runs = {}
    for bucket in (1, 64):
        model = build(**BOUNDARY_CONFIGS[config], n_loops=n_loops, segment_bucket=bucket)
        model.core.register_forward_pre_hook(record_shape, with_kwargs=True)
        out = model(ids, labels=labels)
        out.loss.backward()
        model.eval()
        with torch.no_grad():
            eval_out = model(ids, labels=labels, n_loops=n_loops + 1)
        runs[bucket] = (out, eval_out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert shapes[64][1] == 48 and shapes[1][1] < 48  # the bucket really padded (capped at T = 48)
    (a, a_eval, a_grads), (b, b_eval, b_grads) = runs[1], runs[64]
    exact = dict(rtol=1e-6, atol=1e-6)  # fp32 rounding of GEMMs over 48 rows instead of ~20
    torch.testing.assert_close(b.logits, a.logits, **exact)
    torch.testing.assert_close(b.loss, a.loss, **exact)
    torch.testing.assert_close(b_eval.logits, a_eval.logits, **exact)
    assert sorted(b.aux) == sorted(a.aux)
    for key in a.aux:
        torch.testing.assert_close(b.aux[key], a.aux[key], rtol=1e-6, atol=1e-6, msg=key)
        torch.testing.assert_close(b_eval.aux[key], a_eval.aux[key], rtol=1e-6, atol=1e-6, msg=key)
    assert sorted(b_grads) == sorted(a_grads)
    for name, g in a_grads.items():
        # relative to the tensor's largest entry: residual_proj's gradient (a sum over every byte) reaches ~1e3
        scale = max(1.0, g.abs().max().item())
        torch.testing.assert_close(b_grads[name], g, rtol=1e-6, atol=1e-6 * scale, msg=name)


def test_segment_bucket_rounds_up_and_stops_at_the_sequence_length():
    ids = sample_ids(1, B=2, T=40)
    logits = torch.full((2, 40), -30.0)  # forced boundaries only: the length cap makes S = 40 / 16 rounded up
    base = segment_bytes(logits, ids, max_segment_bytes=4)
    for bucket, want in ((1, base.num_segments), (8, 16), (64, 40)):
        seg = segment_bytes(logits, ids, max_segment_bytes=4, bucket=bucket)
        assert (seg.num_segments, seg.max_row_segments) == (want, base.num_segments)
        assert seg.seg_valid.shape == seg.seg_real.shape == seg.ends.shape == (2, want)
        n = base.num_segments
        assert torch.equal(seg.seg_real[:, :n], base.seg_real) and not seg.seg_valid[:, n:].any()
        assert torch.equal(seg.ends[:, :n], base.ends)
