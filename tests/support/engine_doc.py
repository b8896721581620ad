"""docs/engine.md's table of the engine's modules, read and refreshed from the code: each row's paths (under
``src/zerofit/engine/`` unless a row names another folder first) and their line counts (``wc -l``).

    python3 -m tests.support.engine_doc          # rewrites the table's lines column with today's counts

tests/unit/test_engine_doc.py keeps the table true: every module of the engine named in a row, each count
within a tenth (or 10 lines) of the file's."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "engine.md"
ENGINE = ROOT / "src" / "zerofit" / "engine"
HEADER = "| module | lines |"


def _paths(cell: str) -> list[Path]:
    """The files a row's first cell names, in order: ``a.py`` and ``room/a.py`` under the engine, unless a
    ``zerofit/pkg`` folder comes first (its bare names are under it)."""
    base = ENGINE
    out = []
    for token in re.findall(r"`([^`]+)`", cell):
        if token.startswith("zerofit/") and not token.endswith(".py"):
            base = ROOT / "src" / token
            continue
        if token.endswith(".py"):
            out.append(ROOT / "src" / token if token.startswith("zerofit/") else base / token)
    return out


def rows(text: str) -> list[tuple[int, list[Path], list[int]]]:
    """(line index, paths, their figures) of every row of the table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(HEADER))
    out = []
    for i in range(start + 2, len(lines)):
        if not lines[i].startswith("|"):
            break
        cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
        figures = [int(x) for x in re.findall(r"\d+", cells[1])]
        out.append((i, _paths(cells[0]), figures))
    return out


def count(path: Path) -> int:
    return len(path.read_text().splitlines())


def refresh(text: str) -> str:
    """``text`` with each row's lines column set to its files' counts."""
    lines = text.splitlines()
    for i, paths, _ in rows(text):
        cells = lines[i].split("|")
        cells[2] = " " + " + ".join(str(count(p)) for p in paths) + " "
        lines[i] = "|".join(cells)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    DOC.write_text(refresh(DOC.read_text()))
    print(f"{DOC}: the lines column refreshed")
