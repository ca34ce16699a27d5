"""Weight-only int8 / int4 quantization of an export's linears and hashed tables (torchao), and its safetensors form.

What: the ``nn.Linear`` and ``nn.Embedding`` weights a model's spec does not keep (``Inference.quantize_keep_fqns``)
become torchao tensor subclasses: ``int8``, one fp32 scale per output row of a linear or per row of a table
(``Int8WeightOnlyConfig``, ``Int8Tensor``); ``int4``, one scale per 32 values of a row
(``IntxWeightOnlyConfig(int4, PerGroup(32))``, ``IntxUnpackedToInt8Tensor``: torchao 0.18's int4 that
runs on CPU; its packed int4 layouts need CUDA, XPU or NPU kernels). A linear dequantizes inside ``F.linear``;
a table dequantizes only the rows a lookup reads (``models.common.embedding_rows``). Every other tensor
(norms, LoRA adapters, the MoE's 3-D expert weights, which are not linears) keeps the export's dtype.

Layout on disk: torchao's safetensors flattening (``<module>._weight_qdata``, ``_weight_scale``,
``_weight_zero_point``, and a JSON description of each tensor in the file's header); torchao keeps one
int4 value per int8, so :func:`flatten_quantized` packs two per byte (low nibble first) and
:func:`unflatten_quantized` unpacks them. Loading (:func:`load_quantized`) rebuilds the same subclasses on
the same modules and loads every tensor strictly. torchao is imported only when a quantized export is
written or read, so an unquantized export loads without it.

Limits: smaller files, not faster ones: a linear's weight is converted or dequantized at every call (cached
decoding on CPU ran at 0.9x / 0.7x bf16's speed, docs/benchmarks.md); an int4 weight's row width must be
a multiple of 32 (else it keeps the export's dtype, logged); the experts, 62 % of 1B's parameters, stay bf16.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from spider_titan.export_format import TORCHAO_KEYS

METHODS = ("int8", "int4")
INT4_GROUP_SIZE = 32
PACKED_INT4 = "spider_titan_packed_int4"  # header key: JSON list of the data tensors stored two int4 per byte

# Loggers that speak while torchao imports: its optional GPU extensions a CPU build lacks ("Failed to
# load ..._C_mxfp8...so") and torch's deprecation of torchao's Enum registration; neither concerns a run.
_QUIET_AT_IMPORT = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_torchao_import():
    """Silence the loggers torchao's import speaks through, for the block."""
    loggers = [logging.getLogger(name) for name in _QUIET_AT_IMPORT]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def check_method(method: str, where: object = "--quantize") -> None:
    """ValueError naming ``where`` unless ``method`` is one of :data:`METHODS`."""
    if method not in METHODS:
        raise ValueError(f"{where} {method!r}: unknown quantization; choose {' or '.join(METHODS)} (or none)")


def require_torchao(where: object, method: str):
    """torchao's ``quantize_`` and its safetensors helpers; ValueError (one line) where torchao is missing."""
    try:
        with quiet_torchao_import():
            from torchao.prototype.safetensors import safetensors_support
            from torchao.quantization import quantize_
    except Exception as e:  # missing, or broken against this torch
        raise ValueError(
            f"{where}: {method} weights need torchao ({type(e).__name__}: {e}); pip install torchao"
        ) from None
    return quantize_, safetensors_support


def torchao_config(method: str):
    """torchao's config for ``method`` (weight-only; no inductor settings changed)."""
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup

    if method == "int8":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP_SIZE))


QUANTIZABLE = (nn.Linear, nn.Embedding)  # a 2-D weight quantized by rows: (out, in) or (rows, dim)


def plan_weight_only(model: nn.Module, method: str, keep: Iterable[str]) -> tuple[list[str], list[str], list[str]]:
    """(quantized, kept, skipped) FQNs of ``model``'s linears and tables: kept where the FQN contains one
    of ``keep``; skipped where int4's groups do not divide a row; the rest quantized."""
    keep = tuple(keep)
    quantized, kept, skipped = [], [], []
    for fqn, module in model.named_modules():
        if not isinstance(module, QUANTIZABLE):
            continue
        if any(part in fqn for part in keep):
            kept.append(fqn)
        elif method == "int4" and module.weight.shape[1] % INT4_GROUP_SIZE:
            skipped.append(fqn)
        else:
            quantized.append(fqn)
    return quantized, kept, skipped


def apply_weight_only(model: nn.Module, method: str, fqns: Iterable[str], *, where: object = "--quantize") -> None:
    """Quantize the weights of the linears and tables ``fqns`` of ``model`` in place (``method``: int8 or int4)."""
    check_method(method, where)
    quantize_, _ = require_torchao(where, method)
    fqns = set(fqns)
    with quiet_torchao_import():
        quantize_(model, torchao_config(method), filter_fn=lambda module, fqn: fqn in fqns)


def is_quantized(t: torch.Tensor) -> bool:
    """Whether ``t`` is one of torchao's quantized tensor subclasses."""
    return hasattr(t, "tensor_data_names")


