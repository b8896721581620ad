"""A run's metrics: one JSON object per line in ``metrics.jsonl``, and TensorBoard scalars.

Every record has ``step`` and ``time`` (seconds since the run started, resumes included); training records
carry loss, learning rate, gradient norm, tokens/s and memory, evaluation records ``eval_loss`` and
``eval_perplexity``. The JSON-lines file is appended to (a resumed run continues it) and flushed per record,
so a crash loses nothing that was logged. A value that is not finite (a step whose micro-batches scored no token
has no loss) is written as ``null``: every line is valid JSON.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

log = logging.getLogger("zerofit")


class Metrics:
    """Append-only JSON lines plus optional TensorBoard event files."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, elapsed: float = 0.0):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / "metrics.jsonl"
        self._f = open(self.path, "a", buffering=1)
        self._t0 = time.time() - elapsed
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:   # tensorboard is a dependency; a broken install should not stop training
                log.warning("TensorBoard logging is off: %s", e)
            else:
                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

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
