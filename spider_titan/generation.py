"""Sampling from a safetensors export: prompt -> bytes -> one next byte at a time.

:func:`load_model` rebuilds the model named in the export's config.json through its registry
``ModelSpec`` (on the meta device, then materialised so buffers that are not saved, such as RoPE
tables, exist), and loads the tensors strictly: no training state and no file of the run needed.

:func:`generate` recomputes the whole forward for every new byte. That is exact for every model in
the registry (Spider's segmentation of the prefix can change as it grows) at O(T^2) cost, which
is fine for the few hundred bytes of a sample. The choice of the next byte (:func:`sample_next`) is
greedy at ``temperature <= 0``, else a softmax at ``temperature`` over the ``top_k`` best logits
(all when 0). Only bytes and EOS can be drawn; EOS ends the sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from spider_titan.checkpoint.export import load_export_tensors, read_export_config
from spider_titan.checkpoint.layout import ModelIdentity
from spider_titan.components import registry
from spider_titan.components.builder import materialize
from spider_titan.models.common import BOS_ID, EOS_ID, VOCAB_SIZE


def load_model(
    path: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, dict[str, Any]]:
    """The model of the export folder ``path`` in eval mode, and its config.json."""
    config = read_export_config(Path(path))
    identity = ModelIdentity.from_json(config["model"])
    spec = registry.get("model", identity.name)
    with torch.device("meta"):
        model = spec.model_cls(identity.build_args())
    materialize(model, torch.device(device), seed=0)
    model.load_state_dict(load_export_tensors(Path(path)), strict=True)
    return model.to(dtype).eval(), config


def sample_next(
    logits: torch.Tensor, *, temperature: float, top_k: int = 0, generator: torch.Generator | None = None
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
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: bytes,
    *,
    max_new_bytes: int = 256,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    context_len: int | None = None,
) -> bytes:
    """The bytes ``model`` writes after ``[BOS] + prompt`` (at most ``max_new_bytes``, EOS stops).

    ``context_len`` keeps only the last that many ids as input (the model's max_seq_len).
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = [BOS_ID, *prompt]
    out = bytearray()
    for _ in range(max_new_bytes):
        window = ids[-context_len:] if context_len else ids
        logits = model(torch.tensor([window], device=device)).logits[0, -1]  # (VOCAB_SIZE,)
        nxt = sample_next(logits, temperature=temperature, top_k=top_k, generator=generator)
        if nxt == EOS_ID:
            break
        ids.append(nxt)
        out.append(nxt)
    return bytes(out)
