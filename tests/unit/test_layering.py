"""Imports run one way: the layering written in docs/architecture.md, held against the code.

The ```layers block of that page lists, lowest first, the module prefixes of each layer. Every
``spider_titan`` import in the package (read with ``ast``, so lazy imports inside functions count
too) must point to a module of the same or a lower layer, and the module import graph has no
cycle. Around the package, the product (``spider_titan/``, ``scripts/``) never imports the lab
(``lab/``), the lab's tools import the package and each other but neither ``scripts`` nor ``tests``
(only ``lab/tests`` may), and the import graph of all three has no cycle either. Imports inside
functions count everywhere: a lazy import still runs, and a circle through one is a circle the day
the function is called (the package has none at module level or below). The negative controls feed
the same checks a made-up graph or tree that breaks each rule.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.utils import REPO

PACKAGE = REPO / "spider_titan"
DOC = REPO / "docs" / "architecture.md"
# The product's code, the lab's, and what every module of the repository may import from each other.
PRODUCT = ("spider_titan", "scripts")
LAB = "lab"
LAB_TESTS = "lab.tests"


def read_layers(text: str) -> dict[str, int]:
    """prefix -> layer number, from the doc's ```layers block."""
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, f"{DOC}: no ```layers block"
    layers = {}
    for line in block.group(1).splitlines():
        number, _name, *prefixes = line.split()
        for prefix in prefixes:
            layers[prefix] = int(number)
    return layers


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_imports(root: Path = PACKAGE, *others: Path) -> dict[str, set[str]]:
    """module -> the modules of ``root`` (and of the folders ``others`` beside it) it imports (``from a
    import b`` counts as ``a.b`` when ``a.b`` is a module, else as ``a``). A folder without an
    ``__init__.py`` (``scripts/``) counts as a package of its name, as ``from scripts import x`` reads it."""
    roots = (root, *others)
    tops = tuple(r.name for r in roots)
    modules = {module_name(p, r): p for r in roots for p in r.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if _inside(a.name, tops))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if not _inside(base, tops):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t != name}
    return graph


def _inside(module: str, tops: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of the packages ``tops`` or inside one (``lab.x``, not ``labels``)."""
    return any(module == top or module.startswith(top + ".") for top in tops)


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """The imports that break the product/lab rule: the product importing the lab, and the lab's tools
    importing ``scripts`` or ``tests`` (the lab's tests may import the suite's helpers and scripts)."""
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            if _inside(src, PRODUCT) and _inside(dst, (LAB,)):
                bad.append(f"{src} (the product) imports {dst} (the lab)")
            elif _inside(src, (LAB,)) and not _inside(src, (LAB_TESTS,)) and _inside(dst, ("scripts", "tests")):
                bad.append(f"{src} (the lab) imports {dst}: the lab imports the spider_titan package only")
    return bad


def layer_of(module: str, layers: dict[str, int]) -> int | None:
    best = max((p for p in layers if module == p or module.startswith(p + ".")), key=len, default=None)
    return layers[best] if best is not None else None


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = layer_of(src, layers), layer_of(dst, layers)
            if a is not None and b is not None and b > a:
                bad.append(f"{src} (layer {a}) imports {dst} (layer {b})")
    return bad


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative DFS with colours)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    for root in sorted(graph):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph.get(root, ()))))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            for child in children:
                if state.get(child) == 1:
                    return path[path.index(child) :] + [child]
                if not state.get(child) and child in graph:
                    state[child] = 1
                    path.append(child)
                    stack.append((child, iter(sorted(graph[child]))))
                    break
            else:
                state[node] = 2
                path.pop()
                stack.pop()
    return None


def folder_of(module: str) -> str:
    """The package folder a module lives in, one level under the top (``spider_titan.models.spider.x`` ->
    ``spider_titan.models``); a top-level module is a folder of its own."""
    return ".".join(module.split(".")[:2])


def folder_problems(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Folders whose modules sit in more than one layer, and folder-level imports that run up a layer
    or in a circle between two folders: counted folder to folder, as a reader of the tree sees it."""
    by_folder: dict[str, set[int]] = {}
    for module in graph:
        layer = layer_of(module, layers)
        if layer is not None and module != folder_of(module).split(".")[0]:
            by_folder.setdefault(folder_of(module), set()).add(layer)
    bad = [f"{folder} mixes layers {sorted(ls)}" for folder, ls in sorted(by_folder.items()) if len(ls) > 1]
    edges = {
        (folder_of(src), folder_of(dst))
        for src, dsts in graph.items()
        for dst in dsts
        if folder_of(src) != folder_of(dst) and folder_of(src) in by_folder and folder_of(dst) in by_folder
    }
    for a, b in sorted(edges):
        if max(by_folder[b]) > min(by_folder[a]):
            bad.append(f"folder {a} imports folder {b} above it")
        if (b, a) in edges and a < b:
            bad.append(f"folders {a} and {b} import each other")
    return bad


LAYERS = read_layers(DOC.read_text())
GRAPH = read_imports()
# The whole repository's code: the package, the user's scripts and the lab (and the suite, which may import all).
REPOSITORY = read_imports(PACKAGE, REPO / "scripts", REPO / LAB, REPO / "tests")


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in GRAPH if m != "spider_titan" and layer_of(m, LAYERS) is None)
    assert not unplaced, f"modules in no layer of {DOC.name}: {unplaced}"


