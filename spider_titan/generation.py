"""Sampling from a safetensors export or a training checkpoint: prompt -> bytes -> one next byte at a time.

:func:`load_model` reads an export with checkpoint/export.py's reader (``read_export``: config.json,
the model it names through its registry ``ModelSpec``, every tensor, each checked; an export edited or
damaged by hand is a ValueError naming the file and the key or tensor, which ``scripts/generate.py``
prints as one line), materialises the model (so buffers that are not saved, such as RoPE tables,
exist) and loads the tensors strictly: no training state and no file of the run needed. A quantized
export (``--quantize int8|int4``) gets the same linears and experts quantized first (quantization/weight_only.py),
then its tensors, torchao's quantized weights among them, are loaded the same strict way, and dequantized once
into the compute dtype unless ``keep_quantized``. Given a run
folder, its checkpoint folder or a ``step-<N>`` folder instead, it reads the model's weights straight
from the DCP checkpoint (the newest complete one), for a quick look during training without an export.

:func:`generate` / :func:`generate_batch` ask the model's spec (:func:`model_spec`) how to run it: a
model with an incremental decoder (``ModelSpec.decoder``, e.g. Spider's models/spider/decode.py: one
byte's work per byte, the same logits as the full forward) decodes with its caches; any other model,
or options the decoder does not cover, recomputes the whole forward for every new byte (exact, at
O(T^2) cost). The choice of the next byte (:func:`sample_next`) is greedy at ``temperature == 0``,
else a softmax at ``temperature`` over the ``top_k`` best logits (all when 0). Only bytes and EOS can
be drawn; EOS ends the sample. A model asked for a test-time depth (``n_loops``) runs only the loops
its spec says the output needs (:func:`effective_loops`): the output is the same, bit for bit.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spider_titan import registry
from spider_titan.checkpoint.export import CONFIG_FILE, exported_identity, read_checkpoint_tensors, read_export
from spider_titan.checkpoint.layout import ModelIdentity
from spider_titan.components.builder import materialize
from spider_titan.protocol import DTYPES, CachedDecoder, ModelSpec
from spider_titan.quantization.weight_only import dequantize_weights, load_quantized, read_method
from spider_titan.vocab import BOS_ID, EOS_ID, VOCAB_SIZE

# ids a sample can draw: the 256 bytes and EOS (the range of top_k)
DRAWABLE = 257


def check_sampling(*, temperature: float, top_k: int, max_new_bytes: int, top_p: float = 1.0) -> None:
    """ValueError naming the flag when a sampling setting is out of range (before any model is loaded)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature {temperature}: must be a finite number >= 0 (0 = greedy)")
    if not 0 <= top_k <= DRAWABLE:
        raise ValueError(f"--top_k {top_k}: must be 0 (all) to {DRAWABLE} (the 256 bytes and EOS)")
    if max_new_bytes < 0:
        raise ValueError(f"--max_new_bytes {max_new_bytes}: must be >= 0")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"--top_p {top_p}: must be in (0, 1] (1 = all)")


