"""bench/results_index.py and bench/results/'s compact files: every record parses under a name of its own, the index
is current, and ``--add`` folds a new run into its workload's file with its figures and without its trace."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


def bench_module(name: str):
    """bench/<name>.py loaded from its file (no torch import: tests.support.tiny_models has the same, with torch)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}_under_test", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ri():
    return bench_module("results_index")


def _has_trace(obj) -> bool:
    if isinstance(obj, dict):
        return "trace" in obj or any(_has_trace(v) for v in obj.values())
    return isinstance(obj, list) and any(_has_trace(v) for v in obj)


def _group_files(ri) -> list[Path]:
    return [p for p in sorted(RESULTS.iterdir()) if ri.is_group_file(p)]


def test_every_record_parses_and_names_are_unique(ri):
    files = _group_files(ri)
    assert files, "no compact file in bench/results/"
    names = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            rec = json.loads(line)  # every line a JSON object
            assert isinstance(rec, dict) and rec.get("file"), f"{path.name}:{n}"
            assert rec["group"] == path.stem == ri.name_parts(rec["file"].rstrip("/"))["group"], f"{path.name}:{n}"
            assert not _has_trace(rec), f"{path.name}:{n}: a trace's intervals kept"
            names.append(rec["file"].rstrip("/"))
    assert len(names) == len(set(names))
    assert ri.loose_files() == []  # every result folded in


def test_index_is_current(ri):
    assert ri.main(["--check"]) == 0


def _run(tps: float) -> dict:
    trace = [
        {"lane": "compute", "label": "model.layers.0", "start": 0.0, "end": 0.5},
        {"lane": "compute", "label": "post", "start": 0.6, "end": 0.7},
        {"lane": "compute", "label": "model.layers.0", "start": 0.7, "end": 1.2},
        {"lane": "cpu", "label": "adam(0)", "start": 1.2, "end": 1.5},
    ]
    engine = {
        "engine": "zerofit",
        "status": "ok",
        "tokens_per_s": tps,
        "s_per_step": 1.5,
        "step_s": [2.0, 1.5, 1.5],
        "losses": [10.4, 10.1, 9.9],
        "peak_gpu_gib": 21.3,
        "peak_rss_gib": 40.2,
        "timeline": {"compute": 1.1, "step": 1.5},
        "extra": {"plan": "plan: 2 resident blocks", "estimate": {"s_per_step": 1.4}, "trace": trace},
    }
    meta = {
        "workload": "W1",
        "date": "2031-01-02 03:04 UTC",
        "commit": "abcdef1",
        "machine": {"gpu": "test", "cpu_count": 2, "ram_gib": 8},
        "command": "python3 bench/run.py --workload W1",
        "cap": "24GiB",
        "plain_cap": "none",
        "steps": 3,
        "fsdp2_steps": 2,
        "engines": ["zerofit"],
    }
    return {"meta": meta, "results": [engine]}


def test_add_folds_one_run_into_its_workload_file(ri, tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    for p in _group_files(ri):
        shutil.copy(p, res / p.name)
    before = (res / "W1.jsonl").read_text().splitlines()
    new = tmp_path / "results_W1.json"
    new.write_text(json.dumps(_run(12345.6)))
    name = "2031-01-02_W1_abcdef1_synthetic.json"
    folder = (ri.RESULTS, ri.INDEX)  # main(["--results", ...]) points the module at the copy
    try:
        assert ri.main(["--results", str(res), "--add", str(new), "--name", name]) == 0
        after = (res / "W1.jsonl").read_text().splitlines()
        assert len(after) == len(before) + 1
        (rec,) = [json.loads(line) for line in after if json.loads(line)["file"] == name]
        assert rec["kind"] == "bench/run.py" and rec["commit"] == "abcdef1" and rec["date"] == "2031-01-02 03:04"
        (zf,) = rec["results"]
        assert zf["tokens_per_s"] == 12345.6 and zf["step_s"] == [2.0, 1.5, 1.5] and zf["peak_gpu_gib"] == 21.3
        assert zf["extra"]["estimate"] == {"s_per_step": 1.4} and zf["extra"]["plan"].startswith("plan:")
        assert "trace" not in zf["extra"] and zf["extra"]["trace_intervals"] == 4
        assert zf["extra"]["trace_summary"].startswith("phases: forward")
        assert name in (res / "README.md").read_text()  # the index rewritten with it
        assert ri.find(f"{res / 'W1.jsonl'}#{name}") == [rec]
        with pytest.raises(SystemExit):  # a name is kept once
            ri.main(["--results", str(res), "--add", str(new), "--name", name])
        assert bench_module("run").render(rec).startswith("## W1: 2031-01-02 03:04 UTC")
    finally:
        ri.RESULTS, ri.INDEX = folder
