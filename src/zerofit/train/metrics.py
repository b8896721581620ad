"""A run's metrics: one JSON object per line in ``metrics.jsonl``, and TensorBoard scalars.

Every record has ``step`` and ``time`` (seconds since the run started, resumes included); training records
carry loss, learning rate, gradient norm, tokens/s and memory, evaluation records ``eval_loss`` and
``eval_perplexity``. The JSON-lines file is appended to (a resumed run continues it) and flushed per record,
so a crash loses nothing that was logged. A value that is not finite (a step whose micro-batches scored no token
has no loss) is written as ``null``: every line is valid JSON. A run that starts at step S (resumed from a
checkpoint of step S, or S = 0: from the model directory) first drops the records of later steps, which it trains
again, and a line a crash cut short: the file is then one run's history, each step once (rewritten atomically).
TensorBoard is told the same (``purge_step``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

log = logging.getLogger("zerofit")


class Metrics:
    """Append-only JSON lines plus optional TensorBoard event files."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, elapsed: float = 0.0, start_step: int = 0):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / "metrics.jsonl"
        _keep_until(self.path, start_step)
        self._f = open(self.path, "a", buffering=1)
        self._t0 = time.time() - elapsed
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # the tensorboard extra is optional: the JSON lines are always written
                log.warning("TensorBoard logging is off: %s", e)
            else:
                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)

    @property
    def elapsed(self) -> float:
        return time.time() - self._t0

    def log(self, step: int, **values) -> dict:
        rec = {"step": step, "time": round(self.elapsed, 3), **values}
        # JSON has no NaN or infinity: a non-finite value is written as null (json.dumps would write NaN)
        safe = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
        self._f.write(json.dumps(safe, allow_nan=False) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        return rec

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _keep_until(path: Path, step: int) -> None:
    """Rewrite ``path`` with only its whole records of steps up to ``step`` (none when ``step`` is 0)."""
    if not path.is_file():
        return
    lines = path.read_text(errors="replace").splitlines()
    kept = [line for line in lines if step > 0 and _step_of(line) is not None and _step_of(line) <= step]
    dropped = len(lines) - len(kept)
    if not dropped:
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    log.info("%s: dropped %d records of steps after %d (trained again) or cut short", path, dropped, step)


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
