"""The tests that skip without CUDA, found by reading the test files (nothing is imported or run):

    python3 bench/gpu/gpu_tests.py [--exclude tests/gpu/test_gpu.py ...] [ROOT]

prints one pytest node id a line (``path`` for a whole file, ``path::test`` or ``path::Class::test``), for
bench/gpu/suite.sh's ``tests`` suite. A test counts when it, its class or its module (``pytestmark``) carries a
``pytest.mark.skipif`` whose condition is false only with CUDA: ``not torch.cuda.is_available()``,
``torch.cuda.device_count() < 2``, or a module-level name bound to one of those (``CUDA = torch.cuda.is_available()``
then ``skipif(not CUDA)``; ``gpu = pytest.mark.skipif(not ...)`` then ``@gpu``). ``skipif(torch.cuda.is_available())``
(a test of the no-GPU path) does not count. ROOT defaults to tests/.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def _mentions_cuda(node: ast.AST, cuda_names: set[str]) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and n.attr in ("is_available", "device_count"):
            if "cuda" in ast.unparse(n.value):
                return True
        if isinstance(n, ast.Name) and n.id in cuda_names:
            return True
    return False


def _skips_without_cuda(cond: ast.AST, cuda_names: set[str]) -> bool:
    """Whether a skipif condition holds when there is no CUDA (and names CUDA at all)."""
    if isinstance(cond, ast.UnaryOp) and isinstance(cond.op, ast.Not):
        return _mentions_cuda(cond.operand, cuda_names)
    if isinstance(cond, ast.BoolOp) and isinstance(cond.op, ast.Or):
        return any(_skips_without_cuda(v, cuda_names) for v in cond.values)
    if isinstance(cond, ast.Compare):  # torch.cuda.device_count() < 2
        return _mentions_cuda(cond, cuda_names) and "device_count" in ast.unparse(cond)
    return False


def _is_gpu_skip(node: ast.AST, cuda_names: set[str], markers: set[str]) -> bool:
    """A decorator or mark expression that skips without CUDA (lists are searched)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_gpu_skip(e, cuda_names, markers) for e in node.elts)
    if isinstance(node, ast.Name):
        return node.id in markers
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "skipif":
        return bool(node.args) and _skips_without_cuda(node.args[0], cuda_names)
    return False


def scan(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    cuda_names: set[str] = set()
    markers: set[str] = set()
    whole = False
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            if name == "pytestmark":
                whole = whole or _is_gpu_skip(stmt.value, cuda_names, markers)
            elif _is_gpu_skip(stmt.value, cuda_names, markers):
                markers.add(name)
            elif _mentions_cuda(stmt.value, cuda_names):
                cuda_names.add(name)  # CUDA = torch.cuda.is_available()
    if whole:
        return [str(path)]
    found = []

    def marked(defn) -> bool:
        return any(_is_gpu_skip(d, cuda_names, markers) for d in defn.decorator_list)

    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name.startswith("test"):
            if marked(stmt):
                found.append(f"{path}::{stmt.name}")
        elif isinstance(stmt, ast.ClassDef) and stmt.name.startswith("Test"):
            class_mark = marked(stmt) or any(
                isinstance(s, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in s.targets)
                and _is_gpu_skip(s.value, cuda_names, markers)
                for s in stmt.body
            )
            for s in stmt.body:
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name.startswith("test"):
                    if class_mark or marked(s):
                        found.append(f"{path}::{stmt.name}::{s.name}")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", default="tests")
    ap.add_argument("--exclude", action="append", default=[], help="a test file to leave out (repeatable)")
    a = ap.parse_args()
    skip = {Path(p).as_posix() for p in a.exclude}
    for path in sorted(Path(a.root).rglob("test_*.py")):
        if path.as_posix() in skip:
            continue
        for node in scan(path):
            print(node)
    return 0


if __name__ == "__main__":
    sys.exit(main())
