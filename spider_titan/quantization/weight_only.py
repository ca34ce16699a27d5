"""Weight-only int8 / int4 quantization of an export's linears, hashed tables and MoE experts, and its safetensors form.

What: the ``nn.Linear`` and ``nn.Embedding`` weights a model's spec does not keep (``Inference.quantize_keep_fqns``)
become torchao tensor subclasses: ``int8``, one fp32 scale per output row of a linear or per row of a table
(``Int8WeightOnlyConfig``, ``Int8Tensor``); ``int4``, one scale per 32 values of a row
(``IntxWeightOnlyConfig(int4, PerGroup(32))``, ``IntxUnpackedToInt8Tensor``: torchao 0.18's int4 that
runs on CPU; its packed int4 layouts need CUDA, XPU or NPU kernels). A linear dequantizes inside ``F.linear``;
a table dequantizes only the rows a lookup reads (``models.common.embedding_rows``).

The MoE's 3-D expert weights (``GroupedExperts.w1 / w3 / w2``, (E, out, in)) are no linears, so ``quantize_``
(which swaps modules' ``weight``) does not reach them; they become the same two torchao classes, built with
their ``from_hp`` (both take N-D weights): int8 with one scale per output row of each expert, int4 with one
scale per 32 values along the input dimension (a row that 32 does not divide, 1B's w2 of 528, takes the largest
divisor of the row up to 32: :func:`int4_group_size`). torchao has no grouped GEMM on such weights on CPU, so
the experts' forward (:func:`quantized_experts_forward`, installed on each quantized ``GroupedExperts``)
dequantizes only the experts a call routes tokens to and runs the model's own grouped SwiGLU on them.
Every other tensor (norms, LoRA adapters, the kept linears) keeps the export's dtype.

Layout on disk: torchao's safetensors flattening (``<module>._weight_qdata``, ``_weight_scale``,
``_weight_zero_point``, ``<experts>._w1_qdata``, ..., and a JSON description of each tensor in the file's
header); torchao keeps one int4 value per int8, so :func:`flatten_quantized` packs two per byte (low nibble
first) and :func:`unflatten_quantized` unpacks them, checking that each quantized tensor's parts are all there
and agree in shape. Loading (:func:`load_quantized`) rebuilds the same subclasses on the same modules and loads
every tensor strictly. torchao is imported only when a quantized export is written or read, so an unquantized
export loads without it.

Speed or memory: kept quantized, a weight is dequantized at every call (cached decoding on CPU ran well below
bf16's speed, docs/benchmarks.md); :func:`dequantize_weights` turns every quantized weight into a plain one in
the model's compute dtype once, after loading, which is what the loaders do unless told to keep them
(``keep_quantized``). Loading materialises the full-precision model first, so dequantizing raises no peak.
Limits: an int4 linear's row width must be a multiple of 32 (else it keeps the export's dtype, logged), an
int4 expert row must have a divisor from 8 to 32.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable
from types import MethodType
from typing import Any

import torch
from torch import nn

from spider_titan.export_format import REEXPORT, TORCHAO_KEYS

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


class DamagedQuantizedTensor(ValueError):
    """A quantized tensor of an export whose stored parts are missing or disagree (one line, naming the file)."""


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
EXPERT_WEIGHTS = ("w1", "w3", "w2")  # GroupedExperts' (E, out, in) parameters
MIN_INT4_GROUP = 8  # an int4 expert row with no divisor from here to 32 keeps the export's dtype


def int4_group_size(width: int) -> int | None:
    """Values per int4 scale along an expert row of ``width``: 32, else the largest divisor of ``width``
    below it (torchao's groups must divide the row), None below :data:`MIN_INT4_GROUP`."""
    size = next(g for g in range(INT4_GROUP_SIZE, 0, -1) if width % g == 0)
    return size if size >= MIN_INT4_GROUP else None


def expert_weight_fqn(module_fqn: str, name: str) -> str:
    """The FQN of the expert weight ``name`` of the ``GroupedExperts`` at ``module_fqn`` ("" for the root)."""
    return f"{module_fqn}.{name}" if module_fqn else name


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of every MoE's ``GroupedExperts`` in ``model``."""
    from spider_titan.moe.layer import GroupedExperts

    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)]


