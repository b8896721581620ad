"""docs/engine.md's table of the engine's modules is the code's: every module named, each line count near the file's
(``python3 -m tests.support.engine_doc`` refreshes them)."""

from __future__ import annotations

from tests.support import engine_doc


def test_every_engine_module_has_a_row_and_every_row_names_files_that_exist():
    named = {p for _, paths, _ in engine_doc.rows(engine_doc.DOC.read_text()) for p in paths}
    missing = sorted(
        str(p.relative_to(engine_doc.ENGINE))
        for p in engine_doc.ENGINE.rglob("*.py")
        if p.name != "__init__.py" and p not in named
    )
    assert not missing, f"engine modules with no row in docs/engine.md's module table: {missing}"
    gone = sorted(str(p) for p in named if not p.is_file())
    assert not gone, f"rows of docs/engine.md naming files that do not exist: {gone}"


def test_each_rows_line_counts_are_its_files():
    wrong = []
    for i, paths, figures in engine_doc.rows(engine_doc.DOC.read_text()):
        actual = [engine_doc.count(p) for p in paths]
        if len(figures) != len(actual) or any(abs(f - a) > max(10, a // 10) for f, a in zip(figures, actual)):
            wrong.append(f"line {i + 1}: {figures} for {[p.name for p in paths]}, which have {actual}")
    how = "docs/engine.md's line counts (python3 -m tests.support.engine_doc refreshes them):\n"
    assert not wrong, how + "\n".join(wrong)


def test_refresh_writes_the_counts_the_test_reads(tmp_path):
    text = engine_doc.DOC.read_text()
    fresh = engine_doc.refresh(text)
    for _, paths, figures in engine_doc.rows(fresh):
        assert figures == [engine_doc.count(p) for p in paths]
    assert engine_doc.refresh(fresh) == fresh
