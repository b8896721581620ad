"""How fast each way of a clipped CPU AdamW step runs on this host, alone and while pinned copies run both ways
(as in a training step): torch's fused kernel (master, moments and the unscaled gradient written) against the
two passes of [Note: moments after the forward] (split_adamw.py), and those of [Note: the master behind its
cast]. Prints G params/s of each.

    python3 bench/probes/split_probe.py [--params 268435456]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # the working tree's zerofit

from zerofit.cli.doctor import BackgroundCopies  # noqa: E402
from zerofit.engine.update.adamw import adamw_flat  # noqa: E402
from zerofit.engine.update.split_adamw import available, master_pass, rest_pass  # noqa: E402
from zerofit.optim.hyper import Hyper  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=256 << 20)
    ap.add_argument(
        "--rounding",
        action="store_true",
        help="instead: which ways of rounding ([Note: the fused kernel's rounding]) match torch's fused "
        "kernel on sizes 960-1100 (the tail's width taken as 8, 16 and 32)",
    )
    args = ap.parse_args()
    if args.rounding:
        return rounding()
    n = args.params
    t = time.perf_counter()
    assert available(), "the split kernel did not build"
    print(f"split kernel built/loaded in {time.perf_counter() - t:.1f} s")
    torch.manual_seed(0)
    p, g, m, v = torch.randn(n), torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01
    h, factor = Hyper(1e-4, 0.9, 0.999, 1e-8, 0.01), 0.127
    w16 = torch.empty(n, dtype=torch.bfloat16)

    def rate(fn, reps=5):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return n / sorted(ts)[reps // 2] / 1e9

    rows = []
    for busy in [False] + ([True] if torch.cuda.is_available() else []):
        ctx = BackgroundCopies() if busy else None
        if ctx:
            ctx.__enter__()
        try:
            rows.append((busy, "fused step", rate(lambda: adamw_flat(p, g, m, v, torch.tensor(4.0), h, factor))))
            rows.append((busy, "master pass", rate(lambda: master_pass(p, g, m, v, torch.tensor(4.0), h, factor))))
            rows.append((busy, "moments pass", rate(lambda: rest_pass(p, g, m, v, torch.tensor(4.0), h, factor))))
            # [Note: the master behind its cast]: the first pass writes the bf16 cast only, the rest pass the master
            rows.append(
                (busy, "cast pass", rate(lambda: master_pass(p, g, m, v, torch.tensor(4.0), h, factor, out16=w16)))
            )
            rows.append(
                (busy, "rest pass", rate(lambda: rest_pass(p, g, m, v, torch.tensor(4.0), h, factor, with_master=True)))
            )
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
    print(
        f"{n / 1e6:.0f} M params, {torch.get_num_threads()} threads, capability "
        f"{torch.backends.cpu.get_cpu_capability()}"
    )
    for busy, what, r in rows:
        print(f"{'copies running' if busy else 'alone':15s} {what:14s} {r:6.2f} G params/s")


def rounding() -> None:
    """For each size, the (body, tail) modes whose passes equal the fused kernel bitwise, per assumed width."""
    import zerofit.engine.update.split_adamw as sa
    from zerofit.optim.hyper import Hyper

    module = sa._load()
    print(
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, chosen modes "
        f"{sa._modes}, tail width {sa._tail_width}"
    )
    gen = torch.Generator().manual_seed(7)
    for n in list(range(960, 1100, 7)) + [1000, 4096 + 8, 100_001]:
        p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
        want = [t.clone() for t in (p, g, m, v)] + [torch.tensor(4.0)]
        h = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0)
        adamw_flat(*want, h, 1.0)
        case = [((p, g, m, v), h, 1.0, want)]
        found = {
            width: [(b, t) for b in range(6) for t in range(6) if sa._matches(module, case, b, t, width)]
            for width in (8, 16, 32)
        }
        print(n, {w: o[:6] for w, o in found.items()})


if __name__ == "__main__":
    main()
