"""An export loads with transformers' Auto classes and runs under lm-evaluation-harness (docs/hf.md).

The model is a randomly initialised debug Spider written by the exporter itself (``write_export``),
fp32; transformers and lm_eval come with the ``hf`` extra (in the test extra)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch

from spider_titan.checkpoint.export import write_export
from spider_titan.checkpoint.layout import ModelIdentity
from spider_titan.generation import load_model
from spider_titan.hf.bundle import bundled_source, flat_name, source_closure
from spider_titan.models.spider import SPIDER_FLAVORS, SPIDER_SPEC, Spider
from spider_titan.vocab import BOS_ID
from tests.unit.test_spider_model import DEBUG

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Byte-level models read UTF-8: naïve café, 東京, and emoji 🕷️ alike.",
    "def f(x):\n    return x * 2  # code is text too\n",
]


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    args = DEBUG  # two loops: the export keeps the loops apart
    with torch.device("meta"):
        model = Spider(args)
    model.to_empty(device="cpu")
    model.init_weights()
    out = tmp_path_factory.mktemp("hf") / "export"
    write_export(model.state_dict(), ModelIdentity.of("spider", "debug", args), out, dtype=torch.float32)
    return out


def _auto(export: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export, trust_remote_code=True)
    return model.eval(), tokenizer


def test_auto_classes_load_the_export_and_match_spider_titan(export, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = _auto(export)
    ref, _ = load_model(export)
    for text in TEXTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        assert ids[0].tolist() == list(text.encode("utf-8"))  # bytes, no specials added
        assert tokenizer.decode(ids[0]) == text
        with_bos = torch.cat([torch.tensor([[BOS_ID]]), ids], dim=1)
        with torch.no_grad():
            torch.testing.assert_close(model(with_bos).logits, ref(with_bos).logits, rtol=1e-5, atol=1e-5)
    # generate() (greedy) writes what an argmax loop over spider_titan's own forward writes
    prompt = torch.tensor([[BOS_ID, *b"Once upon"]])
    out = model.generate(prompt, max_new_tokens=12, do_sample=False)
    ids = prompt[0].tolist()
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out[0].tolist()[: len(ids)] == ids
    # with Spider's cache (the default) and without it, generate() writes the same bytes
    torch.manual_seed(7)
    cached = model.generate(prompt, max_new_tokens=24, do_sample=True, top_k=40)
    torch.manual_seed(7)
    plain = model.generate(prompt, max_new_tokens=24, do_sample=True, top_k=40, use_cache=False)
    assert cached.tolist() == plain.tolist()


def test_a_left_padded_batch_is_decoded_with_the_cache_as_its_rows_alone(export, monkeypatch):
    """Prompts of different lengths, left-padded by the tokenizer: greedy generate() writes for each
    row what the row alone writes, and never runs the full forward (the cache, PAD masked out)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = _auto(export)
    prompts = ["<s>Once upon", "<s>def f(x):\n    return", "<s>A"]
    alone = [
        model.generate(tokenizer(p, return_tensors="pt").input_ids, max_new_tokens=10, do_sample=False) for p in prompts
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert not bool(batch.attention_mask.all())  # the batch really is padded

    def no_full_forward(*args, **kwargs):
        raise AssertionError("the full forward ran: the padded batch was not decoded with the cache")

    monkeypatch.setattr(model.model, "forward", no_full_forward)
    out = model.generate(**batch, max_new_tokens=10, do_sample=False)
    width = batch.input_ids.shape[1]
    for i, row in enumerate(alone):
        n = row.shape[1] - 10  # the row's prompt length
        assert out[i, width - n :].tolist()[: row.shape[1]] == row[0].tolist()


def test_the_export_holds_the_packages_own_sources(export):
    """No second copy that could drift: each bundled file is a package module with only its
    spider_titan imports made relative, and the folder holds exactly the model's import closure."""
    modules = source_closure(SPIDER_SPEC.inference.hf_modules.modules)
    assert {f"{flat_name(m)}.py" for m in modules} == {p.name for p in export.glob("*.py")}
    assert "spider_titan.models.spider.model" in modules and "spider_titan.moe.layer" in modules
    assert "spider_titan.export_format" in modules  # the checks spider_titan's own reader makes
    assert not any(m.startswith(("spider_titan.checkpoint", "spider_titan.components")) for m in modules)
    for module in modules:
        bundled = (export / f"{flat_name(module)}.py").read_text()
        assert bundled == bundled_source(module)
        original = Path(__import__("spider_titan").__file__).parent.joinpath(*module.split(".")[1:])
        original = original.with_suffix(".py").read_text().splitlines()
        changed = [(a, b) for a, b in zip(original, bundled.splitlines()) if a != b]
        assert all("from spider_titan." in a and "from .st_" in b or "from ." in b for a, b in changed), changed
    config = json.loads((export / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_spider.SpiderForCausalLM"


def test_loading_an_export_leaves_the_packages_custom_ops_registered(export, monkeypatch):
    """The bundled copy of moe/layer.py defines its ops under a namespace of its own: defining
    ``spider_titan::grouped_mm`` again would free the package's definition, and every later Spider
    forward in the process would call a freed op (CI failed so, after this file, 174 tests)."""
    from torch._library.custom_ops import OPDEFS

    from spider_titan.moe import layer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _auto(export)
    copies = [m for name, m in sys.modules.items() if name.endswith(".st_moe_layer")]
    assert copies
    assert OPDEFS["spider_titan::grouped_mm"] is layer._grouped_mm_opaque
    for copy in copies:
        assert copy._grouped_mm_opaque is not layer._grouped_mm_opaque
        assert OPDEFS[copy._grouped_mm_opaque._qualname] is copy._grouped_mm_opaque
    a, b = torch.randn(8, 8), torch.randn(2, 8, 8)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    want = torch.cat([a[:3] @ b[0], a[3:] @ b[1]])
    torch.testing.assert_close(layer._grouped_mm_opaque(a, b, offs), want)
    for copy in copies:
        torch.testing.assert_close(copy._grouped_mm_opaque(a, b, offs), want)


def test_the_bundled_code_reads_the_model_as_spider_titan_does(tmp_path, monkeypatch):
    """The model block goes through the reader spider_titan uses (export_format.read_model_block): an
    export older than a field of ``SPIDER_ADDED_ARGS`` builds the model it was saved as (transformers'
    own defaults would build today's), and an unknown arg is refused in the same one line."""
    from spider_titan.models.spider.args import SPIDER_ADDED_ARGS

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    key, then = next((k, v) for k, v in SPIDER_ADDED_ARGS.items() if v != getattr(SPIDER_FLAVORS["debug"], k))
    args = dataclasses.replace(SPIDER_FLAVORS["debug"], **{key: then})
    with torch.device("meta"):
        model = Spider(args)
    model.to_empty(device="cpu")
    model.init_weights()
    out = write_export(
        model.state_dict(), ModelIdentity.of("spider", "debug", args), tmp_path / "e", dtype=torch.float32
    )
    config = json.loads((out / "config.json").read_text())
    del config["model"]["args"][key]
    (out / "config.json").write_text(json.dumps(config))
    hf, _ = _auto(out)
    assert getattr(hf.model.args, key) == then == getattr(load_model(out)[0].args, key)
    config["model"]["args"]["no_such_arg"] = 1
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as hf_error:
        _auto(out)
    with pytest.raises(ValueError) as own_error:
        load_model(out)
    assert str(hf_error.value) == str(own_error.value) and "unknown 'no_such_arg'" in str(own_error.value)


def _drop_first(tensors: dict) -> str:
    name = sorted(tensors)[0]
    del tensors[name]
    return name


def _add_extra(tensors: dict) -> str:
    tensors["extra.weight"] = torch.zeros(2)
    return "extra.weight"


@pytest.mark.parametrize(
    "edit, what", [(_drop_first, "tensors missing"), (_add_extra, "not in the model")], ids=["missing", "extra"]
)
@pytest.mark.parametrize("where", ["local-folder", "load-report"])
def test_an_export_with_a_missing_or_extra_tensor_is_refused(export, tmp_path, monkeypatch, edit, what, where):
    """transformers alone loads such an export with random weights in place of the missing tensor
    (its load report only warns); the bundled code refuses it in one line, as scripts/generate.py
    does. A local folder is checked from the file headers before loading; anything else (a hub id)
    from transformers' load report after it, here forced by hiding the folder's tensor names."""
    from spider_titan.hf import modeling_spider

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "export"
    shutil.copytree(export, folder)
    tensors = safetensors.torch.load_file(folder / "model.safetensors")
    name = edit(tensors)
    safetensors.torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if where == "local-folder":
        load = transformers.AutoModelForCausalLM.from_pretrained
        kwargs = {"trust_remote_code": True}
    else:  # the package's class (the bundled copy is the same source), with the header check off
        monkeypatch.setattr(modeling_spider, "export_tensor_names", lambda folder: None)
        load, kwargs = modeling_spider.SpiderForCausalLM.from_pretrained, {}
    with pytest.raises(ValueError) as err:
        load(folder, dtype=torch.float32, **kwargs)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{folder}: 1 ") and f"{what} ({name})" in line, line
    assert line.endswith(
        "the export is incomplete or from another model: re-export it with scripts/export_safetensors.py"
    )


TASK = """\
task: spider_local_bpb
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def test_lm_eval_rolling_bits_per_byte_equal_spider_titans(export, tmp_path, monkeypatch):
    """lm-evaluation-harness on a local task (no network): its bits per byte over the documents
    equal spider_titan's own, -sum log2 p(byte | [BOS] + the bytes before) / bytes."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")
    # a single process: launcher variables an earlier test left behind would make accelerate
    # (inside lm-eval's hf model) try to join a process group
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "spider_local_bpb.yaml").write_text(textwrap.dedent(TASK.format(data=data)))

    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},trust_remote_code=True,dtype=float32",
        tasks=["spider_local_bpb"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),  # not 13k built-in YAMLs
        device="cpu",
        batch_size=1,
    )
    got = results["results"]["spider_local_bpb"]["bits_per_byte,none"]

    ref, _ = load_model(export)
    nll, n_bytes = 0.0, 0
    with torch.no_grad():
        for text in TEXTS:
            raw = list(text.encode("utf-8"))
            ids = torch.tensor([[BOS_ID, *raw]])
            logp = ref(ids).logits[0, :-1].double().log_softmax(-1)
            nll -= float(logp.gather(1, torch.tensor(raw)[:, None]).sum())
            n_bytes += len(raw)
    want = nll / n_bytes / math.log(2)
    assert got == pytest.approx(want, rel=1e-5), (got, want)


def test_an_export_with_non_finite_weights_is_refused(export, tmp_path, monkeypatch):
    """transformers loaded an export holding NaN with no word and generated NUL bytes from it; the
    bundled code refuses it in one line naming the tensor, as scripts/generate.py does."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "export"
    shutil.copytree(export, folder)
    tensors = safetensors.torch.load_file(folder / "model.safetensors")
    name = sorted(k for k, v in tensors.items() if v.is_floating_point())[-1]
    tensors[name].view(-1)[0] = float("nan")
    safetensors.torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    line = str(err.value)
    assert "\n" not in line and line == (
        f"{folder}: tensor {name} holds NaN or inf; export a checkpoint saved before the values went non-finite"
    )
