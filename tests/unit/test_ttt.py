"""Score-first test-time training (spider_titan/training/ttt.py): the three proofs (causality with a
negative control, a learning rate of 0 equals plain evaluation, documents independent), and that the
adapters do learn."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spider_titan import registry
from spider_titan.components.builder import materialize
from spider_titan.protocol import window_cross_entropy
from spider_titan.training.ttt import (
    DocumentEvaluator,
    TTTSettings,
    adapt_on_prompt,
    chunk_windows,
    score_documents,
    split_documents,
)
from spider_titan.vocab import BOS_ID, EOS_ID

SEQ, CHUNK = 48, 16
FAST = TTTSettings(chunk_bytes=CHUNK, steps=2, lr=0.05, rank=4, blocks=1)


@pytest.fixture(scope="module", params=["spider", "dense"])
def model(request):
    spec = registry.get("model", request.param)
    torch.manual_seed(0)
    m = spec.build_on_meta(spec.build_args("debug"))
    materialize(m, torch.device("cpu"), seed=0)
    return m.eval(), spec


def doc(rng: np.random.Generator, n: int, alphabet: bytes = b"abcdefgh (){}=\n") -> np.ndarray:
    body = rng.choice(np.frombuffer(alphabet, dtype=np.uint8), size=n).astype(np.int64)
    return np.concatenate([[BOS_ID], body, [EOS_ID]])


class LearnFirst(DocumentEvaluator):
    """The negative control: learns from each chunk BEFORE scoring it."""

    def step_chunk(self, keys, inputs, labels, rows, new_docs):
        _, n, loss, _ = self.score_chunk(inputs, labels, rows, new_docs)
        self.learn_chunk(inputs, labels, loss, n)
        ce, n, _, logits = self.score_chunk(inputs, labels, rows, [])
        self.on_scored(keys, logits, labels)
        return ce.tolist(), n.long().tolist()


def predictions(cls, model, spec, docs, settings):
    """{(doc, doc position): log-probabilities} of every scored prediction."""
    out = {}

    def keep(keys, logits, labels):
        for row, (d, c) in enumerate(keys):
            w, _, e = chunk_windows(docs[d].size - 1, settings.chunk_bytes, SEQ)[c]
            logp = torch.log_softmax(logits[row].float(), -1)
            for i in torch.nonzero(labels[row] != -100).flatten().tolist():
                out[(d, w + i)] = logp[i]

    cls(model, spec, seq_len=SEQ, ttt=settings, batch_size=2, on_scored=keep).score(docs)
    return out


def leaks(cls, model, spec) -> float:
    """The largest change of a prediction at a position before byte q when byte q changes."""
    rng = np.random.default_rng(1)
    docs = [doc(rng, 70), doc(rng, 55)]
    q = 2 * CHUNK + CHUNK // 2  # inside the third chunk of document 0
    changed = [d.copy() for d in docs]
    changed[0][q] = (changed[0][q] + 1) % 256
    a, b = predictions(cls, model, spec, docs, FAST), predictions(cls, model, spec, changed, FAST)
    assert a.keys() == b.keys()
    before = [k for k in a if k[0] == 0 and k[1] < q]
    assert len(before) == q  # every prediction of positions 0..q-1 was scored once
    return max(float((a[k] - b[k]).abs().max()) for k in before)


def test_no_byte_is_scored_by_weights_that_saw_it(model):
    m, spec = model
    assert leaks(DocumentEvaluator, m, spec) < 1e-5
    # The control learns from each chunk before scoring it: the same check must catch it.
    assert leaks(LearnFirst, m, spec) > 1e-3


def test_learning_rate_zero_equals_plain_evaluation_exactly(model):
    m, spec = model
    rng = np.random.default_rng(2)
    docs = [doc(rng, n) for n in (100, 37, 64, 5)]
    plain = score_documents(m, spec, docs, seq_len=SEQ, ttt=None, chunk_bytes=CHUNK, batch_size=3)
    zero = score_documents(m, spec, docs, seq_len=SEQ, ttt=TTTSettings(chunk_bytes=CHUNK, lr=0.0), batch_size=3)
    assert torch.equal(plain.ce, zero.ce) and torch.equal(plain.count, zero.count)
    assert int(plain.count.sum()) == sum(d.size - 1 for d in docs)  # every prediction once
    # Plain evaluation with whole-window chunks is the model's own forward over each document.
    short = [doc(rng, 40), doc(rng, 20)]
    whole = score_documents(m, spec, short, seq_len=SEQ, ttt=None, batch_size=1)
    for d, tokens in enumerate(short):
        ids = torch.from_numpy(tokens).unsqueeze(0)
        with torch.no_grad():
            ce, _ = window_cross_entropy(m(ids[:, :-1]).logits, ids[:, 1:])
        assert torch.allclose(whole.ce[whole.doc == d].sum(), ce.sum(), rtol=1e-6)


def test_a_documents_score_does_not_depend_on_the_one_before(model):
    m, spec = model
    rng = np.random.default_rng(3)
    a, b, c = doc(rng, 90), doc(rng, 41), doc(rng, 75)
    after_a = score_documents(m, spec, [a, c], seq_len=SEQ, ttt=FAST, batch_size=1)
    after_b = score_documents(m, spec, [b, c], seq_len=SEQ, ttt=FAST, batch_size=1)
    assert torch.equal(after_a.ce[after_a.doc == 1], after_b.ce[after_b.doc == 1])
    with torch.no_grad():  # as an eval pass calls it: the evaluator still learns
        assert torch.equal(score_documents(m, spec, [a, c], seq_len=SEQ, ttt=FAST, batch_size=1).ce, after_a.ce)
    # ... and adapting does change scores (so the equality above is not vacuous).
    plain = score_documents(m, spec, [a, c], seq_len=SEQ, ttt=None, chunk_bytes=CHUNK, batch_size=1)
    assert not torch.equal(plain.ce[plain.doc == 1], after_a.ce[after_a.doc == 1])


def test_adapters_learn_a_documents_own_statistics(model):
    """A document over four byte values: after its first chunks the adapted model predicts it better."""
    m, spec = model
    rng = np.random.default_rng(4)
    docs = [doc(rng, 240, alphabet=b"xyz.") for _ in range(2)]
    settings = TTTSettings(chunk_bytes=CHUNK, steps=2, lr=0.05, rank=4)
    plain = score_documents(m, spec, docs, seq_len=SEQ, ttt=None, chunk_bytes=CHUNK)
    adapted = score_documents(m, spec, docs, seq_len=SEQ, ttt=settings)
    assert adapted.bpb < plain.bpb - 0.5
    assert adapted.adapted and all(
        name.endswith(("w1", "w2", "w3", "wo", "wq", "wk", "wv", "wkv_a", "wkv_b")) for name in adapted.adapted
    )
    # The model's own parameters never change, and no adapter is left on it.
    before = {k: v.clone() for k, v in m.state_dict().items()}
    score_documents(m, spec, docs[:1], seq_len=SEQ, ttt=settings)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    with torch.no_grad():
        ids = torch.from_numpy(docs[0][:SEQ]).unsqueeze(0)
        assert torch.equal(m(ids).logits, m(ids).logits)
    assert not any(mod._forward_hooks for mod in m.modules())


def test_adapt_on_prompt_keeps_the_adapters_until_removed(model):
    m, spec = model
    rng = np.random.default_rng(5)
    prompt = doc(rng, 120)[:-1]
    ids = torch.from_numpy(prompt[-SEQ:]).unsqueeze(0)
    with torch.no_grad():
        base = m(ids).logits
    adapters, scores = adapt_on_prompt(m, spec, prompt, FAST, seq_len=SEQ, device=torch.device("cpu"))
    assert int(scores.count.sum()) == prompt.size - 1
    with torch.no_grad():
        assert not torch.allclose(m(ids).logits, base)
    # The cached decoder runs the adapted model as the full forward does: the same greedy bytes.
    from spider_titan.generation import generate

    text = bytes(prompt[1:].astype(np.uint8).tolist())
    greedy = dict(max_new_bytes=12, temperature=0.0, context_len=256)
    assert generate(m, text, use_cache=True, **greedy) == generate(m, text, use_cache=False, **greedy)
    adapters.remove()
    with torch.no_grad():
        assert torch.equal(m(ids).logits, base)


def test_split_documents_and_bad_settings():
    stream = np.array([BOS_ID, 1, 2, EOS_ID, BOS_ID, 3, EOS_ID, BOS_ID], dtype=np.uint16)
    assert [d.tolist() for d in split_documents(stream)] == [[BOS_ID, 1, 2, EOS_ID], [BOS_ID, 3, EOS_ID]]
    assert chunk_windows(40, 16, 24) == [(0, 0, 16), (8, 16, 32), (16, 32, 40)]
    assert TTTSettings(chunk_bytes=64).problems(32) == ["ttt chunk_bytes 64 must be in 1..seq_len (32)"]
    assert len(TTTSettings(steps=0, rank=0, lr=-1.0).problems(256)) == 3


def test_validation_ttt_is_refused_where_it_cannot_run(monkeypatch):
    from spider_titan.config.manager import ConfigError, parse_args

    def problems(*flags, world=1):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        try:
            parse_args(["--job.config_file", "train_configs/debug_model.toml", "--validation.ttt", "true", *flags])
        except ConfigError as e:
            return [p for p in e.problems if "validation.ttt" in p]
        return []

    assert problems("--validation.enable", "true") == []
    assert problems("--validation.enable", "false") == [
        "validation.ttt: needs validation.enable = true (it runs after the final validation)"
    ]
    assert "runs on one process (WORLD_SIZE=2)" in problems("--validation.enable", "true", world=2)[0]
