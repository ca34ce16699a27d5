"""Score-first test-time training (TTT): evaluation that learns from each document as it reads it.

Each document is read chunk by chunk (``chunk_bytes`` predictions a chunk). A chunk is first scored with
the weights as they are (that score is what is reported), then ``steps`` optimizer steps are taken on that
chunk's next-byte loss, and the next chunk is scored with the adapted weights. No byte is ever scored by
weights that have seen it, and the adapted weights are reset at each document's start, so a document's
score never depends on the documents before it.

What learns: LoRA pairs the evaluator adds (``A`` (d_in, r) random, ``B`` (r, d_out) zero, so an adapted
linear starts as the model's own) on every ``nn.Linear`` of the model's last ``blocks`` blocks (the
``ModelSpec.block_containers`` order, e.g. Spider's coda, a dense model's top layers), trained with Adam.
The model's own parameters never change. Each batch row has its own pair per linear, so ``batch_size``
documents adapt side by side in one forward, each with its own weights.

A chunk's forward window ends at the chunk's last prediction and reaches back at most ``seq_len``
predictions into its document, so the chunk's bytes see the same context whether TTT is on or off;
plain evaluation (:func:`score_documents` with ``ttt=None``) reads the very same windows, and with a
learning rate of 0 the two give the same numbers exactly.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from spider_titan.protocol import ModelSpec, paired_difference, window_cross_entropy
from spider_titan.vocab import BOS_ID, IGNORE_INDEX, PAD_ID

logger = logging.getLogger("spider_titan")

_BETAS, _EPS = (0.9, 0.999), 1e-8


@dataclass(frozen=True)
class TTTSettings:
    """How test-time training adapts (defaults: lab/DECISIONS.md, "Test-time training")."""

    chunk_bytes: int = 256
    """Predictions per chunk: each chunk is scored, then learned from."""
    steps: int = 1
    """Optimizer steps on each chunk after it is scored (the first reuses the scoring forward)."""
    lr: float = 1e-2
    """Adam learning rate of the adapters."""
    rank: int = 32
    """Rank of each LoRA adapter."""
    blocks: int = 1
    """Trailing blocks of the model whose linears get adapters."""
    seed: int = 0
    """Seed of the adapters' random ``A`` (the same start for every document)."""

    def problems(self, seq_len: int) -> list[str]:
        """What is wrong with these settings for windows of ``seq_len`` predictions (empty: nothing)."""
        out = []
        if not 1 <= self.chunk_bytes <= seq_len:
            out.append(f"ttt chunk_bytes {self.chunk_bytes} must be in 1..seq_len ({seq_len})")
        for name in ("steps", "rank", "blocks"):
            if getattr(self, name) < 1:
                out.append(f"ttt {name} {getattr(self, name)} must be >= 1")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            out.append(f"ttt lr {self.lr} must be a finite number >= 0")
        return out


def split_documents(tokens: np.ndarray) -> list[np.ndarray]:
    """A token stream cut at every BOS: each piece is one document (``[BOS] + bytes + [EOS]`` as the
    data tools write them), leading tokens before the first BOS forming a piece of their own."""
    starts = np.flatnonzero(tokens == BOS_ID)
    if starts.size == 0 or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    ends = np.append(starts[1:], tokens.size)
    return [tokens[s:e] for s, e in zip(starts, ends) if e - s >= 2]


def chunk_windows(n_predictions: int, chunk: int, seq_len: int) -> list[tuple[int, int, int]]:
    """``(window_start, chunk_start, chunk_end)`` per chunk of a document with ``n_predictions``
    predictions (position i predicts token i + 1): the chunk scores predictions [chunk_start, chunk_end),
    its forward reads inputs [window_start, chunk_end), at most ``seq_len`` of them."""
    out = []
    for s in range(0, n_predictions, chunk):
        e = min(s + chunk, n_predictions)
        out.append((max(0, e - seq_len), s, e))
    return out