def plan_weight_only(model: nn.Module, method: str, keep: Iterable[str]) -> tuple[list[str], list[str], list[str]]:
    """(quantized, kept, skipped) FQNs of ``model``'s linears and tables (module FQNs) and expert weights
    (``<experts>.w1``, parameter FQNs): kept where the FQN contains one of ``keep``; skipped where int4's
    groups do not divide a row; the rest quantized."""
    keep = tuple(keep)
    quantized, kept, skipped = [], [], []
    experts = {fqn for fqn, _ in expert_modules(model)}
    for fqn, module in model.named_modules():
        if isinstance(module, QUANTIZABLE):
            weights = [(fqn, module.weight.shape[1] % INT4_GROUP_SIZE == 0)]
        elif fqn in experts:
            weights = [
                (expert_weight_fqn(fqn, n), int4_group_size(getattr(module, n).shape[-1]) is not None)
                for n in EXPERT_WEIGHTS
            ]
        else:
            continue
        for name, int4_fits in weights:
            if any(part in name for part in keep):
                kept.append(name)
            elif method == "int4" and not int4_fits:
                skipped.append(name)
            else:
                quantized.append(name)
    return quantized, kept, skipped


def quantize_expert_weight(weight: torch.Tensor, method: str) -> torch.Tensor:
    """One (E, out, in) expert weight as torchao's tensor: int8 one scale per output row of each expert,
    int4 one scale per :func:`int4_group_size` values of a row (symmetric, as the linears')."""
    with quiet_torchao_import():
        from torchao.quantization import Int8Tensor, IntxUnpackedToInt8Tensor, PerRow

    weight = weight.detach()
    if method == "int8":
        return Int8Tensor.from_hp(weight, granularity=PerRow())  # block (1, 1, in)
    group = int4_group_size(weight.shape[-1])
    return IntxUnpackedToInt8Tensor.from_hp(weight, (1, 1, group), torch.int4)


def apply_weight_only(model: nn.Module, method: str, fqns: Iterable[str], *, where: object = "--quantize") -> None:
    """Quantize the linears and tables (module FQNs) and expert weights (parameter FQNs) ``fqns`` of
    ``model`` in place (``method``: int8 or int4); a quantized expert module gets
    :func:`quantized_experts_forward`."""
    check_method(method, where)
    quantize_, _ = require_torchao(where, method)
    fqns = set(fqns)
    with quiet_torchao_import():
        quantize_(model, torchao_config(method), filter_fn=lambda module, fqn: fqn in fqns)
    for fqn, module in expert_modules(model):
        names = [n for n in EXPERT_WEIGHTS if expert_weight_fqn(fqn, n) in fqns]
        for name in names:
            quantized = quantize_expert_weight(getattr(module, name), method)
            setattr(module, name, nn.Parameter(quantized, requires_grad=False))
        if names:
            module.forward = MethodType(quantized_experts_forward, module)


