"""How fast each way of a clipped CPU AdamW step runs on this host, alone and while pinned copies run both ways
(as in a training step): torch's fused kernel (master, moments and the unscaled gradient written), and the two
passes of [Note: moments after the forward] (split_adamw.py) done with torch's fused kernel on cache-sized chunks
whose moments and gradient are scratch copies. Prints G params/s of each.

    python3 bench/split_probe.py [--params 268435456]
"""

from __future__ import annotations

import argparse
import time

import torch

from zerofit.engine.split_adamw import fused_step, master_pass, moments_pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=256 << 20)
    ap.add_argument("--chunks", default="262144,1048576,4194304")
    a = ap.parse_args()
    n = a.params
    torch.manual_seed(0)
    p, g, m, v = torch.randn(n), torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01
    h = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    factor = 0.127

    def rate(fn, reps=4):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        ts.sort()
        return n / ts[len(ts) // 2] / 1e9

    rows = []
    copying = [False] + ([True] if torch.cuda.is_available() else [])
    for busy in copying:
        ctx = __import__("zerofit.doctor", fromlist=["x"])._BackgroundCopies() if busy else None
        if ctx:
            ctx.__enter__()
        try:
            rows.append((busy, "fused", rate(lambda: fused_step(p, g, m, v, torch.tensor(4.0), h, factor))))
            for c in (int(x) for x in a.chunks.split(",")):
                rows.append((busy, f"master pass, chunks of {c}", rate(lambda: master_pass(p, g, m, v, torch.tensor(4.0), h, factor, chunk=c))))
                rows.append((busy, f"moments pass, chunks of {c}", rate(lambda: moments_pass(g, m, v, torch.tensor(4.0), h, factor, chunk=c))))
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
    print(f"{n / 1e6:.0f} M params, {torch.get_num_threads()} threads, capability {torch.backends.cpu.get_cpu_capability()}")
    for busy, what, r in rows:
        print(f"{'copies running' if busy else 'alone':15s} {what:32s} {r:6.2f} G params/s")


if __name__ == "__main__":
    main()
