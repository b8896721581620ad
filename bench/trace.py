"""Print the last step's trace of a zerofit result (``extra.trace``, from ``engine.trace()``).

    python3 bench/trace.py RESULT.json [--engine zerofit] [--gantt]
    python3 bench/trace.py 2026-12-01_W2_8cf53f1_s12.json --gaps   # a run of bench/results/: the table and gaps kept

Per lane (compute, upload, download, cpu, cpu wait, wait, disk): busy seconds (overlapping intervals of a lane merged),
first start, last end, and the busy seconds inside each phase of the step: forward (until the first ``post`` compute),
post (named "later fwd" when block computes fall in it: the DeepSpeed-shaped loop's later forwards with every
micro-batch's head and loss), backward, and after the backward's last compute (the optimizer's tail). ``--gantt`` prints
every interval. ``--gaps`` prints where the device does not compute (gaps of over 1 ms between compute intervals, with
the intervals on either side), each CPU task's working and waiting seconds by phase, and, with a disk lane, how long
reads and writes ran at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def phases(trace: list[dict]) -> list[tuple[str, float, float]]:
    comp = sorted((e for e in trace if e["lane"] == "compute"), key=lambda e: e["start"])
    if not comp:
        return []
    posts = [e for e in comp if e["label"] == "post"]
    end = max(e["end"] for e in trace)
    fwd_end = posts[0]["start"] if posts else comp[-1]["end"]
    post_end = posts[-1]["end"] if posts else fwd_end
    bwd_end = max(e["end"] for e in comp)
    # the DeepSpeed-shaped loop: each micro-batch's forward, then its head and loss ("post"); the span between
    # the first and the last post then holds the later forwards too
    later = any(e["label"] != "post" and fwd_end < e["start"] < post_end for e in comp)
    return [
        ("forward", 0.0, fwd_end),
        ("later fwd" if later else "post", fwd_end, post_end),
        ("backward", post_end, bwd_end),
        ("tail", bwd_end, end),
    ]


def overlap(a0, a1, b0, b1) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def union(ev: list[dict]) -> list[tuple[float, float]]:
    """The lane's intervals merged where they overlap (the disk lane's chunk reads and writes run in
    parallel): busy means at least one of them in flight."""
    out: list[list[float]] = []
    for e in sorted(ev, key=lambda e: e["start"]):
        if out and e["start"] <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e["end"])
        else:
            out.append([e["start"], e["end"]])
    return [(a, b) for a, b in out]


def summarize(trace: list[dict]) -> str:
    ph = phases(trace)
    lanes = sorted({e["lane"] for e in trace})
    head = f"{'lane':10} {'busy s':>8} " + " ".join(f"{n:>9}" for n, _, _ in ph)
    lines = ["phases: " + ", ".join(f"{n} {a:.3f}-{b:.3f}" for n, a, b in ph), head]
    for lane in lanes:
        spans = union([e for e in trace if e["lane"] == lane])
        busy = sum(b - a for a, b in spans)
        per = [sum(overlap(s0, s1, a, b) for s0, s1 in spans) for _, a, b in ph]
        lines.append(f"{lane:10} {busy:8.3f} " + " ".join(f"{x:9.3f}" for x in per))
    return "\n".join(lines)


def cpu_tasks(trace: list[dict]) -> list[dict]:
    """The CPU worker's tasks: {label, start, work, wait}. A task's span is cut where it waited for a gradient or
    the disk ("cpu wait" lane, labelled ``task(what)``: [Note: the worker's waits], engine/update/worker.py); the worker
    runs one task at a time, so a task is the run of adjacent pieces with its label. Traces from before that cut
    have no waits: their work is the whole span."""
    pieces = sorted((e for e in trace if e["lane"] in ("cpu", "cpu wait")), key=lambda e: (e["start"], e["end"]))
    out: list[dict] = []
    for e in pieces:
        waited = e["lane"] == "cpu wait"
        label = e["label"].rsplit("(", 1)[0] if waited else e["label"]
        if not out or out[-1]["label"] != label or e["start"] > out[-1]["end"] + 1e-4:
            out.append({"label": label, "start": e["start"], "end": e["end"], "work": 0.0, "wait": 0.0})
        t = out[-1]
        t["end"] = max(t["end"], e["end"])
        t["wait" if waited else "work"] += e["end"] - e["start"]
    return out


def gaps(trace: list[dict], least: float = 1e-3) -> str:
    """The compute lane's gaps over ``least`` seconds, the CPU lane's tasks by phase, the disk's reads and writes
    at once (1 ms bins)."""
    comp = sorted((e for e in trace if e["lane"] == "compute"), key=lambda e: e["start"])
    holes = [
        (a["end"], b["start"] - a["end"], a["label"], b["label"])
        for a, b in zip(comp, comp[1:])
        if b["start"] - a["end"] > least
    ]
    lines = [f"compute gaps over {least * 1e3:.0f} ms: {len(holes)}, {sum(h[1] for h in holes) * 1e3:.1f} ms"]
    lines += [f"  at {t * 1e3:8.1f} ms  {g * 1e3:6.1f} ms  after {a}, before {b}" for t, g, a, b in holes]
    ph = phases(trace)
    tasks = cpu_tasks(trace)
    for name, a, b in ph:
        some = [t for t in tasks if a <= t["start"] < b]
        if some:
            lines.append(
                f"cpu tasks taken in the {name}: {len(some)}, label working ms (+ waiting ms): "
                + ", ".join(
                    f"{t['label']} {t['work'] * 1e3:.0f}" + (f" (+{t['wait'] * 1e3:.0f})" if t["wait"] > 5e-4 else "")
                    for t in some
                )
            )
    disk = [e for e in trace if e["lane"] == "disk"]
    if disk:
        bins = int(max(e["end"] for e in disk) * 1e3) + 1
        busy = {"read": [False] * bins, "write": [False] * bins}
        for e in disk:
            kind = "read" if e["label"].startswith("read") else "write"
            for i in range(max(0, int(e["start"] * 1e3)), int(e["end"] * 1e3) + 1):
                busy[kind][i] = True
        both = sum(r and w for r, w in zip(busy["read"], busy["write"]))
        only_r = sum(r and not w for r, w in zip(busy["read"], busy["write"]))
        only_w = sum(w and not r for r, w in zip(busy["read"], busy["write"]))
        lines.append(
            f"disk over {bins / 1e3:.3f} s: reads and writes at once {both / 1e3:.3f} s, reads alone "
            f"{only_r / 1e3:.3f}, writes alone {only_w / 1e3:.3f}"
        )
    return "\n".join(lines)


def gantt(trace: list[dict]) -> str:
    return "\n".join(
        f"{e['start'] * 1e3:9.1f} {(e['end'] - e['start']) * 1e3:7.1f} ms  {e['lane']:9} {e['label']}"
        for e in sorted(trace, key=lambda e: e["start"])
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result")
    ap.add_argument("--engine", default="zerofit")
    ap.add_argument("--gantt", action="store_true")
    ap.add_argument("--gaps", action="store_true")
    a = ap.parse_args()
    if os.path.isfile(a.result):
        data = json.load(open(a.result))
    else:  # a record of bench/results/'s compact files: its trace kept as this script's table and gaps
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from results_index import record

        data = record(a.result)
    rows = data.get("results", [data])
    for r in rows:
        extra = r.get("extra") or {}
        if r.get("engine") != a.engine or not (extra.get("trace") or extra.get("trace_summary")):
            continue
        print(f"== {r['engine']} {extra.get('zerofit_config', {}).get('offload', {})}: {r.get('s_per_step')} s/step")
        t = extra.get("trace")
        if not t:
            print(extra["trace_summary"])
            if a.gaps:
                print(extra.get("trace_gaps", ""))
            if a.gantt:
                print(f"(the {extra.get('trace_intervals')} intervals were not kept: bench/results_index.py --show)")
            continue
        print(summarize(t))
        if a.gaps:
            print(gaps(t))
        if a.gantt:
            print(gantt(t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
