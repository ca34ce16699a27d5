"""Imports run one way: the layering written in docs/architecture.md, held against the code.

The ```layers block of that page lists, lowest first, the module prefixes of each layer. Every
``spider_titan`` import in the package (read with ``ast``, so lazy imports inside functions count
too) must point to a module of the same or a lower layer, and the module import graph has no
cycle. The negative controls feed the same checks a made-up graph that breaks each rule.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.utils import REPO

PACKAGE = REPO / "spider_titan"
DOC = REPO / "docs" / "architecture.md"


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


def read_imports(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the modules of package ``root`` it imports (``from a import b`` counts as ``a.b``
    when ``a.b`` is a module, else as ``a``)."""
    top = root.name
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith(top))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if not base.startswith(top):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t != name}
    return graph


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