def test_every_listed_prefix_exists():
    missing = sorted(p for p in LAYERS if not any(m == p or m.startswith(p + ".") for m in GRAPH))
    assert not missing, f"{DOC.name} lists modules that do not exist: {missing}"


def test_imports_run_downward():
    bad = upward_imports(GRAPH, LAYERS)
    assert not bad, "imports that run up a layer:\n" + "\n".join(bad)


def test_folders_match_the_layers():
    """Every folder holds one layer, and no folder imports a folder above it or one that imports it back."""
    bad = folder_problems(GRAPH, LAYERS)
    assert not bad, "\n".join(bad)


def test_the_folder_check_catches_a_contract_inside_an_assembler_folder():
    layers = {"p.cfg.contract": 1, "p.cfg.assemble": 4, "p.models": 3}
    graph = {"p.cfg.contract": set(), "p.cfg.assemble": {"p.models"}, "p.models": {"p.cfg.contract"}}
    assert any("p.cfg mixes layers [1, 4]" in b for b in folder_problems(graph, layers))
    assert any("folder p.models imports folder p.cfg above it" in b for b in folder_problems(graph, layers))
    fixed = {"p.contract": 1, "p.cfg": 4, "p.models": 3}
    assert folder_problems({"p.contract": set(), "p.cfg": {"p.models"}, "p.models": {"p.contract"}}, fixed) == []


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_product_never_imports_the_lab_and_the_lab_only_the_package():
    assert any(m.startswith("lab.bench.") for m in REPOSITORY) and "scripts.evaluate" in REPOSITORY  # all read
    bad = crossings(REPOSITORY)
    assert not bad, "\n".join(bad)


def test_no_import_cycle_in_the_repository():
    """Among spider_titan, scripts and lab (the suite's modules left out: a test importing a test helper
    is no circle a user meets), function-local imports included."""
    code = {
        m: {d for d in ds if not _inside(d, ("tests",))} for m, ds in REPOSITORY.items() if not _inside(m, ("tests",))
    }
    cycle = find_cycle(code)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_repository_checks_catch_a_crossing_and_a_circle(tmp_path):
    """A made-up tree: the package imports the lab (lazily), a script imports the lab, a lab tool imports a
    script and the suite, and two lab files import each other; the lab's tests may import scripts."""
    files = {
        "spider_titan/__init__.py": "",
        "spider_titan/core.py": "def f():\n    from lab.bench import gpu\n",
        "scripts/run.py": "import lab.bench.machine\n",
        "lab/__init__.py": "",
        "lab/bench/__init__.py": "",
        "lab/bench/gpu.py": "from lab.bench.machine import machine\nimport spider_titan\n",
        "lab/bench/machine.py": "from lab.bench import gpu\nfrom scripts import run\nimport tests.utils\n",
        "lab/tests/__init__.py": "",
        "lab/tests/test_x.py": "from scripts import run\nfrom tests.utils import REPO\n",
        "tests/__init__.py": "",
        "tests/utils.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = read_imports(*(tmp_path / top for top in ("spider_titan", "scripts", "lab", "tests")))
    assert crossings(graph) == [
        "lab.bench.machine (the lab) imports scripts.run: the lab imports the spider_titan package only",
        "lab.bench.machine (the lab) imports tests.utils: the lab imports the spider_titan package only",
        "scripts.run (the product) imports lab.bench.machine (the lab)",
        "spider_titan.core (the product) imports lab.bench.gpu (the lab)",
    ]
    assert find_cycle(graph) == ["lab.bench.gpu", "lab.bench.machine", "lab.bench.gpu"]
    graph["lab.bench.machine"] = set()  # both circles through it broken: none left
    assert find_cycle(graph) is None


@pytest.mark.parametrize(
    "graph,upward,cyclic",
    [
        ({"p.low": {"p.high"}, "p.high": set()}, True, False),
        ({"p.high": {"p.low"}, "p.low": set()}, False, False),
        ({"p.low": {"p.low2"}, "p.low2": {"p.low"}}, False, True),
        ({"p.high": {"p.low"}, "p.low": {"p.low2"}, "p.low2": {"p.high"}}, True, True),
    ],
)
def test_checks_catch_what_they_should(graph, upward, cyclic):
    layers = {"p.low": 1, "p.low2": 1, "p.high": 2}
    assert bool(upward_imports(graph, layers)) == upward
    assert (find_cycle(graph) is not None) == cyclic


def test_relative_and_lazy_imports_are_read(tmp_path):
    """Relative imports and imports inside functions are imports too."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("X = 1\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import low\n")
    (pkg / "sub" / "high.py").write_text("def f():\n    from pkg.sub import lazy\n    from ..low import X\n")
    (pkg / "sub" / "lazy.py").write_text("import pkg.low\n")
    graph = read_imports(pkg)
    assert graph["pkg.sub"] == {"pkg.low"}
    assert graph["pkg.sub.high"] == {"pkg.sub.lazy", "pkg.low"}
    assert graph["pkg.sub.lazy"] == {"pkg.low"}
