"""Quantized exports (``--quantize int8|int4``, quantization/weight_only.py): written from an export, loaded by
spider_titan and by transformers into the same model, smaller than fp32; the mistakes are one line each.

The model is a randomly initialised debug Spider (seed 0) written by the exporter itself, as in
tests/integration/test_hf.py, its hashed tables (zero at init) filled with random rows so that quantizing them
changes the logits."""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from spider_titan import registry
from spider_titan.checkpoint.export import export_checkpoint, quantized_state, read_export, write_export
from spider_titan.checkpoint.layout import ModelIdentity
from spider_titan.components.builder import materialize
from spider_titan.generation import generate, load_model
from spider_titan.models.common import embedding_rows
from spider_titan.models.spider import SPIDER_FLAVORS
from spider_titan.models.spider.engram import Engram
from spider_titan.quantization import weight_only
from spider_titan.vocab import BOS_ID
from tests.utils import REPO

pytest.importorskip("torchao")

QUANTIZED_TYPE = {"int8": "Int8Tensor", "int4": "IntxUnpackedToInt8Tensor"}


def _export(name: str, out: Path) -> Path:
    """A randomly initialised debug model of ``name`` written as an fp32 export."""
    torch.manual_seed(0)
    spec = registry.get("model", name)
    args = spec.flavors["debug"]
    model = spec.build_on_meta(args)
    materialize(model, torch.device("cpu"), seed=0)
    with torch.no_grad():
        for fqn, module in model.named_modules():
            if isinstance(module, nn.Embedding) and ("byte_ngrams" in fqn or "engram" in fqn):
                module.weight.normal_(0.0, 0.05)
    return write_export(model.state_dict(), ModelIdentity.of(name, "debug", args), out, dtype=torch.float32)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """fp32, bf16, int8 and int4 exports of one model (the last three re-exported from the first)."""
    root = tmp_path_factory.mktemp("quantize")
    out = {"fp32": _export("spider", root / "fp32")}
    out["bf16"] = export_checkpoint(out["fp32"], root / "bf16", dtype=torch.bfloat16)
    for method in weight_only.METHODS:
        out[method] = export_checkpoint(out["fp32"], root / method, dtype=torch.bfloat16, quantize=method)
    return out


def _script():
    spec = importlib.util.spec_from_file_location(
        "export_safetensors_script", REPO / "scripts" / "export_safetensors.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_int4_packs_two_values_per_byte():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)  # (3, 32), every int4 value
    packed = weight_only._pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16)
    assert torch.equal(weight_only._unpack_int4(packed), q)


def _experts(model: nn.Module) -> nn.Module:
    return model.core.layers[0].moe.experts