def resolve_device(name: str) -> torch.device:
    """``name`` as a torch device that exists here; ValueError naming ``--device`` otherwise."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: not a device name; use cpu or cuda") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name}: CUDA is not available here (no GPU or a CPU build of torch); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s); use cuda:0")
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return device


def load_model(
    path: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, keep_quantized: bool = False
) -> tuple[nn.Module, dict[str, Any]]:
    """The model of the export folder ``path`` in eval mode, and its config.json. A quantized export's weights
    are dequantized once into ``dtype`` (speed), or with ``keep_quantized`` stay quantized (memory)."""
    path = Path(path)
    if _is_checkpoint_folder(path):  # a run, its checkpoint folder or a step
        return _load_from_checkpoint(path, device=device, dtype=dtype)
    config, model, tensors = read_export(path)
    materialize(model, torch.device(device), seed=0)
    method = read_method(config, path / CONFIG_FILE)
    if method is None:
        model.load_state_dict(tensors, strict=True)
    else:  # the same linears quantized as written, then every tensor loaded strictly
        if config.get("dtype") not in DTYPES:
            raise ValueError(f"{path / CONFIG_FILE}: dtype {config.get('dtype')!r} is not one of {sorted(DTYPES)}")
        load_quantized(model, tensors, method, dtype=DTYPES[config["dtype"]], where=path)
    model = model.to(device=device, dtype=dtype).eval()
    if method is not None and not keep_quantized:
        dequantize_weights(model, dtype)
    return model, config


def _is_checkpoint_folder(path: Path) -> bool:
    """A run folder (with ``checkpoint/``), a checkpoint folder (with ``step-<N>/``) or a step folder,
    and not an export (which has config.json, or lost it: then the export's own error is clearer)."""
    if (path / CONFIG_FILE).is_file() or not path.is_dir():
        return False
    return (
        (path / "checkpoint").is_dir()
        or (path / ".metadata").is_file()
        or (path / "meta.json").is_file()
        or any(path.glob("step-*"))
    )


def _load_from_checkpoint(path: Path, *, device: torch.device | str, dtype: torch.dtype) -> tuple[nn.Module, dict]:
    """The model of the newest complete checkpoint under ``path`` (a run folder, its ``checkpoint``
    folder or a ``step-<N>`` folder), and a config in the export's shape (``model``, ``step``)."""
    folder = path / "checkpoint" if (path / "checkpoint").is_dir() else path
    tensors, meta = read_checkpoint_tensors(folder)
    identity = exported_identity(ModelIdentity.from_json(meta["model"]))  # as its export would be
    model = registry.get("model", identity.name).build_on_meta(identity.build_args())
    materialize(model, torch.device(device), seed=0)
    model.load_state_dict(tensors, strict=True)
    config = {"model": {"name": identity.name, "flavor": identity.flavor, "args": identity.args}, "step": meta["step"]}
    return model.to(dtype).eval(), config


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """The next id from one position's logits (VOCAB_SIZE,), restricted to bytes and EOS."""
    logits = logits.float().clone()
    allowed = torch.zeros(VOCAB_SIZE, dtype=torch.bool, device=logits.device)
    allowed[:256] = True
    allowed[EOS_ID] = True
    logits[~allowed] = float("-inf")
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < VOCAB_SIZE:
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:  # nucleus: the fewest most likely ids whose mass reaches top_p
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, 0) - sorted_probs >= top_p
        probs = probs.index_fill(0, order[outside], 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


def model_spec(model: nn.Module) -> ModelSpec | None:
    """The registered spec whose ``model_cls`` built ``model``; None for a model of none (a wrapper,
    e.g. torch.compile's, or an unregistered class): it is then run as a plain forward."""
    for name in registry.names("model"):
        spec = registry.get("model", name)
        if type(model) is spec.model_cls:
            return spec
    return None


def effective_loops(model: nn.Module, n_loops: int | None) -> int | None:
    """The fewest core loops whose output equals ``n_loops``' bit for bit, as the model's spec says
    (``Recurrence.effective_loops``; Spider leaves out the loops past its trained count whose
    calibrated gain is 0, models/spider/calibration.py); ``n_loops`` as given for a model without that rule."""
    spec = model_spec(model)
    recurrence = None if spec is None else spec.recurrence
    if n_loops is None or recurrence is None or recurrence.effective_loops is None:
        return n_loops
    return recurrence.effective_loops(model, n_loops)


def max_len(model: nn.Module) -> int | None:
    """The longest input ``model`` accepts, as its spec says (``Training.max_seq_len``); None: no bound."""
    spec = model_spec(model)
    bound = None if spec is None else spec.training.max_seq_len
    return None if bound is None else bound(model.args)


def generate(model: nn.Module, prompt: bytes, **sampling) -> bytes:
    """The bytes ``model`` writes after ``[BOS] + prompt`` (at most ``max_new_bytes``, EOS stops);
    ``sampling`` are :func:`generate_batch`'s keywords."""
    return generate_batch(model, [prompt], **sampling)[0]


def _decoder(model: nn.Module, longest: int) -> CachedDecoder | None:
    """The model's incremental decoder (``ModelSpec.decoder``) when it covers the model's options and
    ``longest`` ids fit its ``max_seq_len``; None otherwise."""
    spec = model_spec(model)
    decoder = spec.cached_decoder() if spec is not None else None
    limit = max_len(model)
    if decoder is None or decoder.unsupported(model) is not None or (limit is not None and longest > limit):
        return None
    return decoder


def uses_cache(model: nn.Module, longest: int) -> bool:
    """Whether generation of ``longest`` ids in all decodes incrementally (``ModelSpec.decoder``): a
    model with a decoder that covers its options, within its max_seq_len."""
    return _decoder(model, longest) is not None


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    prompts: list[bytes],
    *,
    max_new_bytes: int = 256,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    context_len: int | None = None,
    n_loops: int | None = None,
    use_cache: bool = True,
) -> list[bytes]:
    """The continuation of each ``[BOS] + prompt`` (prompts of any lengths; EOS ends a row).

    A model with an incremental decoder generates with its caches (``use_cache``, when the decoder
    covers it and the whole sample fits ``max_seq_len``): each byte costs one byte's work. Otherwise
    every step recomputes the context, keeping the last ``context_len`` ids. ``n_loops``: the core's
    loop count of a model whose forward takes one (Spider: test-time depth; default: as trained), of
    which only :func:`effective_loops` run.
    Sampling draws from one generator seeded by ``seed``, rows in order, so a row's sample does not
    depend on the batch only when alone."""
    check_sampling(temperature=temperature, top_k=top_k, max_new_bytes=max_new_bytes, top_p=top_p)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = [[BOS_ID, *p] for p in prompts]
    outs = [bytearray() for _ in prompts]
    done = [False] * len(prompts)
    n_loops = effective_loops(model, n_loops)
    extra = {"n_loops": n_loops} if n_loops is not None else {}

    def draw(i: int, logits: torch.Tensor) -> None:
        nxt = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if nxt == EOS_ID:
            done[i] = True
        else:
            rows[i].append(nxt)
            outs[i].append(nxt)

    decoder = _decoder(model, max(map(len, rows)) + max_new_bytes) if use_cache else None
    if decoder is not None:
        cache = decoder.new_cache(model, len(rows), n_loops=n_loops)
        width = max(map(len, rows))
        padded = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)  # (B, width)
        logits = decoder.decode(model, padded, cache, lengths=[len(r) for r in rows])
        last = [logits[i, len(r) - 1] for i, r in enumerate(rows)]
        for _ in range(max_new_bytes):
            for i in range(len(rows)):
                if not done[i]:
                    draw(i, last[i])
            if all(done):
                break
            newest = torch.tensor([[r[-1]] for r in rows], device=device)  # (B, 1)
            step = decoder.decode(model, newest, cache, lengths=[0 if d else 1 for d in done])
            last = [step[i, 0] for i in range(len(rows))]
        return [bytes(o) for o in outs]
    for _ in range(max_new_bytes):
        for i, r in enumerate(rows):
            if not done[i]:
                window = r[-context_len:] if context_len else r
                draw(i, model(torch.tensor([window], device=device), **extra).logits[0, -1])
        if all(done):
            break
    return [bytes(o) for o in outs]


