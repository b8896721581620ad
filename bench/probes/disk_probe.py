"""The disk tier's speed tests against each other on one folder, repeated: how much each moves between runs
minutes apart, and which one the steps' sustained rate follows (the disk's speed: docs/benchmarks.md).

    python3 bench/probes/disk_probe.py /tmp/nv [rounds]

Per round: SwapFile.measure over 1 GiB (write, then read: what `zerofit estimate` used), and measure_mixed over
2 GiB and 8 GiB (reads and writes at once, as a step streams them)."""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # the working tree's zerofit
from zerofit.engine.disk.tier import SwapFile  # noqa: E402

folder = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
GiB = 1 << 30
rows = []
for r in range(rounds):
    for name, nbytes in (("write-then-read 1 GiB", GiB), ("mixed 2 GiB", 2 * GiB), ("mixed 8 GiB", 8 * GiB)):
        f = SwapFile(folder, nbytes)
        try:
            t = time.time()
            if name.startswith("mixed"):
                out = {"mixed_gb_per_s": round(f.measure_mixed(nbytes), 3)}
            else:
                w, rd = f.measure(nbytes)
                out = {
                    "write_gb_per_s": round(w, 3),
                    "read_gb_per_s": round(rd, 3),
                    "sequential_sum_gb_per_s": round(2 / (1 / w + 1 / rd), 3),
                }
        finally:
            f.close()
        rows.append({"round": r, "test": name, "seconds": round(time.time() - t, 1)} | out)
        print(json.dumps(rows[-1]), flush=True)
