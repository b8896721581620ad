"""python3 bench/run.py --workload W1 --engines plain,zerofit,deepspeed,fsdp2 --steps 4 \\
    --fsdp2-steps 2 --cap 24GiB --timeout 300 --budget 540 --out $OUT --commit <sha>
python3 bench/run.py --workload smoke --engines plain,zerofit --device cpu --steps 2 --out /tmp/b
python3 bench/run.py --from-json results_W1.json --append-docs   # re-render, into docs/benchmarks/log/<its date>.md
python3 bench/run.py --from-json 2026-12-06_L8_3c6acea_h100_32k.json   # a run kept in bench/results/L8.jsonl

Run one workload for several engines, each in its own process, and tabulate them.

Each engine runs as ``python bench/engine_<name>.py`` in a fresh process (its
own process group, so a timeout kills the whole group): GPU and host memory
are released between engines, and an engine that crashes, runs out of memory or
is killed does not take the others with it. Every engine writes a JSON result
after each step, so a timed-out engine still reports what it measured.

The GPU cap (``--cap``) applies to every engine but ``plain``, the everything-
on-the-GPU reference, which runs uncapped (``--plain-cap`` to change that).
zerofit receives the cap as its ``max_gpu_memory`` setting.

Writes ``OUT/results_<W>.json`` (run metadata and one entry per engine),
``OUT/results_<W>.md`` (the section for the benchmark log) and
``OUT/log_<W>.txt`` (every engine's output), and prints the table last. With
``--append-docs`` the section is appended to the log of the run's day,
``docs/benchmarks/log/<YYYY-MM-DD>.md`` (created with its title if new), and the
line for docs/benchmarks.md's contents is printed; ``--append-docs FILE``
appends to FILE instead (a folder: FILE/<YYYY-MM-DD>.md; docs/benchmarks.md
itself, the index, means the day's log). On the GPU machine the repository is
a copy: append there to a file under $OUT, or here with ``--from-json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ENGINES = (
    "plain",
    "deepspeed",
    "fsdp2",
    "zerofit",
    "zerofit-ds",
    "zerofit-dsw",
    "zerofit-dsl",
    "zerofit-fsdp1",
    "zerofit-fsdp1-w4",
    "fsdp1",
    "zerofit-accelerate",
    "zerofit-accelerate-w4",
    "fsdp1-accelerate",
    "zerofit-fabric-w4",
    "fsdp1-fabric",
    "zerofit-exact",
    "zerofit-fast",
    "zerofit-hooked",
    "zerofit-flash",
    "zerofit-cudnn",
    "zerofit-timed",
    "zerofit-fsdp1-w4-list",
    "plain-liger",
    "unsloth",
)
# a variant runs its base engine's script with fixed arguments (zerofit-ds: the DeepSpeed-shaped loop;
# zerofit-dsw: the same with each window announced first, engine.forward_window; zerofit-dsl: the unchanged loop
# drawing its micro-batches from the engine's own loader, deepspeed_io, which reads each window ahead)
VARIANTS = {
    "zerofit-ds": ("zerofit", ["--api", "deepspeed"]),
    "zerofit-dsw": ("zerofit", ["--api", "deepspeed", "--announce"]),
    "zerofit-dsl": ("zerofit", ["--api", "deepspeed", "--loader"]),
    # W7: the user's own FSDP1-shaped loop (engine_userloop.py) on zerofit.fsdp and on torch's FSDP1 with
    # CPU offload, and the same loop through an Accelerator
    "zerofit-fsdp1": ("userloop", ["--backend", "zerofit"]),
    # the same with the window of the loop's 4 micro-batches held (zerofit_config gradient_accumulation_steps)
    "zerofit-fsdp1-w4": ("userloop", ["--backend", "zerofit", "--window", "4"]),
    # the same drawing its micro-batches from a list, not a DataLoader (no window read ahead: docs/fsdp.md)
    "zerofit-fsdp1-w4-list": ("userloop", ["--backend", "zerofit", "--window", "4", "--from-list"]),
    "fsdp1": ("userloop", ["--backend", "torch"]),
    "zerofit-accelerate": ("userloop", ["--backend", "zerofit", "--loop", "accelerate"]),
    "zerofit-accelerate-w4": ("userloop", ["--backend", "zerofit", "--loop", "accelerate", "--window", "4"]),
    "fsdp1-accelerate": ("userloop", ["--backend", "torch", "--loop", "accelerate"]),
    # Lightning Fabric: the wrapper through Fabric, against Fabric's own FSDPStrategy with CPU offload
    "zerofit-fabric-w4": ("userloop", ["--backend", "zerofit", "--loop", "fabric", "--window", "4"]),
    "fsdp1-fabric": ("userloop", ["--backend", "torch", "--loop", "fabric"]),
    # the engine's kernels ([Note: fast kernels]) named, and the in-GPU peer with Liger-Kernel's
    "zerofit-exact": ("zerofit", ["--set", "kernels=exact"]),
    "zerofit-fast": ("zerofit", ["--set", "kernels=fast"]),
    # the hooked mode forced (docs/engine.md): a chain of blocks streamed as any model is, against its block chain
    "zerofit-hooked": ("zerofit", ["--set", "adapter=hooked"]),
    # attention's kernel named ([Note: attention's backend]), or timed at the shape, against torch's own choice
    "zerofit-flash": ("zerofit", ["--set", "attention_backend=flash"]),
    "zerofit-cudnn": ("zerofit", ["--set", "attention_backend=cudnn"]),
    "zerofit-timed": ("zerofit", ["--set", "attention_backend=timed"]),
    "plain-liger": ("plain", ["--liger"]),
}
GiB = 2**30


# --------------------------------------------------------------------------- machine


def machine_info() -> dict:
    """GPU (from nvidia-smi, so this process never opens a CUDA context), cores, RAM."""
    info = {"cpu_count": os.cpu_count(), "gpu": "no GPU"}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        gpus = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
        if gpus:
            info["gpu"] = (
                "; ".join(gpus) if len(set(gpus)) > 1 else (gpus[0] if len(gpus) == 1 else f"{len(gpus)} x {gpus[0]}")
            )
    except Exception as e:  # noqa: BLE001 - no nvidia-smi: a CPU machine
        info["gpu_error"] = type(e).__name__
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
        info["ram_gib"] = round(kib * 1024 / GiB, 1)
    except Exception:  # noqa: BLE001
        info["ram_gib"] = None
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except Exception:  # noqa: BLE001
        pass
    return info


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and out.stdout.strip():
            dirty = subprocess.run(
                ["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        pass
    return "unknown"


def command_line() -> str:
    """This invocation as a shell line, with the value of $OUT written as ``$OUT``."""
    argv = [
        "python3",
        os.path.relpath(os.path.abspath(sys.argv[0]), REPO) if sys.argv[0] else "bench/run.py",
        *sys.argv[1:],
    ]
    line = shlex.join(argv)
    out = os.environ.get("OUT")
    return line.replace(out, "$OUT") if out else line


# --------------------------------------------------------------------------- one engine


def last_error_line(log_text: str) -> str:
    """The most telling line of a failed engine's output: the last exception line, else the last line."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) or head in ("Killed", "Segmentation fault"):
            return ln[:400]
    return lines[-1][:400] if lines else ""


