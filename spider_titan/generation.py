"""Sampling from a safetensors export or a training checkpoint: prompt -> bytes -> one next byte at a time.

:func:`load_model` rebuilds the model named in the export's config.json through its registry
``ModelSpec`` (on the meta device, then materialised so buffers that are not saved, such as RoPE
tables, exist), and loads the tensors strictly: no training state and no file of the run needed.
An export edited or damaged by hand (bad JSON, missing or mistyped args, an unknown model or
flavor, a missing, cut or reshaped tensor, non-finite weights) is a ValueError naming the file
and the key or tensor, which ``scripts/generate.py`` prints as one line. Given a run folder, its
checkpoint folder or a ``step-<N>`` folder instead, it reads the model's weights straight from the DCP
checkpoint (the newest complete one), for a quick look during training without an export.

:func:`generate` / :func:`generate_batch` decode a Spider incrementally with its caches
(models/spider/decode.py: one byte's work per byte, the same logits as the full forward); any other
model, or a Spider option the decoder does not cover, recomputes the whole forward for every new
byte (exact, at O(T^2) cost). The choice of the next byte (:func:`sample_next`) is
greedy at ``temperature == 0``, else a softmax at ``temperature`` over the ``top_k`` best logits
(all when 0). Only bytes and EOS can be drawn; EOS ends the sample. A Spider asked for more loops
than trained runs only those up to the last one whose calibrated gain is non-zero
(:func:`effective_loops`): the output is the same, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from spider_titan.checkpoint.export import (
    CONFIG_FILE,
    INDEX_FILE,
    WEIGHTS_FILE,
    load_export_tensors,
    read_checkpoint_tensors,
    read_export_config,
)
from spider_titan.checkpoint.layout import ModelIdentity
from spider_titan.components import registry
from spider_titan.components.builder import materialize
from spider_titan.models.spider import Spider
from spider_titan.models.spider.decode import decode, new_cache, unsupported
from spider_titan.vocab import BOS_ID, EOS_ID, VOCAB_SIZE

# ids a sample can draw: the 256 bytes and EOS (the range of top_k)
DRAWABLE = 257
REEXPORT = "re-export it with scripts/export_safetensors.py"


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


def _read_config(path: Path) -> tuple[dict[str, Any], ModelIdentity]:
    """config.json and the model it names, checked key by key against the registry."""
    file = path / CONFIG_FILE
    try:
        config = read_export_config(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e}); restore it or {REEXPORT}") from None
    except AttributeError:  # valid JSON, but not an object
        raise ValueError(f"{file}: not a JSON object; restore it or {REEXPORT}") from None
    model = config.get("model")
    if not isinstance(model, dict) or not all(
        isinstance(model.get(k), t) for k, t in (("name", str), ("flavor", str), ("args", dict))
    ):
        raise ValueError(
            f"{file}: 'model' must hold 'name' and 'flavor' (strings) and 'args' (an object); restore it or {REEXPORT}"
        )
    try:
        spec = registry.get("model", model["name"])
    except ValueError as e:
        raise ValueError(f"{file}: model.name: {e}") from None
    if model["flavor"] not in spec.flavors:
        raise ValueError(
            f"{file}: model.flavor {model['flavor']!r} is not a flavor of {model['name']!r}; "
            f"choose one of {list(spec.flavors)}"
        )
    reference = spec.flavors[model["flavor"]]
    known = {f.name for f in dataclasses.fields(reference)}
    identity = ModelIdentity.from_json(model)  # with the fields added since the export was written
    args = identity.args
    problems = [f"unknown {k!r}" for k in sorted(set(args) - known)]
    problems += [f"missing {k!r}" for k in sorted(known - set(args))]
    for key in sorted(set(args) & known):
        expected, value = getattr(reference, key), args[key]
        if expected is None or value is None:
            continue
        if isinstance(expected, bool) or isinstance(value, bool):
            ok = isinstance(expected, bool) and isinstance(value, bool)
        elif isinstance(expected, float):
            ok = isinstance(value, (int, float))
        elif isinstance(expected, (list, tuple)):
            ok = isinstance(value, list)
        else:
            ok = isinstance(value, type(expected))
        if not ok:
            problems.append(f"{key!r} is {value!r}, expected a {type(expected).__name__}")
    if problems:
        raise ValueError(f"{file}: model.args: {'; '.join(problems)}; restore it or {REEXPORT}")
    return config, identity


def _weights_file(path: Path, key: str | None = None) -> Path:
    """The safetensors file that holds ``key`` (or the export's weights file or index)."""
    if (path / INDEX_FILE).is_file():
        try:
            return path / json.loads((path / INDEX_FILE).read_text())["weight_map"][key]
        except Exception:  # an unreadable index, or a key it lacks: name the index itself
            return path / INDEX_FILE
    return path / WEIGHTS_FILE


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the export; ValueError naming the file that cannot be read."""
    try:
        return load_export_tensors(path)
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors' own error, bad index JSON, a file the index names but lacks
        files = [path / INDEX_FILE] if (path / INDEX_FILE).is_file() else []
        files += sorted(path.glob("*.safetensors"))
        bad = files[0] if files else path
        for file in files[len(files) > 1 and files[0].name == INDEX_FILE :]:
            try:
                safetensors.torch.load_file(file)
            except Exception:
                bad = file
                break
        text = str(e).strip().splitlines()
        raise ValueError(
            f"{bad}: unreadable ({type(e).__name__}: {text[-1] if text else ''}); restore it or {REEXPORT}"
        ) from None


def load_model(
    path: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, dict[str, Any]]:
    """The model of the export folder ``path`` in eval mode, and its config.json."""
    path = Path(path)
    if _is_checkpoint_folder(path):  # a run, its checkpoint folder or a step
        return _load_from_checkpoint(path, device=device, dtype=dtype)
    config, identity = _read_config(path)
    spec = registry.get("model", identity.name)
    try:
        model = spec.build_on_meta(identity.build_args())
    except Exception as e:  # args of the right types whose values build no model (n_heads = 0, ...)
        raise ValueError(
            f"{path / CONFIG_FILE}: model.args build no {identity.name!r} model "
            f"({type(e).__name__}: {e}); restore it or {REEXPORT}"
        ) from None
    materialize(model, torch.device(device), seed=0)
    tensors = _read_tensors(path)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(
            f"{_weights_file(path)}: tensor(s) {missing[:3]}{' ...' if len(missing) > 3 else ''} "
            f"missing ({len(missing)} of {len(expected)}); restore it or {REEXPORT}"
        )
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ValueError(
            f"{_weights_file(path, unknown[0])}: tensor(s) {unknown[:3]} are not in a "
            f"{identity.name!r} model; restore it or {REEXPORT}"
        )
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != shape:
            raise ValueError(
                f"{_weights_file(path, key)}: tensor {key} has shape {tuple(tensors[key].shape)}, "
                f"the model in {CONFIG_FILE} needs {shape}; restore it or {REEXPORT}"
            )
        if tensors[key].is_floating_point() and not bool(torch.isfinite(tensors[key]).all()):
            raise ValueError(
                f"{_weights_file(path, key)}: tensor {key} holds NaN or inf; export a checkpoint "
                "saved before the values went non-finite"
            )
    model.load_state_dict(tensors, strict=True)
    return model.to(dtype).eval(), config


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
    identity = ModelIdentity.from_json(meta["model"])
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


def effective_loops(model: nn.Module, n_loops: int | None) -> int | None:
    """The fewest core loops whose output equals ``n_loops``' bit for bit. A Spider at eval hands on
    ``h + gain_i (F_i(h) - h)`` from a loop ``i`` past its trained count (models/spider/recurrence.py),
    and the end-of-run calibration sets ``gain_i = 0`` for a loop that did not help: such loops at
    the end of the requested count compute and then hand on their input unchanged, so they are left
    out. ``n_loops`` as given otherwise: not a Spider, no gains (``extra_loop_gains`` off, as in
    exports from before them), ACT halting (which ignores the gains), or a count outside
    ``n_loops..max_loops`` (the model's own error names the range)."""
    if n_loops is None or not isinstance(model, Spider) or model.training:
        return n_loops
    trained, gains = model.args.n_loops, model.core.extra_loop_gain
    if gains is None or model.core.halt_predictor is not None or not trained < n_loops <= model.args.max_loops:
        return n_loops
    needed = n_loops
    while needed > trained and float(gains[needed - 1]) == 0.0:
        needed -= 1
    return needed


def generate(model: nn.Module, prompt: bytes, **sampling) -> bytes:
    """The bytes ``model`` writes after ``[BOS] + prompt`` (at most ``max_new_bytes``, EOS stops);
    ``sampling`` are :func:`generate_batch`'s keywords."""
    return generate_batch(model, [prompt], **sampling)[0]


def uses_cache(model: nn.Module, longest: int) -> bool:
    """Whether generation of ``longest`` ids in all can decode incrementally (models/spider/decode.py):
    a Spider whose options the decoder covers, within its max_seq_len."""
    return isinstance(model, Spider) and unsupported(model) is None and longest <= model.args.max_seq_len


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

    A Spider generates with its caches (``use_cache``, when the decoder covers it and the whole
    sample fits ``max_seq_len``): each byte costs one byte's work. Otherwise every step recomputes
    the context, keeping the last ``context_len`` ids. ``n_loops``: the core's loop count for
    Spider (test-time depth; default: as trained), of which only :func:`effective_loops` run.
    Sampling draws from one generator seeded by ``seed``, rows in order, so a row's sample does not
    depend on the batch only when alone."""
    check_sampling(temperature=temperature, top_k=top_k, max_new_bytes=max_new_bytes, top_p=top_p)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = [[BOS_ID, *p] for p in prompts]
    outs = [bytearray() for _ in prompts]
    done = [False] * len(prompts)
    n_loops = effective_loops(model, n_loops)
    extra = {"n_loops": n_loops} if n_loops is not None and isinstance(model, Spider) else {}

    def draw(i: int, logits: torch.Tensor) -> None:
        nxt = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if nxt == EOS_ID:
            done[i] = True
        else:
            rows[i].append(nxt)
            outs[i].append(nxt)

    if use_cache and uses_cache(model, max(map(len, rows)) + max_new_bytes):
        cache = new_cache(model, len(rows), n_loops=n_loops)
        width = max(map(len, rows))
        logits = decode(model, torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device), cache,
                        lengths=[len(r) for r in rows])  # fmt: skip
        last = [logits[i, len(r) - 1] for i, r in enumerate(rows)]
        for _ in range(max_new_bytes):
            for i in range(len(rows)):
                if not done[i]:
                    draw(i, last[i])
            if all(done):
                break
            step = decode(model, torch.tensor([[r[-1]] for r in rows], device=device), cache,
                          lengths=[0 if d else 1 for d in done])  # fmt: skip
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