def dequantized(weight: torch.Tensor, dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
    """The values of torchao's quantized ``weight`` (of only the ``experts`` it leads with, when given) in
    ``dtype``: ``(q - zero_point) * scale`` in fp32 (exact for int8 / int4 data and fp32 or bf16 scales),
    then cast, whatever dtype the subclass itself names (it keeps the export's through ``Module.to``)."""
    from torchao.quantization.quant_primitives import dequantize_affine

    parts = [weight.qdata, weight.scale, getattr(weight, "zero_point", None)]
    if experts is not None:  # every part leads with the expert dim
        parts = [None if p is None else p[experts] for p in parts]
    values = dequantize_affine(parts[0], weight.block_size, parts[1], parts[2], torch.int8, output_dtype=torch.float32)
    return values.to(dtype)


def routed_expert_weights(weight: torch.Tensor, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight[experts]`` (n, out, in) in ``dtype``; a quantized weight dequantizes only those experts."""
    return dequantized(weight, dtype, experts) if is_quantized(weight) else weight[experts].to(dtype)


def quantized_experts_forward(
    self, x_exp: torch.Tensor, offs: torch.Tensor, row_real: torch.Tensor | None = None, filled: bool = False
) -> torch.Tensor:
    """``GroupedExperts.forward`` on quantized weights: the experts with rows in this call (one host read
    of their count) dequantized in the compute dtype, the others not touched, then the same grouped
    SwiGLU on them (an empty expert's segment dropped from ``offs`` leaves the others' rows where they are)."""
    from spider_titan.moe.base import compute_dtype

    sizes = torch.diff(offs, prepend=offs.new_zeros(1))  # (E,) rows per expert
    used = (sizes > 0).nonzero().flatten()  # (n,)
    if used.numel() == 0:
        return x_exp.new_zeros(x_exp.shape)
    dtype = compute_dtype(x_exp)
    w1, w3, w2 = (routed_expert_weights(getattr(self, n), used, dtype) for n in EXPERT_WEIGHTS)
    return self.swiglu(x_exp, offs[used], w1, w3, w2, filled)


def dequantize_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Every quantized weight of ``model`` replaced by a plain one holding its values (:func:`dequantized`)
    in ``dtype`` (the compute dtype), and the experts' own forward restored: the speed of an unquantized
    model, at its memory. The number of weights dequantized."""
    count = 0
    for module in model.modules():
        quantized = [(n, p) for n, p in module.named_parameters(recurse=False) if is_quantized(p)]
        for name, param in quantized:
            setattr(module, name, nn.Parameter(dequantized(param, dtype), requires_grad=False))
        if quantized:
            module.__dict__.pop("extra_repr", None)  # torchao's description of the quantized weight
            if getattr(module.__dict__.get("forward"), "__func__", None) is quantized_experts_forward:
                del module.forward
        count += len(quantized)
    return count


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
        if key in tensors:  # a missing one is named below
            tensors[key] = _unpack_int4(tensors[key])
    for fqn in json.loads(metadata[TORCHAO_KEYS]):
        problem = _parts_problem(fqn, tensors, metadata.get(fqn))
        if problem is not None:
            raise DamagedQuantizedTensor(f"{where}: quantized tensor {fqn}: {problem}; restore the file or {REEXPORT}")
    state, leftover = support.unflatten_tensor_state_dict(tensors, metadata)
    return {**state, **leftover}


def _parts_problem(fqn: str, tensors: dict[str, torch.Tensor], description: str | None) -> str | None:
    """What is wrong with the stored parts of the quantized tensor ``fqn`` (torchao's keys
    ``<module>._<name>_<part>``), in words; None when every part its ``description`` names is there, the
    data is int8 and the scales and zero points have one entry per block of ``block_size``."""
    try:
        meta = json.loads(description or "")
    except ValueError:
        return "its description in the file's header is missing or not JSON"
    if meta.get("_type") == "Tensor":
        return None if fqn in tensors else "missing from the file"
    module, _, name = fqn.rpartition(".")
    prefix = f"{module}._{name}_"
    names = meta.get("_tensor_data_names") or []
    missing = [n for n in names if prefix + n not in tensors]
    if missing:
        return f"its {missing[0]} ({prefix}{missing[0]}) is missing"
    qdata, block = tensors.get(prefix + "qdata"), (meta.get("_data") or {}).get("block_size")
    if qdata is None or qdata.dtype != torch.int8 or not isinstance(block, list) or len(block) != qdata.dim():
        return f"its data is not {len(block) if isinstance(block, list) else 'N'}-D int8 as its header says"
    if any(not isinstance(b, int) or b < 1 or d % b for d, b in zip(qdata.shape, block)):
        return f"its data {tuple(qdata.shape)} is not made of blocks of {tuple(block)}"
    blocks = tuple(d // b for d, b in zip(qdata.shape, block))
    for part in [n for n in names if n != "qdata"]:
        t = tensors[prefix + part]
        if t.numel() > 1 and tuple(t.shape) != blocks:
            return f"its {part} is {tuple(t.shape)}, its data {tuple(qdata.shape)} needs {blocks}"
    return None


def quantization_block(method: str, quantized: list[str], kept: list[str], skipped: list[str]) -> dict[str, Any]:
    """config.json's ``quantization``: what a reader needs (``method``) and what was done, in words."""
    import torchao

    return {
        "method": method,
        "library": f"torchao {torchao.__version__}",
        "weights": "int8, one scale per row (of each expert)"
        if method == "int8"
        else f"int4, one scale per {INT4_GROUP_SIZE} values of a row (an expert row 32 does not divide: its "
        "largest divisor below 32), stored two per byte",
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
    experts = {expert_weight_fqn(fqn, n) for fqn, _ in expert_modules(model) for n in EXPERT_WEIGHTS}
    quantized = {fqn if fqn in experts else fqn.removesuffix(".weight") for fqn, t in state.items() if is_quantized(t)}
    weights = {fqn for fqn, module in model.named_modules() if isinstance(module, QUANTIZABLE)} | experts
    if not quantized <= weights:
        wrong = sorted(quantized - weights)
        raise ValueError(
            f"{where}: quantized tensors {wrong[:3]} are not linear, table or expert weights of the model; re-export it"
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
        if fqn in want and t.shape != want[fqn].shape:
            raise ValueError(
                f"{where}: tensor {fqn} has shape {tuple(t.shape)}, the model needs {tuple(want[fqn].shape)}; "
                "re-export it"
            )
    model.load_state_dict(state, strict=True, assign=True)
