"""python bench/probes/pin_speed.py [--gib 8]

Seconds to page-lock a fresh host allocation of ``--gib`` GiB, as the engine's host arenas are made
(engine/memory/store.py HostArena, engine/device.py pin), each way in a fresh allocation:

- ``register``: ``torch.empty`` then ``cudaHostRegister``: the driver faults in and locks every page, one thread;
- ``touch_register``: the pages first written (``zero_``, over torch's threads), then registered;
- ``huge_touch_register``: as ``touch_register`` with ``madvise(MADV_HUGEPAGE)`` on the range first;
- ``host_alloc``: ``torch.empty(pin_memory=True)`` (the caching host allocator's ``cudaHostAlloc``, its size
  rounded up to a power of two).

Prints one JSON line per way and the machine's transparent huge page setting.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import torch

MADV_HUGEPAGE = 14


def _register(t: torch.Tensor) -> None:
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0))
    if rc:
        raise RuntimeError(f"cudaHostRegister failed: {rc}")


def _huge(t: torch.Tensor) -> None:
    page = 2 << 20
    start = (t.data_ptr() + page - 1) // page * page
    end = (t.data_ptr() + t.numel()) // page * page
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, end - start, MADV_HUGEPAGE):
        raise OSError(ctypes.get_errno(), "madvise")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=8)
    args = p.parse_args()
    n = int(args.gib * 2**30)
    torch.cuda.init()
    torch.empty(1, device="cuda")
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        thp = None
    print(json.dumps({"thp": thp, "threads": torch.get_num_threads(), "gib": args.gib}), flush=True)
    for way in ("register", "touch_register", "huge_touch_register", "host_alloc"):
        t0 = time.perf_counter()
        if way == "host_alloc":
            t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            touch = 0.0
        else:
            t = torch.empty(n, dtype=torch.uint8)
            if way == "huge_touch_register":
                _huge(t)
            if way != "register":
                t.zero_()
            touch = time.perf_counter() - t0
            _register(t)
        s = time.perf_counter() - t0
        print(
            json.dumps(
                {
                    "way": way,
                    "seconds": round(s, 3),
                    "touch_seconds": round(touch, 3),
                    "gb_per_s": round(n / s / 1e9, 2),
                }
            ),
            flush=True,
        )
        if way != "host_alloc":
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        del t
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
