"""The process's random number generators as JSON: torch (CPU and every CUDA device), ``random``, numpy.

A resumed run draws the same dropout masks and shuffles as the uninterrupted one
only if every generator it uses continues from the same state. Tensor states
are stored base64 (a few KB); numpy is optional (recorded when importable).
"""

from __future__ import annotations

import base64
import logging
import random

import torch

log = logging.getLogger("zerofit")


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture() -> dict:
    """The state of every generator, JSON-serializable."""
    version, internal, gauss = random.getstate()
    out = {"torch": _b64(torch.get_rng_state()), "python": [version, list(internal), gauss],
           "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []}
    try:
        import numpy as np
    except ImportError:
        return out
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return out


def restore(state: dict) -> None:
    """Put every generator back where :func:`capture` found it. CUDA states are restored for the devices
    both runs have (a warning when the counts differ: dropout on the missing devices will not replay)."""
    torch.set_rng_state(_tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda") or []
    if torch.cuda.is_available() and cuda:
        n = torch.cuda.device_count()
        if n != len(cuda):
            log.warning("checkpoint has CUDA RNG states of %d devices, this process sees %d; restoring %d",
                        len(cuda), n, min(n, len(cuda)))
        for i, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(_tensor(s), i)
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
