"""The process's random number generators as JSON: torch (CPU and every CUDA device), ``random``, numpy.

A resumed run draws the same dropout masks and shuffles as the uninterrupted one
only if every generator it uses continues from the same state. States are stored
base64 (about 13 KB in all); numpy is optional (recorded when importable).
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


def _pack(words) -> str:
    """Mersenne-Twister words (uint32) as base64, little-endian."""
    return base64.b64encode(b"".join(int(w).to_bytes(4, "little") for w in words)).decode()


def _unpack(s: str) -> list[int]:
    raw = base64.b64decode(s)
    return [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]


def capture(cuda_device: torch.device | None = None) -> dict:
    """The state of every generator, JSON-serializable. On CUDA only ``cuda_device``'s generator (the
    engine's): asking for all devices would create a context on every GPU of the machine."""
    version, internal, gauss = random.getstate()
    out = {
        "torch": _b64(torch.get_rng_state()),
        "python": [version, _pack(internal), gauss],
        "cuda": _b64(torch.cuda.get_rng_state(cuda_device)) if cuda_device is not None else None,
    }
    try:
        import numpy as np
    except ImportError:
        return out
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = [kind, _pack(keys), int(pos), int(has_gauss), float(cached)]
    return out


def restore(state: dict, cuda_device: torch.device | None = None) -> None:
    """Put every generator back where :func:`capture` found it; the saved CUDA state goes into
    ``cuda_device``'s generator (whichever GPU index the run now uses). A run saved on the CPU and
    resumed on a GPU keeps the GPU generator as it is (the CPU run drew nothing from one)."""
    torch.set_rng_state(_tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(_unpack(internal)), gauss))
    if cuda_device is not None and state.get("cuda"):
        torch.cuda.set_rng_state(_tensor(state["cuda"]), cuda_device)
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            log.warning("the checkpoint holds numpy's RNG state but numpy is not importable: not restored")
            return
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(_unpack(keys), dtype=np.uint32), pos, has_gauss, cached))