def run_engine(name: str, args, steps: int, cap: str, timeout: float, tmpdir: str, log) -> dict:
    """Run ``bench/engine_<name>.py`` in its own process group; return its result dict (status always set)."""
    result_path = os.path.join(tmpdir, f"{name}.json")
    base, fixed = VARIANTS.get(name, (name, []))
    nodes = max(1, args.nnodes)
    port = _free_port() if nodes > 1 else None
    launcher = (
        []
        if args.gpus <= 1 and nodes == 1
        else [
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={args.gpus}",
            *(
                ["--standalone"]
                if nodes == 1
                else [f"--nnodes={nodes}", "--master-addr=127.0.0.1", f"--master-port={port}", "--node-rank=NODE"]
            ),
        ]
    )
    cmd = [
        args.python,
        *launcher,
        os.path.join(HERE, f"engine_{base}.py"),
        "--workload",
        args.workload,
        "--steps",
        str(steps),
        "--device",
        args.device,
        "--cap",
        cap,
        "--result",
        result_path,
        *(["--lora"] if args.lora else []),
        *(["--qlora"] if args.qlora else []),
        *(["--seq", str(args.seq)] if args.seq else []),
        *fixed,
        *shlex.split(args.engine_args.get(name, "")),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(REPO, "src"), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    log.write(f"\n===== {name}: {shlex.join(cmd)} (timeout {timeout:.0f} s)\n")
    log.flush()
    start = time.time()
    engine_log = os.path.join(tmpdir, f"{name}.log")
    with open(engine_log, "w") as out:
        procs = []
        for node in range(nodes):  # several nodes: one torchrun per node, on this host, its GPUs its own
            node_env = dict(env)
            if nodes > 1 and args.device.startswith("cuda"):
                node_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * args.gpus + g) for g in range(args.gpus))
            node_cmd = [a.replace("--node-rank=NODE", f"--node-rank={node}") for a in cmd]
            procs.append(
                subprocess.Popen(
                    node_cmd, stdout=out, stderr=subprocess.STDOUT, env=node_env, cwd=REPO, start_new_session=True
                )
            )  # its own process group: killable as a whole
        proc = procs[0]
        timed_out = False
        deadline = time.time() + timeout
        try:
            codes = [p.wait(timeout=max(1.0, deadline - time.time())) for p in procs]
            rc = next((c for c in codes if c != 0), 0)
        except subprocess.TimeoutExpired:
            timed_out = True
            for p in procs:
                _kill_group(p)
            rc = proc.returncode
    wall = time.time() - start
    with open(engine_log, errors="replace") as f:
        text = f.read()
    log.write(text)
    log.write(f"===== {name}: exit {rc}{' (timed out)' if timed_out else ''} after {wall:.1f} s\n")
    log.flush()

    res = {}
    if os.path.exists(result_path):
        with open(result_path) as f:
            res = json.load(f)
    ranks = []
    for r in range(1, args.gpus * nodes):  # the other ranks' results (peak GPU, RSS, timeline)
        if os.path.exists(f"{result_path}.rank{r}"):
            with open(f"{result_path}.rank{r}") as f:
                other = json.load(f)
            ranks.append({k: other.get(k) for k in ("peak_gpu_gib", "peak_rss_gib", "timeline", "status", "step_s")})
    if ranks:
        res["other_ranks"] = ranks
    res["engine"] = name
    res["returncode"], res["wall_s"], res["steps_requested"] = rc, round(wall, 1), steps
    if timed_out and res.get("status") in ("OOM", "error"):  # failed, then hung while exiting
        res["error"] = f"{res.get('error', '')}; then hung at exit, killed after {timeout:.0f} s"
    elif timed_out:
        res["status"] = "timeout"
        res["error"] = f"killed after {timeout:.0f} s ({len(res.get('step_s', []))}/{steps} steps done)"
    elif rc is not None and rc < 0:
        sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        res["status"] = "OOM" if -rc == signal.SIGKILL else "error"
        res["error"] = (
            f"killed by {sig}"
            + (" (the kernel's OOM killer?)" if -rc == signal.SIGKILL else "")
            + (f"; last output: {last_error_line(text)}" if last_error_line(text) else "")
        )
    elif rc != 0 and res.get("status") in (None, "running", "ok"):
        res["status"] = "error"
        res["error"] = last_error_line(text) or f"exit code {rc}"
    elif res.get("status") is None:
        res["status"] = "error"
        res["error"] = "no result written"
    return res


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the engine's process group, then SIGKILL what is left after 15 s."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# --------------------------------------------------------------------------- tables