def tensor_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``: ``t`` itself, or a quantized tensor's data, scales and zeros."""
    if not is_quantized(t):
        return [t]
    names = [*t.tensor_data_names, *getattr(t, "optional_tensor_data_names", [])]
    return [v for v in (getattr(t, n, None) for n in names) if isinstance(v, torch.Tensor)]


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(..., K) int8 in [-8, 7] -> (..., K/2) uint8, element 2i in the low nibble."""
    u = q.to(torch.uint8) & 0xF
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def _unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack_int4`: (..., K/2) uint8 -> (..., K) int8 in [-8, 7]."""
    nibbles = torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2).to(torch.int8)
    return torch.where(nibbles > 7, nibbles - 16, nibbles)


def flatten_quantized(
    state: dict[str, torch.Tensor], method: str
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str], set[str]]:
    """``state`` (plain and quantized tensors) as safetensors stores it: FQN -> {stored key: plain
    tensor} (the tensor itself, or a quantized one's parts under torchao's keys), FQN -> torchao's
    JSON description, and the stored keys of int4 data packed two per byte. A file's header is
    :func:`torchao_header` of the FQNs it holds."""
    _, support = require_torchao("--quantize", method)
    groups, descriptions, packed = {}, {}, set()
    for fqn, value in state.items():
        parts, meta = support.flatten_tensor_state_dict({fqn: value})
        if str(getattr(value, "target_dtype", "")) == "torch.int4":
            key = next(k for k in parts if k.endswith("_qdata"))
            parts[key] = _pack_int4(parts[key])
            packed.add(key)
        groups[fqn], descriptions[fqn] = parts, meta[fqn]
    return groups, descriptions, packed


def torchao_header(fqns: list[str], descriptions: dict[str, str], packed: list[str]) -> dict[str, str]:
    """The safetensors header entries of a file holding ``fqns`` (and the packed data keys ``packed``)."""
    return {TORCHAO_KEYS: json.dumps(fqns), PACKED_INT4: json.dumps(packed), **{f: descriptions[f] for f in fqns}}


def unflatten_quantized(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], *, where: object
) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors and header (written by :func:`flatten_quantized` for the FQNs
    in its ``tensor_names``) -> FQN -> plain or quantized tensor."""
    _, support = require_torchao(where, "quantized")
    tensors = dict(tensors)
    for key in json.loads(metadata.get(PACKED_INT4, "[]")):
        tensors[key] = _unpack_int4(tensors[key])
    state, leftover = support.unflatten_tensor_state_dict(tensors, metadata)
    return {**state, **leftover}


def quantization_block(method: str, quantized: list[str], kept: list[str], skipped: list[str]) -> dict[str, Any]:
    """config.json's ``quantization``: what a reader needs (``method``) and what was done, in words."""
    import torchao

    return {
        "method": method,
        "library": f"torchao {torchao.__version__}",
        "weights": "int8, one scale per row"
        if method == "int8"
        else f"int4, one scale per {INT4_GROUP_SIZE} values of a row, stored two per byte",
        "quantized_weights": len(quantized),
        "kept_weights": kept,
        "skipped_weights": skipped,
    }


def read_method(config: dict[str, Any], where: object) -> str | None:
    """The quantization ``method`` of an export's config.json (None: not quantized); ValueError naming
    ``where`` for a block this code cannot read."""
    block = config.get("quantization")
    if block is None:
        return None
    method = block.get("method") if isinstance(block, dict) else None
    if method not in METHODS:
        raise ValueError(
            f"{where}: quantization {method!r} is not one this code reads ({', '.join(METHODS)}); "
            "load it with the spider_titan that wrote it"
        )
    return method


def load_quantized(
    model: nn.Module, state: dict[str, torch.Tensor], method: str, *, dtype: torch.dtype, where: object
) -> None:
    """Load an export's ``state`` into the materialised ``model`` the way it was written: the rest cast
    to the export's ``dtype``, the same linears and tables quantized with ``method``, then every tensor loaded
    strictly (no missing or extra one, each of the type the model now holds). ValueError naming ``where``."""
    quantized = {fqn.removesuffix(".weight") for fqn, t in state.items() if is_quantized(t)}
    weights = {fqn for fqn, module in model.named_modules() if isinstance(module, QUANTIZABLE)}
    if not quantized <= weights:
        wrong = sorted(quantized - weights)
        raise ValueError(
            f"{where}: quantized tensors {wrong[:3]} are not linear or table weights of the model; re-export it"
        )
    model.to(dtype)
    apply_weight_only(model, method, quantized, where=where)
    want = model.state_dict()
    for fqn, t in state.items():
        if fqn in want and type(t) is not type(want[fqn]):
            raise ValueError(
                f"{where}: tensor {fqn} is a {type(t).__name__}, the {method} model holds a "
                f"{type(want[fqn]).__name__} there; re-export it"
            )
    model.load_state_dict(state, strict=True, assign=True)
