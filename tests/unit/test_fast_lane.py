"""The fast lane (``make test-fast``: the tests under tests/ not marked ``slow``) touches every
package module.

Read with ``ast``, without running anything: each test file of the lane is a root, less the tests
marked ``slow`` (a module-level ``pytestmark``, or a decorator on the function or its class); from
there every import is followed (module level and inside functions, through the package, tests/
helpers and scripts/), and a string naming a package module counts too (``python -m
spider_titan.train`` in a subprocess, ``spider_titan.hf.tokenization_spider:SpiderByteTokenizer``
loaded by name). Every module under ``spider_titan/`` must be reached. Marking
slow the last fast test that reaches a module fails here; the fix is a fast test that touches it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.utils import REPO

PACKAGE = "spider_titan"
MARK = "not slow"  # the lane's marker expression, as the Makefile's test-fast target gives it


def module_files(root: Path = REPO) -> dict[str, Path]:
    """dotted name -> file, for the Python files of the repository (scripts/ as top-level modules,
    as the tests import them after putting scripts/ on sys.path)."""
    out: dict[str, Path] = {}
    # the top-level folders first, so hidden ones (a .venv of thousands of files) are never walked
    tops = [p for p in root.iterdir() if not p.name.startswith(".") and p.name != "outputs"]
    files = [p for top in tops for p in ([top] if top.is_file() else top.rglob("*.py")) if p.suffix == ".py"]
    for path in sorted(files):
        rel = path.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        if parts[0] == "scripts":
            parts = parts[1:]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            out.setdefault(".".join(parts), path)
    return out


def is_slow(decorators: list[ast.expr]) -> bool:
    """Whether one of these decorators (or a ``pytestmark`` value) is ``pytest.mark.slow``."""
    return any(
        isinstance(n, ast.Attribute)
        and n.attr == "slow"
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "mark"
        for d in decorators
        for n in ast.walk(d)
    )


def lane_nodes(tree: ast.Module) -> list[ast.AST] | None:
    """The parts of a test file the lane runs: None when the whole file is slow (``pytestmark``),
    else the module with its slow test functions and classes left out."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            if is_slow([node.value]):
                return None
    return [
        node
        for node in tree.body
        if not (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and is_slow(node.decorator_list)
        )
    ]


def references(nodes: list[ast.AST], name: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The repository modules these nodes of module ``name`` import or name in a string."""
    out: set[str] = set()

    def add(dotted: str) -> None:
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c imports a and a.b first
            if ".".join(parts[:i]) in modules:
                out.add(".".join(parts[:i]))

    for root in nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                add(base)
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        add(f"{base}.{alias.name}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                # "spider_titan.x", "spider_titan.x:name" (loaded by importlib), "python -m spider_titan.x"
                words = re.findall(rf"-m\s+({PACKAGE}(?:\.\w+)+)", node.value)
                words += [f"{w}.__main__" for w in words]  # python -m a package runs its __main__
                words.append(node.value.partition(":")[0])
                for word in words:
                    if word in modules:
                        add(word)
    return out


def reached(test_files: list[Path], modules: dict[str, Path]) -> set[str]:
    """Every repository module the lane's parts of ``test_files`` import, directly or not."""
    names = {path: name for name, path in modules.items()}
    seen: set[str] = set()
    todo: list[str] = []
    for path in test_files:
        nodes = lane_nodes(ast.parse(path.read_text(), str(path)))
        if nodes is not None:
            name = names[path]
            seen.add(name)
            todo += references(nodes, name, path.name == "__init__.py", modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = modules[name]
        tree = ast.parse(path.read_text(), str(path))
        todo += references([tree], name, path.name == "__init__.py", modules)
    return seen


def lane_recipe() -> str:
    """The Makefile's test-fast recipe."""
    recipe = re.search(r"^test-fast:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe, "Makefile: no test-fast target"
    return recipe.group(1)


def lane_test_files() -> list[Path]:
    """The files pytest loads for the lane: ``test_*.py`` and ``conftest.py`` under the folders the
    recipe names after its marker expression (the product's tests; lab/tests runs in the full suite)."""
    paths = re.search(rf'-m "{MARK}" ((?:[\w/.-]+ )*[\w/.-]+)', lane_recipe())
    assert paths, f'Makefile: test-fast does not run -m "{MARK}" on named folders'
    roots = [REPO / p for p in paths.group(1).split()]
    assert all(root.is_dir() for root in roots), roots
    return sorted(p for root in roots for g in ("test_*.py", "conftest.py") for p in root.rglob(g))


def test_the_fast_lane_touches_every_package_module():
    modules = module_files()
    package = sorted(m for m in modules if m == PACKAGE or m.startswith(PACKAGE + "."))
    assert len(package) > 50, package  # the package was found
    lane = reached(lane_test_files(), modules)  # once: the walk parses every file the lane reaches
    missed = [m for m in package if m not in lane]
    assert missed == [], (
        f"no test of the fast lane (-m '{MARK}') imports {missed}: add a fast test that touches each, "
        "or leave a test that does unmarked"
    )


def test_the_makefile_runs_the_lane_this_check_reads():
    assert f'-m "{MARK}"' in lane_recipe()
    assert lane_test_files()  # and names the folders it runs


def write(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return module_files(tmp_path)


PKG = {
    "spider_titan/__init__.py": "",
    "spider_titan/a.py": "from . import b\n",
    "spider_titan/b.py": "",
    "spider_titan/c.py": "def f():\n    from spider_titan.d import x\n",
    "spider_titan/d.py": "",
    "tests/helper.py": "import spider_titan.a\n",
}


@pytest.mark.parametrize(
    "test_text, want",
    [
        # through a helper, a relative import, and a lazy import inside a function
        ("from tests import helper\ndef test_x():\n    import spider_titan.c\n", {"a", "b", "c", "d"}),
        (
            "import pytest\n@pytest.mark.slow\ndef test_x():\n    import spider_titan.c\n",
            set(),
        ),  # slow: not in the lane
        ("import pytest\npytestmark = pytest.mark.slow\nimport spider_titan.a\n", set()),  # a slow file
        ("import pytest\npytestmark = [pytest.mark.slow]\nimport spider_titan.a\n", set()),
        ("import pytest\n@pytest.mark.slow\nclass TestX:\n    import spider_titan.a\n", set()),
        ("CMD = ['-m', 'spider_titan.d']\n", {"d"}),  # a subprocess running a package module
        ("CMD = 'python -m spider_titan.d --x'\n", {"d"}),
        ("LOADER = 'spider_titan.d:Tokenizer'\n", {"d"}),
        ('"""Docs of spider_titan.d."""\n', set()),  # a docstring naming a module imports nothing
        ("from spider_titan import d\n", {"d"}),
    ],
    ids=[
        "imports",
        "slow-test",
        "slow-file",
        "slow-file-list",
        "slow-class",
        "string",
        "shell",
        "entry-point",
        "docstring",
        "from-package",
    ],
)
def test_the_check_follows_imports_and_leaves_slow_tests_out(tmp_path, test_text, want):
    modules = write(tmp_path, {**PKG, "tests/test_x.py": test_text})
    got = {
        m.split(".", 1)[1] for m in reached([tmp_path / "tests/test_x.py"], modules) if m.startswith("spider_titan.")
    }
    assert got == want
