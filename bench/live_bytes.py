"""Moved to bench/probes/live_bytes.py. This file stays only because tests/test_small_gpu_floor.py loads
``bench/live_bytes.py`` by its path (tests/tiny_models.py ``bench_module("live_bytes")``); it re-exports the
probe's names and runs it as a script. Remove it when the tests load ``bench/probes/live_bytes.py``."""
import importlib.util
import runpy
from pathlib import Path

_PATH = Path(__file__).resolve().parent / "probes" / "live_bytes.py"

if __name__ == "__main__":
    runpy.run_path(str(_PATH), run_name="__main__")
else:
    _spec = importlib.util.spec_from_file_location("bench_probes_live_bytes", _PATH)
    _probe = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_probe)
    LiveBytes, loss_bytes = _probe.LiveBytes, _probe.loss_bytes
