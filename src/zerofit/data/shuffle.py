"""Seeded permutations that are the same on every machine and every numpy version.

A permutation is the stable argsort of raw 64-bit draws of a PCG64 generator seeded through a ``SeedSequence``
of ``(seed, *stream)``: numpy guarantees both bit streams across versions, unlike ``Generator.permutation`` or
``torch.randperm``, whose algorithms may change. ``stream`` keeps independent uses apart (the held-out split,
the order documents are packed in, each epoch's order of windows) under one user seed.
"""

from __future__ import annotations

import numpy as np

SPLIT = 1  # stream: which documents are held out
ORDER = 2  # stream: the order training documents are packed in
EPOCH = 3  # stream: the order of windows in an epoch, (EPOCH, epoch)


def permutation(n: int, seed: int, *stream: int) -> np.ndarray:
    """A permutation of ``range(n)`` (``(n,)`` int64) fixed by ``seed`` and ``stream``."""
    if n < 0 or seed < 0 or any(s < 0 for s in stream):
        raise ValueError(f"permutation needs n >= 0 and non-negative seeds, found n={n} seed={seed} stream={stream}")
    bits = np.random.PCG64(np.random.SeedSequence([seed, *stream]))
    keys = bits.random_raw(n) if n else np.empty(0, dtype=np.uint64)  # (n,) uint64
    return np.argsort(keys, kind="stable").astype(np.int64)