class Conversation:
    """One document written turn by turn (``scripts/generate.py --interactive``): each :meth:`turn`
    appends the caller's bytes and streams what the model samples after them. With a decoder the
    caches are kept between turns, so a turn costs its own bytes; otherwise the context is
    recomputed for every byte (its last ``max_seq_len`` ids). EOS ends a turn and is not kept."""

    def __init__(
        self,
        model: nn.Module,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        n_loops: int | None = None,
    ):
        check_sampling(temperature=temperature, top_k=top_k, max_new_bytes=0, top_p=top_p)
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.model, self.n_loops = model, effective_loops(model, n_loops)
        limit = max_len(model)
        self.max_len = sys.maxsize if limit is None else limit
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.decoder = _decoder(model, 1)
        self.reset()

    def reset(self) -> None:
        """Start a new document: ``[BOS]`` and empty caches."""
        self.ids, self.fed = [BOS_ID], 0
        self.cache = None if self.decoder is None else self.decoder.new_cache(self.model, 1, n_loops=self.n_loops)

    @property
    def room(self) -> int:
        """Bytes the document can still take before ``max_seq_len``."""
        return self.max_len - len(self.ids)

    @torch.no_grad()
    def turn(self, text: bytes, max_new_bytes: int) -> Iterator[int]:
        """Append ``text``; yield each byte sampled after it (at most ``max_new_bytes``, fewer when
        EOS is drawn or the document is full). ValueError when ``text`` itself does not fit."""
        if len(text) >= self.room:
            raise ValueError(f"{len(text)} bytes do not fit the {self.room} left of max_seq_len {self.max_len}")
        self.ids += text
        for _ in range(min(max_new_bytes, self.room)):
            nxt = sample_next(self._next_logits(), generator=self.generator, **self.sampling)
            if nxt == EOS_ID:
                return
            self.ids.append(nxt)
            yield nxt

    def _next_logits(self) -> torch.Tensor:
        """The next byte's logits after every id so far; the decoder is fed only what it has not seen."""
        if self.decoder is None:
            extra = {} if self.n_loops is None else {"n_loops": self.n_loops}
            return self.model(torch.tensor([self.ids[-self.max_len :]], device=self.device), **extra).logits[0, -1]
        new = torch.tensor([self.ids[self.fed :]], device=self.device)
        self.fed = len(self.ids)
        return self.decoder.decode(self.model, new, self.cache)[0, -1]