@pytest.mark.parametrize("method", weight_only.METHODS)
def test_a_quantized_export_loads_the_same_in_spider_titan_and_transformers(exports, method, monkeypatch):
    """The export's linears and experts are torchao's quantized tensors but for those the spec keeps;
    spider_titan's load_model reads back exactly what was quantized, and transformers (the export's own
    code) builds the same model: equal logits and the same greedy bytes from both generate()s, with the
    weights kept quantized and with them dequantized at load (the default)."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = exports[method]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["method"] == method and config["dtype"] == "bfloat16"
    assert {"lm_head", "embed_tokens"} <= set(config["quantization"]["kept_weights"])

    model, _ = load_model(out, keep_quantized=True)
    engram = next(m for m in model.modules() if isinstance(m, Engram))
    experts = [model.core.inject.weight, model.byte_ngrams.tables[0].weight, engram.table1.weight]
    experts += [getattr(_experts(model), n) for n in weight_only.EXPERT_WEIGHTS]
    for weight in experts:
        assert type(weight).__name__ == QUANTIZED_TYPE[method]
    assert type(model.lm_head.weight) is nn.Parameter and type(model.boundary_predictor.q_proj.weight) is nn.Parameter
    assert type(model.embed_tokens.weight) is nn.Parameter
    # what is read back is what the exporter quantized (int4: packed two per byte on disk)
    _, _, source = read_export(exports["fp32"])
    identity = ModelIdentity.of("spider", "debug", SPIDER_FLAVORS["debug"])
    written, _ = quantized_state(source, identity, torch.bfloat16, method)
    stored = load_model(out, dtype=torch.bfloat16, keep_quantized=True)[0].state_dict()
    assert written.keys() == stored.keys()
    for key, value in written.items():
        assert type(stored[key]) is type(value), key
        assert all(map(torch.equal, weight_only.tensor_parts(value), weight_only.tensor_parts(stored[key]))), key

    prompt = b"Once upon"
    ids = torch.tensor([[BOS_ID, *prompt]])
    dequantized, _ = load_model(out)
    assert not any(weight_only.is_quantized(t) for t in dequantized.state_dict().values())
    assert "forward" not in vars(_experts(dequantized))
    for ours, keep in ((model, True), (dequantized, False)):
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            out, trust_remote_code=True, dtype=torch.float32, keep_quantized=keep
        )
        assert weight_only.is_quantized(_experts(hf.model).w1) is keep
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)
        mine = generate(ours, prompt, max_new_bytes=16, temperature=0)
        theirs = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
        assert len(mine) == 16 and list(mine) == theirs
    with torch.no_grad():  # the same values dequantized once or at every call (torchao rounds tables to bf16)
        torch.testing.assert_close(dequantized(ids).logits, model(ids).logits, rtol=0, atol=5e-3)


@pytest.mark.parametrize("method", weight_only.METHODS)
def test_quantized_experts_round_each_value_to_within_half_a_step(exports, method):
    """Every exported expert weight, dequantized, is within half its scale (and the scale's own rounding) of the
    bf16 weight it was quantized from: one scale per output row of each expert (int8), per 32 values of a row (int4)."""
    _, _, source = read_export(exports["fp32"])
    model, _ = load_model(exports[method], keep_quantized=True)
    for fqn, module in weight_only.expert_modules(model):
        for name in weight_only.EXPERT_WEIGHTS:
            weight = getattr(module, name)
            original = source[f"{fqn}.{name}"].to(torch.bfloat16).float()  # (E, out, in)
            E, rows, width = original.shape
            group = width if method == "int8" else weight_only.INT4_GROUP_SIZE
            assert weight.scale.shape == (E, rows, width // group)
            error = (weight_only.dequantized(weight, torch.float32) - original).abs()
            error = error.reshape(E, rows, width // group, group).amax(-1)  # per row or group
            # half a step, and the rounding of the arithmetic torchao quantizes in (the scale's dtype at export:
            # fp32 for int8, the export's bf16 for int4): the scale and the quotient value / scale each a relative
            # eps / 2 off, at up to 7.5 or 127.5 steps from zero
            levels, arithmetic = (127.5, torch.float32) if method == "int8" else (7.5, torch.bfloat16)
            bound = weight.scale.float() * (0.5 + levels * torch.finfo(arithmetic).eps)
            assert bool((error <= bound * (1 + 1e-6)).all()) and float(error.max()) > 0, f"{fqn}.{name}"


@pytest.mark.parametrize("method", weight_only.METHODS)
def test_quantized_experts_dequantize_only_the_experts_a_call_routes_to(method, monkeypatch):
    """The quantized experts' forward equals the plain experts' forward on the dequantized weights, bit for
    bit, and dequantizes only the experts given rows (here 2 of 8, in a call with an empty expert between)."""
    from spider_titan.moe.layer import GroupedExperts

    torch.manual_seed(0)
    plain = GroupedExperts(8, 64, 96)
    plain.init_weights(0.02, 0.02)
    quantized = GroupedExperts(8, 64, 96)
    quantized.load_state_dict(plain.state_dict())
    weight_only.apply_weight_only(quantized, method, [f"{n}" for n in weight_only.EXPERT_WEIGHTS])
    with torch.no_grad():
        for n in weight_only.EXPERT_WEIGHTS:
            getattr(plain, n).copy_(weight_only.dequantized(getattr(quantized, n), torch.float32))
    x = torch.randn(5, 64)
    offs = torch.tensor([0, 0, 3, 3, 3, 3, 5, 5], dtype=torch.int32)  # experts 2 and 6: rows 0-2 and 3-4
    seen = []
    routed = weight_only.routed_expert_weights
    monkeypatch.setattr(
        weight_only, "routed_expert_weights", lambda w, e, d: seen.append(e.tolist()) or routed(w, e, d)
    )
    with torch.no_grad():
        got = quantized(x, offs, filled=True)
        assert torch.equal(got, plain(x, offs, filled=True))
    assert seen == [[2, 6]] * 3


@pytest.mark.parametrize("method", weight_only.METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_table_dequantizes_the_rows_it_reads_as_torchao_does(method, dtype, monkeypatch):
    """``embedding_rows`` on a quantized table equals torchao's own lookup (the whole table dequantized),
    bit for bit, dequantizing only the rows read; on a plain table it is the plain lookup."""
    torch.manual_seed(0)
    table = nn.Embedding(300, 64).to(dtype)
    ids = torch.randint(0, 300, (3, 5, 2))
    assert torch.equal(embedding_rows(table, ids), table(ids))
    plain = table.weight.detach().clone()
    holder = nn.Sequential(table)
    weight_only.apply_weight_only(holder, method, ["0"])
    assert type(table.weight).__name__ == QUANTIZED_TYPE[method]
    kind, dequantized = type(table.weight), []
    whole = kind.dequantize
    monkeypatch.setattr(kind, "dequantize", lambda self, *a: dequantized.append(self.shape[0]) or whole(self, *a))
    got = embedding_rows(table, ids)
    assert dequantized == [ids.numel()]  # 30 rows, not the table's 300
    assert got.shape == (3, 5, 2, 64) and got.dtype == dtype
    assert torch.equal(got, table(ids))  # torchao: F.embedding of the whole dequantized table
    step = {"int8": 2 / 255, "int4": 2 / 15}[method] * plain.abs().max()
    assert 0 < (got - plain[ids]).abs().max() <= step  # quantized, within a step of its scale


def test_quantized_exports_are_smaller(exports):
    size = {name: sum(f.stat().st_size for f in path.glob("*.safetensors")) for name, path in exports.items()}
    assert size["int4"] < size["int8"] < size["bf16"] < size["fp32"], size


def test_an_unknown_quantization_is_one_line(exports, tmp_path):
    with pytest.raises(SystemExit) as stop:
        _script().main(["--checkpoint", str(exports["fp32"]), "--out", str(tmp_path / "x"), "--quantize", "int3"])
    assert (
        stop.value.code
        == "export_safetensors: error: --quantize 'int3': unknown quantization; choose int8 or int4 (or none)"
    )
    assert not (tmp_path / "x").exists()


def test_a_model_without_a_quantized_export_is_one_line(tmp_path):
    """The dense model's spec names no ``quantize_keep_fqns``: refused before any weight is read."""
    dense = _export("dense", tmp_path / "dense")
    with pytest.raises(SystemExit) as stop:
        _script().main(["--checkpoint", str(dense), "--out", str(tmp_path / "x"), "--quantize", "int8"])
    assert stop.value.code == (
        "export_safetensors: error: --quantize int8: the 'dense' model has no quantized export (its ModelSpec "
        "names no quantize_keep_fqns); export it without --quantize"
    )


def test_a_quantized_export_is_no_source(exports, tmp_path):
    with pytest.raises(ValueError) as err:
        export_checkpoint(exports["int8"], tmp_path / "x", dtype=torch.bfloat16, quantize="int4")
    assert str(err.value) == (
        f"{exports['int8']}: already quantized (int8); export from its checkpoint or an unquantized export instead"
    )


def test_reading_a_quantized_export_needs_torchao_and_a_known_method(exports, tmp_path, monkeypatch):
    folder = tmp_path / "int8"
    folder.mkdir()
    for f in exports["int8"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "torchao.quantization", None)  # import torchao.quantization fails
        with pytest.raises(ValueError) as err:
            load_model(folder)
    line = str(err.value)
    assert line.startswith(f"{folder / 'config.json'}: int8 weights need torchao (") and "\n" not in line, line
    assert line.endswith("; pip install torchao")
    config = json.loads((folder / "config.json").read_text())
    config["quantization"]["method"] = "int3"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_model(folder)
    assert str(err.value) == (
        f"{folder / 'config.json'}: quantization 'int3' is not one this code reads (int8, int4); "
        "load it with the spider_titan that wrote it"
    )


W1 = "core.layers.0.moe.experts._w1_"  # the stored parts of one expert weight: qdata, scale, zero_point


def _cut_file(tensors: dict, metadata: dict) -> None:
    """Nothing here: the file loses its last 100 bytes once written."""


def _cut_experts(tensors: dict, metadata: dict) -> None:
    tensors[W1 + "qdata"] = tensors[W1 + "qdata"][:-1].clone()  # one expert fewer


def _reshape_data(tensors: dict, metadata: dict) -> None:
    tensors[W1 + "qdata"] = tensors[W1 + "qdata"].flatten(0, 1).clone()  # (E * out, in)


def _reshape_scale(tensors: dict, metadata: dict) -> None:
    tensors[W1 + "scale"] = tensors[W1 + "scale"].reshape(-1, 2).clone()


def _nan_scale(tensors: dict, metadata: dict) -> None:
    tensors[W1 + "scale"][0, 0] = float("nan")


def _drop_scale(tensors: dict, metadata: dict) -> None:
    del tensors[W1 + "scale"]


DAMAGE = {  # name -> (edit of the stored tensors, what the one line says)
    "truncated-file": (_cut_file, "unreadable"),
    "truncated-experts": (_cut_experts, "core.layers.0.moe.experts.w1"),
    "reshaped-data": (_reshape_data, "core.layers.0.moe.experts.w1: its data"),
    "reshaped-scale": (_reshape_scale, "core.layers.0.moe.experts.w1: its scale is"),
    "nan-scale": (_nan_scale, "tensor core.layers.0.moe.experts.w1 holds NaN or inf"),
    "missing-scale": (_drop_scale, f"its scale ({W1}scale) is missing"),
}


@pytest.mark.parametrize("method", weight_only.METHODS)
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_quantized_expert_weight_is_refused_in_one_line_by_both_loaders(
    exports, tmp_path, method, damage, monkeypatch
):
    """A quantized export whose expert weight was cut, reshaped, given a NaN scale or lost its scale is
    refused by spider_titan's loader (what generate.py prints) and by transformers', each in one line
    naming the file or the tensor, never loaded with wrong values."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "export"
    shutil.copytree(exports[method], folder)
    file = folder / "model.safetensors"
    with safetensors.safe_open(str(file), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    edit, says = DAMAGE[damage]
    edit(tensors, metadata)
    safetensors.torch.save_file(tensors, file, metadata=metadata)
    if damage == "truncated-file":
        file.write_bytes(file.read_bytes()[:-100])
    loaders = {
        "spider_titan": lambda: load_model(folder),
        "transformers": lambda: transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True),
    }
    for name, load in loaders.items():
        with pytest.raises(ValueError) as err:
            load()
        line = str(err.value)
        assert "\n" not in line and says in line and str(folder) in line, (name, line)
