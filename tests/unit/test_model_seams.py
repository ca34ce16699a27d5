"""The framework asks a model through its ``ModelSpec``, never by name (docs/extension.md, "Add a model").

No module of the package outside ``spider_titan/models/``, the registry (whose job is to map names to
specs) and a model's own transformers classes (``Inference.hf_modules``, bundled into its exports)
imports a model's package, or compares anything with a model's registry name (``name == "spider"``,
``name in ("spider",)``, a table keyed by it). Read with ``ast`` like tests/unit/test_layering.py, so
lazy imports count too; the negative control feeds the same check sources that break each rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from spider_titan import registry
from tests.unit.test_layering import PACKAGE, module_name

MODEL_NAMES = set(registry.names("model"))
# the package a registered spec lives in: "spider_titan.models.spider.model:SPIDER_SPEC" -> spider_titan.models.spider
MODEL_PACKAGES = {registry.COMPONENTS["model"][name].target.split(":")[0].rsplit(".", 1)[0] for name in MODEL_NAMES}
EXEMPT = {"spider_titan.models", "spider_titan.registry"} | {
    module
    for name in MODEL_NAMES
    if (inference := registry.get("model", name).inference)
    if (hf := inference.hf_modules)
    for module in hf.modules
}


def model_names_used(source: str, names: set[str], packages: set[str]) -> list[str]:
    """``line: what`` for every import of one of ``packages`` and every comparison with (or tuple,
    list, set or dict key holding) one of the model ``names`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            modules = []
        for module in modules:
            if any(module == p or module.startswith(p + ".") for p in packages):
                found.append(f"{node.lineno}: imports {module}")
                break
        if isinstance(node, ast.Compare):
            held = [node.left, *node.comparators]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            held = node.elts
        elif isinstance(node, ast.Dict):
            held = [k for k in node.keys if k is not None]
        else:
            held = []
        for item in held:
            items = item.elts if isinstance(item, (ast.Tuple, ast.List, ast.Set)) else [item]
            for c in items:
                if isinstance(c, ast.Constant) and c.value in names:
                    found.append(f"{node.lineno}: names model {c.value!r}")
    return sorted(set(found))


def framework_modules(root: Path = PACKAGE) -> dict[str, Path]:
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    return {
        name: path for name, path in modules.items() if not any(name == e or name.startswith(e + ".") for e in EXEMPT)
    }


def test_the_exemptions_are_what_they_say():
    assert MODEL_PACKAGES == {"spider_titan.models.spider", "spider_titan.models.dense"}
    assert "spider_titan.hf.modeling_spider" in EXEMPT and "spider_titan.hf.bundle" not in EXEMPT
    assert "spider_titan.generation" in framework_modules() and "spider_titan.plan" in framework_modules()


def test_the_framework_never_names_a_model():
    bad = [
        f"{name}:{where}"
        for name, path in sorted(framework_modules().items())
        for where in model_names_used(path.read_text(), MODEL_NAMES, MODEL_PACKAGES)
    ]
    assert not bad, "framework code that names a model (ask its ModelSpec instead):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source,expected",
    [
        ("from spider_titan.models.spider import Spider\n", ["1: imports spider_titan.models.spider"]),
        ("from spider_titan.models import spider\n", ["1: imports spider_titan.models.spider"]),
        ("def f():\n    import spider_titan.models.dense.model\n", ["2: imports spider_titan.models.dense.model"]),
        ("if name == 'spider':\n    pass\n", ["1: names model 'spider'"]),
        ("ok = 'dense' != spec.name\n", ["1: names model 'dense'"]),
        ("HF_MODELS = ('spider',)\nx = name in HF_MODELS\n", ["1: names model 'spider'"]),
        ("x = name in ['dense', 'spider']\n", ["1: names model 'dense'", "1: names model 'spider'"]),
        ("SKIP = {'spider': ['router']}\n", ["1: names model 'spider'"]),
        # what the framework may do: default a config key to a name, import shared model parts, ask a spec
        ("name: str = 'spider'\n", []),
        ("from spider_titan.models.common import SwiGLU\n", []),
        ("decoder = spec.cached_decoder()\nx = name == spec.name\n", []),
    ],
)
def test_the_check_catches_what_it_should(source, expected):
    packages = {"spider_titan.models.spider", "spider_titan.models.dense"}
    assert model_names_used(source, {"spider", "dense"}, packages) == expected
