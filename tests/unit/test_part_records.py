"""Each part's per-unit record (memory/store.py: ``Unit.streamed``, ``grads``, ``updates``, ``copy16``, ``shard``) is
changed only by its owner: a store into one of a record's fields, or a ``set()``/``clear()`` of one of its events,
appears only in the owner's modules or in the record's own methods. Read off the source's syntax, as
test_layers.py reads the imports, so a planted write elsewhere fails here before anything runs."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import torch

from zerofit.engine.memory import store

SRC = Path(__file__).resolve().parents[2] / "src" / "zerofit"

# Unit's attribute -> (its record class, the modules that own it, relative to src/zerofit)
OWNERS: dict[str, tuple[type, tuple[str, ...]]] = {
    "streamed": (store.Streamed, ("engine/memory/streamer.py",)),
    "grads": (store.GradState, ("engine/memory/grads.py",)),
    "updates": (store.Updates, ("engine/update/host.py", "engine/update/assisted.py", "engine/step/optimizer_step.py")),
    "copy16": (store.Copy16, ("engine/memory/copies16.py",)),
    "shard": (store.Shard, ("engine/distributed/sharding.py",)),
}
STORE = "engine/memory/store.py"


def _record_field(node: ast.AST) -> tuple[str, str] | None:
    """``x.<record>.<field>`` as (record, field) when it names a field of one of the records, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr in OWNERS:
        record = node.value.attr
        if node.attr in {f.name for f in dataclasses.fields(OWNERS[record][0])}:
            return record, node.attr
    return None


def _stored(target: ast.AST) -> list[ast.AST]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _stored(t)]
    return [target]


def writes(source: str) -> list[tuple[int, str, str, str | None]]:
    """Every change to a record's field in ``source``: (line, record, field, the class it is written in)."""
    out: list[tuple[int, str, str, str | None]] = []

    def visit(node: ast.AST, cls: str | None) -> None:
        if isinstance(node, ast.ClassDef):
            cls = node.name
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [n for t in node.targets for n in _stored(t)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("set", "clear")
            and node.func.value is not None
        ):
            targets = [node.func.value]
        for t in targets:
            hit = _record_field(t)
            if hit is not None:
                out.append((node.lineno, hit[0], hit[1], cls))
        for child in ast.iter_child_nodes(node):
            visit(child, cls)

    visit(ast.parse(source), None)
    return out


def strangers(root: Path) -> list[str]:
    """Each write to a record outside its owners and the record's own class, as ``file:line: record.field``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for line, record, name, cls in writes(path.read_text()):
            kind, owners = OWNERS[record]
            if rel in owners or (rel == STORE and cls == kind.__name__):
                continue
            found.append(f"{rel}:{line}: {record}.{name}")
    return found


def test_each_record_is_changed_only_by_its_owner():
    assert strangers(SRC) == []


def test_the_rule_sees_a_planted_write_in_every_form(tmp_path):
    (tmp_path / "engine" / "step").mkdir(parents=True)
    (tmp_path / "engine" / "memory").mkdir(parents=True)
    (tmp_path / "engine" / "step" / "compute.py").write_text(
        "def f(u, v):\n"
        "    u.grads.fresh = False\n"
        "    a, v.streamed.state = 1, None\n"
        "    u.updates.updated.clear()\n"
        "    u.shard.lo += 1\n"
        "    u.grads.mark = 1\n"  # not a field of the record: not counted
        "    self_grads = u.grads\n"
    )
    (tmp_path / "engine" / "memory" / "grads.py").write_text("def g(u):\n    u.grads.fresh = True\n")
    (tmp_path / "engine" / "memory" / "store.py").write_text(
        "class GradState:\n    def drop(self, u):\n        u.grads.tensor = None\n"
        "class Other:\n    def f(self, u):\n        u.grads.slot = None\n"
    )
    assert strangers(tmp_path) == [
        "engine/memory/store.py:6: grads.slot",
        "engine/step/compute.py:2: grads.fresh",
        "engine/step/compute.py:3: streamed.state",
        "engine/step/compute.py:4: updates.updated",
        "engine/step/compute.py:5: shard.lo",
    ]


def test_a_new_unit_has_its_records_fresh_and_drop_device_keeps_what_is_host():
    layout = store.FlatLayout.of([("w", torch.Size((2, 3)))])
    u = store.Unit("layers.0", 0, layout, store.Home.STREAMED, optimizer_on_device=False)
    assert u.streamed.state is store.WeightState.ON_HOST and u.streamed.slot is None
    assert u.grads.fresh and u.grads.host_fresh and u.grads.tensor is None
    assert u.updates.updated.is_set() and u.updates.moments_done.is_set() and u.updates.pending is None
    assert u.copy16.epoch == -1 and u.shard.lo == 0 and not u.shard.state
    other = store.Unit("layers.1", 1, layout, store.Home.STREAMED, optimizer_on_device=False)
    assert other.updates.updated is not u.updates.updated  # each unit its own events