def _fmt(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def _common():
    """bench/common.py (no torch import), for the step check of results written before it was recorded."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import common

    return common


def step_check(r: dict) -> dict:
    """An engine result's timed steps judged (common.step_check): as recorded, else from its step times."""
    if isinstance(r.get("step_check"), dict):
        return r["step_check"]
    return _common().step_check(
        r.get("step_s") or [], r.get("warmup_steps", 1), (r.get("extra") or {}).get("timelines")
    )


def effective_steps(steps: int, min_timed: int, warmup: int = 1) -> int:
    """The steps an engine runs: ``steps``, raised so that at least ``min_timed`` follow the warm-up."""
    return max(steps, warmup + min_timed)


def render(doc: dict) -> str:
    """The markdown section of one run for the benchmark log (metadata, table, ratios, timeline)."""
    m, rs = doc["meta"], doc["results"]
    vers = {}
    for r in rs:
        for k, v in (r.get("versions") or {}).items():
            if not str(v).startswith("unavailable"):
                vers.setdefault(k, v)
    mach = m["machine"]
    first = next((r for r in rs if r.get("params")), {})
    lora = any(r.get("trainable_params") for r in rs) or m.get("lora")
    p, t = first.get("params"), first.get("tokens_per_step")
    lines = [
        f"## {m['workload']}: {m['date']}",
        "",
        f"- commit: `{m['commit']}`",
        f"- machine: {mach.get('gpu')}; {mach.get('cpu_count')} cores"
        + (f" ({mach['cpu']})" if mach.get("cpu") else "")
        + f"; {mach.get('ram_gib')} GiB RAM",
        "- software: " + ", ".join(f"{k} {v}" for k, v in vers.items()),
        f"- workload: {m['workload']}"
        + (f", P = {p / 1e9:.3f} B parameters, T = {t:,} tokens per optimizer step" if p and t else "")
        + f"; GPU cap {m['cap']} (plain: {m['plain_cap']}); steps {m['steps']} (fsdp2: {m['fsdp2_steps']}),"
        f" the first untimed",
        *([f"- LoRA: {_lora_line(rs)}"] if lora else []),
        f"- command: `{m['command']}`",
        "",
        "| engine | status | tokens/s | model TFLOP/s | peak GPU GiB | peak host RSS GiB | s to first step "
        "| s/step | timed steps | loss (last) |" + (" trainable / frozen params |" if lora else "") + " note |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        + (" ---: |" if lora else "")
        + " --- |",
    ]
    for r in rs:
        timed = max(0, len(r.get("step_s") or []) - r.get("warmup_steps", 1))
        note = r.get("error", "") if r.get("status") != "ok" else ""
        checked = _common().step_check_text(step_check(r)) if timed else ""
        if checked:
            note = (note + "; " if note else "") + checked
        extra = r.get("extra") or {}
        if "op_build_s" in extra:
            note = (note + "; " if note else "") + f"incl. {extra['op_build_s']} s cpu_adam build"
        losses = r.get("losses") or []
        lines.append(
            " | ".join(
                [
                    f"| {r['engine']}",
                    r.get("status", "?"),
                    _fmt(r.get("tokens_per_s"), ",.0f"),
                    _fmt(r.get("tflops"), ".1f" if (r.get("tflops") or 0) >= 1 else ".2g"),
                    _fmt(r.get("peak_gpu_gib"), ".1f"),
                    _fmt(r.get("peak_rss_gib"), ".1f"),
                    _fmt(r.get("first_step_s"), ".1f"),
                    _fmt(r.get("s_per_step"), ".2f"),
                    str(timed),
                    _fmt(losses[-1] if losses else None, ".3f"),
                    *([_counts(r)] if lora else []),
                    note.replace("|", "/") + " |",
                ]
            )
        )
    lines.append("")
    times = [
        f"{r['engine']} {' / '.join(f'{t:.2f}' for t in r['step_s'][: r.get('warmup_steps', 1)])}"
        f" | {', '.join(f'{t:.2f}' for t in r['step_s'][r.get('warmup_steps', 1) :])}"
        for r in rs
        if r.get("step_s")
    ]
    if times:
        lines += [
            "step times (s), warm-up | timed: " + "; ".join(times) + f". A timed step over "
            f"{_common().SLOW_STEP_FACTOR}x the median is named in the note with the phases of its timeline that "
            "ran longer than their median.",
            "",
        ]
    by = {r["engine"]: r for r in rs}
    zf = by.get("zerofit")
    if zf:
        ratios = []
        for peer in ("deepspeed", "fsdp2", "plain"):
            if peer not in by:
                continue
            a, b = zf.get("tokens_per_s"), by[peer].get("tokens_per_s")
            ok = zf.get("status") == "ok" and by[peer].get("status") == "ok"
            ratios.append(
                f"zerofit / {peer} tokens/s: **{a / b:.2f}x**"
                if a and b and ok
                else f"zerofit / {peer} tokens/s: n/a (zerofit {zf.get('status')}, {peer} {by[peer].get('status')})"
            )
        for name, what in (
            ("zerofit-ds", "DeepSpeed-shaped loop"),
            ("zerofit-dsw", "the loop, windows announced"),
            ("zerofit-dsl", "the loop over the engine's loader"),
        ):
            ds = by.get(name)
            if not (
                ds
                and ds.get("tokens_per_s")
                and zf.get("tokens_per_s")
                and ds.get("status") == zf.get("status") == "ok"
            ):
                continue
            ratios.append(
                f"{name} / zerofit ({what} / train_batch): **{ds['tokens_per_s'] / zf['tokens_per_s']:.2f}x**"
            )
            if by.get("deepspeed", {}).get("tokens_per_s") and by["deepspeed"].get("status") == "ok":
                ratios.append(f"{name} / deepspeed: **{ds['tokens_per_s'] / by['deepspeed']['tokens_per_s']:.2f}x**")
        if ratios:
            lines += ["; ".join(ratios), ""]
        if zf.get("timeline"):
            lines += [
                "zerofit timeline of the last step (s): "
                + ", ".join(f"{k} {v:.3f}" for k, v in zf["timeline"].items()),
                "",
            ]
    lines.append(
        (
            "tokens/s and model TFLOP/s (6·P·T / s for LoRA over a frozen base: forward, recompute and the "
            "input gradients; P the base's parameters)"
            if lora
            else "tokens/s and model TFLOP/s (8·P·T / s)"
        )
        + " use the median of the timed steps; peak GPU is "
        "`torch.cuda.max_memory_allocated` over the whole process; peak host RSS is `ru_maxrss`; "
        "s to first step counts from process start (imports, model build and JIT builds included)."
    )
    lines.append("")
    return "\n".join(lines)


def _counts(r: dict) -> str:
    t, f = r.get("trainable_params"), r.get("frozen_params")
    return f"{t / 1e6:,.1f} M / {f / 1e9:,.3f} B" if t is not None and f is not None else ""


def _lora_line(rs: list) -> str:
    """The LoRA settings of a run (any engine's ``extra.lora``)."""
    lo = next(((r.get("extra") or {}).get("lora") for r in rs if (r.get("extra") or {}).get("lora")), None)
    if not lo:
        return "r 16, alpha 32, dropout 0 on the seven linears (no engine reported its adapters)"
    return (
        f"r {lo['r']}, alpha {lo['alpha']}, dropout {lo['dropout']} on {', '.join(lo['targets'])} through "
        f"peft.get_peft_model; AdamW lr {lo['lr']} over the adapters; the base frozen in "
        f"{'NF4 (its linears; the rest bf16)' if lo.get('qlora') else 'bf16'}; trainable "
        f"{lo['trainable']:,}, frozen {lo['frozen']:,} parameters"
    )


def write_outputs(doc: dict, out_dir: str) -> str:
    w = doc["meta"]["workload"]
    with open(os.path.join(out_dir, f"results_{w}.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    md = render(doc)
    with open(os.path.join(out_dir, f"results_{w}.md"), "w") as f:
        f.write(md)
    return md


DOCS = os.path.join(REPO, "docs", "benchmarks", "log")  # the dated logs, docs/benchmarks/log/YYYY-MM-DD.md


def docs_target(arg: str, doc: dict) -> str:
    """The file ``--append-docs [FILE]`` appends to: FILE, or the log of the run's day (no FILE; a folder: the day's
    file in it; docs/benchmarks.md, which holds the current figures and the contents, not the runs)."""
    day = f"{doc['meta']['date'][:10]}.md"
    if not arg:
        return os.path.join(DOCS, day)
    if os.path.isdir(arg):
        return os.path.join(arg, day)
    if os.path.abspath(arg) == os.path.join(REPO, "docs", "benchmarks.md"):
        print("docs/benchmarks.md holds the current figures and the contents: appending to the day's log", flush=True)
        return os.path.join(DOCS, day)
    return arg


def append_docs(md: str, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    day = os.path.basename(path)[:-3]
    dated = os.path.basename(path).endswith(".md") and len(day) == 10 and day[4] == day[7] == "-"
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a") as f:
        if new and dated:
            f.write(
                f"# Benchmarks: {day}\n\nThe benchmark runs of that day, each appended by `bench/run.py "
                "--append-docs` as it printed it: date, commit, machine, command and table. "
                "[docs/benchmarks.md](../../benchmarks.md) has the current figures of each workload, the contents "
                "of every dated log and what the columns mean.\n"
            )
        f.write("\n" + md)
    print(f"appended the section to {path}", flush=True)
    if dated and os.path.abspath(os.path.dirname(path)) == os.path.abspath(DOCS):
        from pathlib import Path

        sys.path.insert(0, HERE)
        from results_index import sections  # the headings' anchors, numbered as GitHub numbers them

        title = md.splitlines()[0].lstrip("# ").strip()
        anchor = [s["anchor"] for s in sections(Path(path)) if s["title"] == title][-1]
        print(f"its line for docs/benchmarks.md's contents: - [{title}](benchmarks/log/{day}.md#{anchor})", flush=True)


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1", help="W1, W2, W3, W6a, W6b (LoRA), smoke, ... (common.WORKLOADS)")
    p.add_argument(
        "--lora",
        action="store_true",
        help="every engine trains W6's LoRA over the frozen base (implied by W6a, W6b); fsdp2 refuses",
    )
    p.add_argument(
        "--qlora",
        action="store_true",
        help="every engine trains W6c's QLoRA (the blocks' linears in NF4; implied by W6c): zerofit with "
        "quantize_base nf4, plain with bitsandbytes' Linear4bit in the GPU; deepspeed, fsdp2 refuse",
    )
    p.add_argument(
        "--engines",
        default="plain,zerofit,deepspeed,fsdp2",
        help=f"comma-separated, run in this order; from {', '.join(ENGINES)}",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=4,
        help="optimizer steps per engine, the first untimed; raised to 1 + --min-timed",
    )
    p.add_argument(
        "--min-timed",
        type=int,
        default=3,
        help="timed steps at least, after the warm-up (default 3: the median of two is their mean, and a slow second "
        "step passes for the speed); a lower value is recorded and each figure's note says how few it had",
    )
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence instead of the workload's (L8, L13)")
    p.add_argument("--fsdp2-steps", type=int, default=2, help="steps for fsdp2 (slow)")
    p.add_argument("--cap", default="24GiB", help="GPU memory cap of the offloading engines ('none': no cap)")
    p.add_argument("--plain-cap", default="none", help="GPU memory cap of plain (default: none)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per engine before it is killed")
    p.add_argument(
        "--engine-timeout",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="one engine's own --timeout, e.g. deepspeed=540 (repeatable)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the whole run: later engines get what is left (minus a margin)",
    )
    p.add_argument("--device", default="cuda", help="cuda, or cpu for dry runs")
    p.add_argument("--gpus", type=int, default=1, help="ranks per engine (torchrun on one host); tokens count all")
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="simulated nodes on this host, each a torchrun node of --gpus ranks and GPUs of its own "
        "(zerofit's layouts across them: docs/ranks.md; --engine-args 'zerofit=--set nodes_layout=full'); "
        "tokens count every node's",
    )
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "runs", "bench"))
    p.add_argument(
        "--append-docs",
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        help="append the markdown section to the run's day's log, docs/benchmarks/log/<YYYY-MM-DD>.md, or to FILE",
    )
    p.add_argument("--commit", default=None, help="commit id to record (default: git rev-parse, if it works)")
    p.add_argument("--python", default=sys.executable, help="interpreter for the engine processes")
    p.add_argument(
        "--engine-args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="extra arguments for one engine, e.g. fsdp2='--optimizer fused' (repeatable)",
    )
    p.add_argument(
        "--from-json",
        default=None,
        help="only re-render (and --append-docs) a results JSON, or a record of bench/results/ (W1.jsonl#NAME, NAME)",
    )
    args = p.parse_args(argv)
    extra = {}
    for item in args.engine_args:
        name, _, rest = item.partition("=")
        extra[name.strip()] = (extra.get(name.strip(), "") + " " + rest).strip()
    args.engine_args = extra
    args.engine_timeout = {k.strip(): float(v) for k, _, v in (t.partition("=") for t in args.engine_timeout)}
    return args


def load_result(ref: str) -> dict:
    """A results JSON: a file, else a record of bench/results/'s compact files (``W1.jsonl#NAME``, or NAME, the name
    its file had: bench/results_index.py --show lists them)."""
    if os.path.isfile(ref):
        with open(ref) as f:
            return json.load(f)
    sys.path.insert(0, HERE)
    from results_index import record

    rec = record(ref)
    if "meta" not in rec or "results" not in rec:
        sys.exit(f"{ref}: a {rec.get('kind')} record, not a bench/run.py result")
    return rec


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        doc = load_result(args.from_json)
        md = render(doc)
        print(md)
        if args.append_docs is not None:
            append_docs(md, docs_target(args.append_docs, doc))
        return 0

    sys.path.insert(0, HERE)
    import common  # the workloads (no torch import)

    if args.workload not in common.WORKLOADS:
        sys.exit(f"unknown workload {args.workload!r}; expected one of {sorted(common.WORKLOADS)}")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        sys.exit(f"unknown engine(s) {unknown}; expected some of {list(ENGINES)}")
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    deadline = t_start + args.budget if args.budget else None
    doc = {
        "meta": {
            "workload": args.workload,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": args.commit or git_commit(),
            "machine": machine_info(),
            "command": command_line(),
            "cap": args.cap,
            "plain_cap": args.plain_cap,
            "steps": effective_steps(args.steps, args.min_timed),
            "fsdp2_steps": effective_steps(args.fsdp2_steps, args.min_timed),
            "min_timed": args.min_timed,
            "engines": engines,
            "lora": bool(args.lora or args.qlora or common.WORKLOADS[args.workload].lora),
            "qlora": bool(args.qlora or common.WORKLOADS[args.workload].qlora),
        },
        "results": [],
    }
    print(f"bench {args.workload}: engines {engines}; machine {doc['meta']['machine']}", flush=True)
    log_path = os.path.join(args.out, f"log_{args.workload}.txt")
    with tempfile.TemporaryDirectory(prefix="zerofit-bench-") as tmpdir, open(log_path, "a") as log:
        for name in engines:
            asked = args.fsdp2_steps if name == "fsdp2" else args.steps
            steps = effective_steps(asked, args.min_timed)
            if steps != asked:
                print(
                    f"--- {name}: {asked} steps raised to {steps}: {args.min_timed} timed after the warm-up", flush=True
                )
            # the in-GPU peers (plain and its variants, Unsloth) run with --plain-cap, default none
            cap = args.plain_cap if VARIANTS.get(name, (name,))[0] in ("plain", "unsloth") else args.cap
            timeout = args.engine_timeout.get(name, args.timeout)
            if deadline:
                timeout = min(timeout, deadline - time.time() - 10)
            if timeout < 20:
                res = {"engine": name, "status": "skipped", "error": "no time left in --budget"}
            else:
                print(f"--- {name}: {steps} steps, cap {cap}, timeout {timeout:.0f} s", flush=True)
                res = run_engine(name, args, steps, cap, timeout, tmpdir, log)
            doc["results"].append(res)
            write_outputs(doc, args.out)  # after every engine: a killed run keeps what it had
            tps = res.get("tokens_per_s")
            checked = _common().step_check_text(step_check(res)) if res.get("step_s") else ""
            print(
                f"--- {name}: {res.get('status')}"
                + (f", {tps:,.0f} tokens/s, {res.get('s_per_step'):.2f} s/step" if tps else "")
                + (f", {res.get('wall_s')} s wall" if res.get("wall_s") else "")
                + (f": {res.get('error')}" if res.get("status") != "ok" else "")
                + (f" [{checked}]" if checked else ""),
                flush=True,
            )
            if res.get("status") not in ("ok", "skipped"):
                tail = (
                    open(os.path.join(tmpdir, f"{name}.log"), errors="replace").read().splitlines()[-12:]
                    if os.path.exists(os.path.join(tmpdir, f"{name}.log"))
                    else []
                )
                print("\n".join(f"    | {ln[:300]}" for ln in tail), flush=True)
    md = write_outputs(doc, args.out)
    if args.append_docs is not None:
        append_docs(md, docs_target(args.append_docs, doc))
    print(
        f"\nwrote {args.out}/results_{args.workload}.json, .md, log_{args.workload}.txt "
        f"({time.time() - t_start:.0f} s)\n",
        flush=True,
    )
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