class RowAdapters:
    """Per-row LoRA adapters on ``linears`` (FQN -> nn.Linear), for a batch of ``rows`` rows, added by
    forward hooks: ``y = W x + (x A_r) B_r`` for the rows in :attr:`active`, with Adam state per row."""

    def __init__(self, linears: dict[str, nn.Linear], rows: int, rank: int, *, seed: int, device: torch.device):
        gen = torch.Generator().manual_seed(seed)
        self.params: list[torch.Tensor] = []
        self.start: list[torch.Tensor] = []  # each parameter's value at a document's start
        self.active = torch.arange(rows, device=device)
        self.steps = torch.zeros(rows, device=device)
        self._hooks = []
        for linear in linears.values():
            d_in, d_out = linear.in_features, linear.out_features
            a0 = torch.randn(d_in, rank, generator=gen) / math.sqrt(d_in)
            b0 = torch.zeros(rank, d_out)
            a, b = (t.to(device).expand(rows, *t.shape).clone().requires_grad_() for t in (a0, b0))
            self.params += [a, b]
            self.start += [a0.to(device), b0.to(device)]
            self._hooks.append(linear.register_forward_hook(self._hook(a, b)))
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    def _hook(self, a: torch.Tensor, b: torch.Tensor) -> Callable:
        def add_adapter(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            x = inputs[0]
            if x.dim() != 3 or x.shape[0] != self.active.numel():
                raise ValueError(
                    f"test-time training: a linear adapted per row reads input of shape {tuple(x.shape)}, not "
                    f"(rows={self.active.numel()}, T, d); adapt blocks that work on (batch, bytes, dim)"
                )
            ra, rb = a[self.active].to(x.dtype), b[self.active].to(x.dtype)
            return out + torch.matmul(torch.matmul(x, ra), rb)

        return add_adapter

    def reset(self, row: int) -> None:
        """Row ``row`` starts a new document: its adapters and their optimizer state as at the start."""
        with torch.no_grad():
            for p, p0, m, v in zip(self.params, self.start, self.m, self.v):
                p[row] = p0
                m[row] = 0
                v[row] = 0
            self.steps[row] = 0

    def step(self, lr: float, learned: torch.Tensor) -> None:
        """One Adam step on the active rows whose ``learned`` (bool per active row) is set; grads cleared."""
        rows = self.active[learned]
        self.steps[rows] += 1
        t = self.steps[rows].view(-1, 1, 1)
        b1, b2 = _BETAS
        with torch.no_grad():
            for p, m, v in zip(self.params, self.m, self.v):
                if p.grad is None:  # a linear the loss does not reach (e.g. one feeding only a routing choice)
                    continue
                g = p.grad[rows]
                m[rows] = b1 * m[rows] + (1 - b1) * g
                v[rows] = b2 * v[rows] + (1 - b2) * g * g
                m_hat, v_hat = m[rows] / (1 - b1**t), v[rows] / (1 - b2**t)
                p[rows] -= lr * m_hat / (v_hat.sqrt() + _EPS)
                p.grad = None

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def adapted_linears(model: nn.Module, spec: ModelSpec, blocks: int) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules of the model's last ``blocks`` blocks, by FQN."""
    chosen = spec.blocks(model)[-blocks:]
    out = {f"{fqn}.{name}": m for fqn, block in chosen for name, m in block.named_modules() if isinstance(m, nn.Linear)}
    if not out:
        raise ValueError(f"test-time training: the model's last {blocks} block(s) hold no nn.Linear to adapt")
    return out


@dataclass
class ChunkScores:
    """Per chunk, in document order then chunk order: summed next-byte cross-entropy in nats, the
    predictions scored and the document's index (float64 / int64 tensors of one length)."""

    ce: torch.Tensor
    count: torch.Tensor
    doc: torch.Tensor
    seconds: float
    adapted: list[str]

    @property
    def bpb(self) -> float:
        return float(self.ce.sum() / self.count.sum().clamp(min=1)) / math.log(2)


class DocumentEvaluator:
    """Scores documents chunk by chunk, ``batch_size`` documents side by side; with ``ttt`` set, each
    chunk is learned from after it is scored (:meth:`step_chunk`: score, then update)."""

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        *,
        seq_len: int,
        ttt: TTTSettings | None,
        chunk_bytes: int | None = None,
        batch_size: int = 8,
        device: torch.device | str = "cpu",
        forward_kwargs: dict[str, Any] | None = None,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
        on_scored: Callable[[list, torch.Tensor, torch.Tensor], None] | None = None,
    ):
        """``on_scored(keys, logits, labels)``, optional: called with each chunk's scoring forward
        (``keys`` (doc, chunk) per row) before anything learns from it."""
        self.model, self.spec, self.seq_len, self.ttt = model, spec, seq_len, ttt
        self.on_scored = on_scored
        self.chunk = ttt.chunk_bytes if ttt is not None else (chunk_bytes or seq_len)
        self.batch_size, self.device = batch_size, torch.device(device)
        self.forward_kwargs, self.autocast = forward_kwargs or {}, autocast
        problems = ttt.problems(seq_len) if ttt is not None else []
        if not 1 <= self.chunk <= seq_len:
            problems.append(f"chunk_bytes {self.chunk} must be in 1..seq_len ({seq_len})")
        if batch_size < 1:
            problems.append(f"batch_size {batch_size} must be >= 1")
        if problems:
            raise ValueError("; ".join(dict.fromkeys(problems)))
        self.adapters: RowAdapters | None = None

    def score(self, docs: Sequence[np.ndarray], *, keep_adapters: bool = False) -> ChunkScores:
        """Every prediction of every document in ``docs`` scored once, chunk by chunk. ``keep_adapters``:
        leave the adapters, as the last chunk left them, on the model (:attr:`adapters`)."""
        rows = min(self.batch_size, len(docs))
        linears = adapted_linears(self.model, self.spec, self.ttt.blocks) if self.ttt is not None else {}
        frozen = [p for p in self.model.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        if self.ttt is not None:
            self.adapters = RowAdapters(linears, rows, self.ttt.rank, seed=self.ttt.seed, device=self.device)
        results: dict[tuple[int, int], tuple[float, int]] = {}
        t0 = time.perf_counter()
        try:
            for batch in self._batches(docs, rows):
                for (d, c), ce, n in zip(batch[0], *self.step_chunk(*batch)):
                    results[(d, c)] = (ce, n)
        finally:
            for p in frozen:
                p.requires_grad_(True)
            if self.adapters is not None and not keep_adapters:
                self.adapters.remove()
                self.adapters = None
        keys = sorted(results)
        return ChunkScores(
            ce=torch.tensor([results[k][0] for k in keys], dtype=torch.float64),
            count=torch.tensor([results[k][1] for k in keys], dtype=torch.float64),
            doc=torch.tensor([k[0] for k in keys], dtype=torch.int64),
            seconds=time.perf_counter() - t0,
            adapted=sorted(linears),
        )

    def _batches(self, docs: Sequence[np.ndarray], rows: int) -> Iterator[tuple]:
        """Lockstep over ``rows`` rows: each yields ``(keys, inputs, labels, new_docs)`` for the rows that
        still read a document (``keys`` (doc, chunk) per active row, ``new_docs`` the active rows'
        positions that start a document now); a row that finishes a document takes the next one."""
        queue = iter(enumerate(docs))
        state: list[list | None] = [None] * rows  # per row: [doc index, tokens, windows, next chunk]

        def take(r: int) -> bool:
            for d, tokens in queue:
                state[r] = [d, tokens, chunk_windows(tokens.size - 1, self.chunk, self.seq_len), 0]
                return True
            state[r] = None
            return False

        for r in range(rows):
            take(r)
        while any(s is not None for s in state):
            active = [r for r in range(rows) if state[r] is not None]
            width = max(state[r][2][state[r][3]][2] - state[r][2][state[r][3]][0] for r in active)
            inputs = np.full((len(active), width), PAD_ID, dtype=np.int64)
            labels = np.full((len(active), width), IGNORE_INDEX, dtype=np.int64)
            keys, new_docs = [], []
            for i, r in enumerate(active):
                d, tokens, windows, c = state[r]
                w, s, e = windows[c]
                inputs[i, : e - w] = tokens[w:e]
                lab = tokens[w + 1 : e + 1].astype(np.int64)
                lab[: s - w] = IGNORE_INDEX  # context only: scored by an earlier chunk
                lab[lab == PAD_ID] = IGNORE_INDEX
                labels[i, : e - w] = lab
                keys.append((d, c))
                if c == 0:
                    new_docs.append(i)
            yield keys, torch.from_numpy(inputs), torch.from_numpy(labels), torch.tensor(active), new_docs
            for r in active:
                state[r][3] += 1
                if state[r][3] == len(state[r][2]):
                    take(r)

    def step_chunk(
        self, keys: list, inputs: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, new_docs: list[int]
    ) -> tuple[list[float], list[int]]:
        """Score one chunk per active row (``rows``), then learn from it: the reported score comes from
        weights that have not seen the chunk."""
        ce, n, loss, logits = self.score_chunk(inputs, labels, rows, new_docs)
        if self.on_scored is not None:
            self.on_scored(keys, logits, labels)
        if self.ttt is not None:
            self.learn_chunk(inputs, labels, loss, n)
        return ce.tolist(), n.long().tolist()

    def score_chunk(
        self, inputs: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, new_docs: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Per-row summed cross-entropy and counts under the current weights, (with TTT) the
        differentiable per-row mean loss the first update step reuses, and the logits (detached)."""
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        if self.adapters is not None:
            self.adapters.active = rows.to(self.device)
            for i in new_docs:
                self.adapters.reset(int(rows[i]))
        grad = self.ttt is not None and self.ttt.lr > 0
        with torch.set_grad_enabled(grad):  # whatever the caller's mode (an eval pass runs under no_grad)
            with self.autocast():
                logits = self.model(inputs, **self.forward_kwargs).logits
                ce, n = window_cross_entropy(logits, labels)
            loss = (ce / n.clamp(min=1)).sum() if grad else None
        return ce.detach(), n, loss, logits.detach()

    def learn_chunk(
        self, inputs: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor | None, n: torch.Tensor
    ) -> None:
        """``steps`` Adam steps of the active rows' adapters on the chunk's loss (the first on ``loss``,
        the scoring forward's own graph); nothing at a learning rate of 0."""
        if loss is None:
            return
        learned = n > 0
        for k in range(self.ttt.steps):
            if k > 0:
                with torch.enable_grad():
                    with self.autocast():
                        logits = self.model(inputs.to(self.device), **self.forward_kwargs).logits
                        ce, cnt = window_cross_entropy(logits, labels.to(self.device))
                    loss = (ce / cnt.clamp(min=1)).sum()
            loss.backward()
            self.adapters.step(self.ttt.lr, learned)


def score_documents(
    model: nn.Module, spec: ModelSpec, docs: Sequence[np.ndarray], *, ttt: TTTSettings | None, **options: Any
) -> ChunkScores:
    """:class:`DocumentEvaluator` (``seq_len`` and its other keywords in ``options``) in one call: ``ttt=None``
    is plain evaluation over the same windows (``chunk_bytes``, default ``seq_len``, sets them; with ``ttt``
    its own ``chunk_bytes`` does)."""
    return DocumentEvaluator(model, spec, ttt=ttt, **options).score(docs)


def adapt_on_prompt(
    model: nn.Module, spec: ModelSpec, prompt: np.ndarray, ttt: TTTSettings, *, seq_len: int, device: torch.device
) -> tuple[RowAdapters, ChunkScores]:
    """Learn from ``prompt`` (one document's tokens) chunk by chunk, as the evaluator does, and leave the
    adapters on the model for what follows (generation, one row): returns them (``remove()`` undoes
    them) and the prompt's own chunk scores."""
    evaluator = DocumentEvaluator(model, spec, seq_len=seq_len, ttt=ttt, batch_size=1, device=device)
    scores = evaluator.score([prompt], keep_adapters=True)
    return evaluator.adapters, scores


def ttt_validation(
    model: nn.Module,
    spec: ModelSpec,
    tokens: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
) -> dict[str, float]:
    """The end-of-run pass of ``validation.ttt``: the documents of ``tokens`` (a val split's stream)
    scored without and with test-time training (default settings, chunks of at most ``seq_len``), as
    metrics: ``val_bpb_docs``, ``val_bpb_ttt``, their paired difference ``ttt_gain_bpb`` and its standard
    error, and the seconds of each pass."""
    settings = TTTSettings(chunk_bytes=min(TTTSettings.chunk_bytes, seq_len))
    docs = split_documents(tokens.astype(np.int64))
    common = dict(seq_len=seq_len, batch_size=batch_size, device=device, autocast=autocast)
    plain = score_documents(model, spec, docs, ttt=None, chunk_bytes=settings.chunk_bytes, **common)
    adapted = score_documents(model, spec, docs, ttt=settings, **common)
    diff, se = paired_difference(adapted.ce, plain.ce, plain.count)
    logger.info(
        "test-time training: val bpb %.4f -> %.4f (%+.4f +- %.4f over %d chunks of %d documents; %.1f s plain, "
        "%.1f s with TTT; %d linears adapted)",
        plain.bpb,
        adapted.bpb,
        diff,
        se,
        int((plain.count > 0).sum()),
        len(docs),
        plain.seconds,
        adapted.seconds,
        len(adapted.adapted),
    )
    return {
        "val_bpb_docs": plain.bpb,
        "val_bpb_ttt": adapted.bpb,
        "ttt_gain_bpb": diff,
        "ttt_gain_se": se,
        "ttt_plain_s": plain.seconds,
        "ttt_s": adapted.seconds,
    }
