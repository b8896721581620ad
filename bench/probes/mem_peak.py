"""Where a zerofit step's GPU memory peaks: the allocations alive at the step's peak, grouped by the engine's
code that made them (torch.cuda.memory's allocation history over one step after a warm-up).

    python3 bench/probes/mem_peak.py W1 8GiB [steps]

Prints memory allocated before the step, the step's peak, and the bytes alive at the peak that the step
allocated, by the first zerofit frame (file:line function), and the phase (engine method) of the allocation that
made the peak. The autograd engine's allocations carry no Python frames: they are listed by their size."""

import collections
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_REPO / "bench"))  # bench/common.py
sys.path.insert(0, str(_REPO / "src"))  # the working tree's zerofit

PHASES = (
    "forward",
    "post_chunked",
    "post_backward",
    "post",
    "_recompute_inputs",
    "_block_backward",
    "backward_blocks",
    "apply",
    "in_backward",
)


def _site(frames):
    for f in frames:
        if "zerofit" in f["filename"]:
            return f"{f['filename'].split('zerofit/')[-1]}:{f['line']} {f['name']}"
    return frames[0]["name"] if frames else "?"


def _phase(frames):
    for f in frames:
        if "zerofit" in f["filename"] and f["name"] in PHASES:
            return f["name"]
    return "other"


def at_peak(events, base: int):
    """(peak bytes, {site: bytes alive at the peak}, the phase of the allocation that made the peak)."""
    alive, total, peak, at = {}, base, base, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            alive[e["addr"]] = e
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in alive:
            total -= alive.pop(e["addr"])["size"]
        if total > peak:
            peak, at = total, i
    alive = {}
    for e in events[: at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    sites = collections.Counter()
    for e in alive.values():
        site = _site(e.get("frames", []))
        if site == "?":  # made by the autograd engine's thread (no Python frames): named by their size
            site = f"? {e['size']:,} B"
        sites[site] += e["size"]
    return peak, sites, (_phase(events[at].get("frames", [])) if at >= 0 else "none")


def main():
    import torch
    from transformers import LlamaForCausalLM

    import common
    import zerofit

    w = common.WORKLOADS[sys.argv[1]]
    cap = sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    with torch.device("meta"):
        model = LlamaForCausalLM(common.llama_config(w))
    cfg = common.zerofit_config(w) | {"max_gpu_memory": cap}
    eng = zerofit.initialize(model, cfg)
    print(eng.plan.describe(), flush=True)
    data = common.make_batches(w, steps + 1)
    for s in range(steps):
        eng.train_batch([{"input_ids": x, "labels": x} for x in data[s]])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=2_000_000)
    eng.train_batch([{"input_ids": x, "labels": x} for x in data[steps]])
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][torch.cuda.current_device()]
    peak, sites, phase = at_peak(events, base)
    GiB = 1 << 30
    print(
        f"allocated before the step {base / GiB:.3f} GiB; max_memory_allocated in the step "
        f"{torch.cuda.max_memory_allocated() / GiB:.3f} GiB; replayed peak {peak / GiB:.3f} GiB, "
        f"during {phase}; {len(events)} events"
    )
    for site, b in sites.most_common(25):
        print(f"  {b / GiB:8.3f} GiB  {site}")
    getattr(eng, "close", lambda: None)()


if __name__ == "__main__":
    main()
