"""The house's layering, read off the source (CONTRIBUTING.md, "Layers"): no import circle runs in ``src/zerofit``, a
lower floor imports nothing from a higher one, and no private name crosses a module. The rules are checked on the
files' syntax (no import of zerofit, no dependency beyond the standard library), so a planted circle fails here
before anything runs.

An edge of the import graph is an import the module runs when it is imported: at module level, outside ``if
TYPE_CHECKING:``. ``import a.b.c`` and ``from a.b.c import x`` run ``a.b.c`` (and the packages ``a`` and ``a.b``,
unless they are the importer's own: Python has initialized those before the importer runs); ``from a.b import
name`` runs the package ``a.b`` itself, even from inside it (a module importing its own package's ``__init__``
counts), and ``a.b.name`` too where that is a module. The floors' rule reads every import, function-level ones
included: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# low to high; a module may import from its own floor and below. Packages not named here are the top floor.
FLOORS: list[tuple[str, ...]] = [
    ("zerofit.version", "zerofit.errors"),
    ("zerofit.config",),
    ("zerofit.models",),
    ("zerofit.optim", "zerofit.lora"),
]


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(tree: ast.Module, lazy: bool) -> list[ast.Import | ast.ImportFrom]:
    """The module's import statements: at module level (and in if/try/with blocks there), outside ``if
    TYPE_CHECKING:``; with ``lazy`` those inside functions and classes too."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                walk(node.orelse)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, (ast.If, ast.With, ast.For, ast.While)):
                walk(node.body)
                walk(getattr(node, "orelse", []))
            elif isinstance(node, ast.Try):
                walk(node.body)
                for h in node.handlers:
                    walk(h.body)
                walk(node.orelse)
                walk(node.finalbody)
            elif lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(node.body)

    walk(tree.body)
    return found


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, mods: dict) -> list[str]:
    """The modules of ``mods`` that ``node`` runs (see the module docstring)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        explicit = list(names)
    else:
        if node.level:
            base = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            name = f"{base}.{node.module}" if node.module else base
        else:
            name = node.module or ""
        names = [name] + [f"{name}.{a.name}" for a in node.names]
        explicit = [name]  # `from P import x` runs P itself
    own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    if is_package:
        own.add(module)
    out = set()
    for full in names:
        parts = full.split(".")
        for i in range(1, len(parts) + 1):
            q = ".".join(parts[:i])
            if q in mods and q != module and (q not in own or (q == full and full in explicit)):
                out.add(q)
    return sorted(out)


def import_graph(root: Path, lazy: bool = False) -> dict[str, set[str]]:
    """Module -> the zerofit modules its imports run (``lazy``: function-level imports too)."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {}
    for m, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        deps: set[str] = set()
        for node in _imports(tree, lazy):
            deps.update(_targets(m, path.name == "__init__.py", node, mods))
        graph[m] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def floor_of(module: str) -> int:
    for i, names in enumerate(FLOORS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return len(FLOORS)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_no_import_circle_runs_in_the_package():
    found = circles(import_graph(SRC))
    assert not found, "import circles (module-level imports, outside TYPE_CHECKING):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_a_lower_floor_imports_nothing_from_a_higher_one():
    graph = import_graph(SRC, lazy=True)
    wrong = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if floor_of(d) > floor_of(m) and d != "zerofit"  # the package itself: its __init__ imports lazily
    )
    assert not wrong, "imports from a higher floor (CONTRIBUTING.md, Layers):\n" + "\n".join(wrong)


def private_imports(root: Path) -> list[str]:
    """``module: from other import _name`` for every private name a module takes from another one."""
    wrong = []
    for m, path in _modules(root).items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree, lazy=True):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerofit"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        wrong.append(f"{m}: from {node.module} import {a.name}")
    return sorted(wrong)


def test_no_private_name_crosses_a_module():
    wrong = private_imports(SRC)
    assert not wrong, "private names imported from another module:\n" + "\n".join(wrong)


def test_the_rules_see_a_planted_circle_a_package_init_and_a_floor_crossed(tmp_path):
    _write(
        tmp_path,
        {
            "zerofit/__init__.py": "",
            "zerofit/a/__init__.py": "from zerofit.a.one import f\n",
            "zerofit/a/one.py": "from zerofit.a import two\n\ndef f():\n    return two\n",  # its own package's init
            "zerofit/a/two.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zerofit.a import one\n",
            "zerofit/b.py": "import zerofit.c\n",
            "zerofit/c.py": "from zerofit.b import x\n",
            "zerofit/config/__init__.py": "def g():\n    from zerofit.b import y\n",
            "zerofit/d.py": "from zerofit.b import _private\n",
        },
    )
    graph = import_graph(tmp_path)
    assert circles(graph) == [["zerofit.a", "zerofit.a.one"], ["zerofit.b", "zerofit.c"]]
    assert "zerofit.a.one" not in graph["zerofit.a.two"]  # a TYPE_CHECKING import runs nothing
    assert (
        "zerofit.b" not in graph["zerofit.config"]
        and "zerofit.b" in import_graph(tmp_path, lazy=True)["zerofit.config"]
    )
    assert floor_of("zerofit.config") < floor_of("zerofit.b")
    assert private_imports(tmp_path) == ["zerofit.d: from zerofit.b import _private"]


@pytest.mark.parametrize(
    "module,floor", [("zerofit.version", 0), ("zerofit.config.schema", 1), ("zerofit.lora.model", 3)]
)
def test_the_floors_of_the_lower_packages(module, floor):
    assert floor_of(module) == floor


def error_classes(root: Path) -> dict[str, list[str]]:
    """Every class of the package: its name -> its bases' names (the last part of a dotted base)."""
    out: dict[str, list[str]] = {}
    for _m, path in _modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                out[node.name] = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
    return out


def not_zerofit_errors(root: Path) -> list[str]:
    """Public exception classes that do not derive from ``ZerofitError``: a class is an exception when a base is
    one of Python's (``ValueError``...) or another exception class of the package."""
    classes = error_classes(root)
    builtin = {n for n in dir(__import__("builtins")) if n.endswith(("Error", "Exception")) or n == "Warning"}

    def kind(name: str, seen: frozenset = frozenset()) -> tuple[bool, bool]:
        """(is an exception, derives from ZerofitError)"""
        if name == "ZerofitError":
            return True, True
        if name in builtin:
            return True, False
        if name not in classes or name in seen:
            return False, False
        found = [kind(b, seen | {name}) for b in classes[name]]
        return any(e for e, _ in found), any(z for _, z in found)

    return sorted(n for n in classes if not n.startswith("_") and kind(n) == (True, False))


def test_every_public_error_class_is_a_zerofit_error():
    """One base under every error zerofit raises on purpose (zerofit/errors.py): its exit status and its one
    line are its own, so the command needs no list of classes (cli/errors.py)."""
    wrong = not_zerofit_errors(SRC)
    assert not wrong, "error classes outside ZerofitError:\n" + "\n".join(wrong)


def test_the_error_rule_sees_a_class_outside_the_base(tmp_path):
    _write(
        tmp_path,
        {
            "zerofit/__init__.py": "",
            "zerofit/errors.py": "class ZerofitError(Exception):\n    pass\n",
            "zerofit/a.py": "import zerofit.errors as e\nclass Fine(e.ZerofitError, ValueError):\n    pass\n"
            "class Stray(ValueError):\n    pass\nclass _Signal(Exception):\n    pass\nclass Plain:\n    pass\n"
            "class Sub(Stray):\n    pass\n",
        },
    )
    assert not_zerofit_errors(tmp_path) == ["Stray", "Sub"]
