"""bench/results/: one compact file per workload (W1.jsonl, W2.jsonl, ..., other.jsonl), one JSON record a line per
result, and README.md, the index of every record: grouped by workload, with its date, commit, what it measured (from
its name and its content) and the section of the dated benchmark logs (docs/benchmarks/log/YYYY-MM-DD.md) it backs.

    python3 bench/results_index.py                          # rewrite bench/results/README.md
    python3 bench/results_index.py --check                  # exit 1 if README.md is not what this would write,
                                                            # or a loose file sits in bench/results/
    python3 bench/results_index.py --show NAME [NAME ...]   # print the record of NAME (a glob pattern: every match)
    python3 bench/results_index.py --add FILE --name NAME   # fold a new result into its workload's file

A record keeps the name its file had (`DATE_WORKLOAD[_CAP]_COMMIT_WHAT.ext`): its workload is the name's token after
the date. A `bench/run.py` result keeps its `meta` and every engine's `results` entry but the trace's intervals
(`extra.trace`), replaced by `bench/trace.py`'s table and gaps of them (`extra.trace_summary`, `extra.trace_gaps`,
`extra.trace_intervals`): `python3 bench/run.py --from-json NAME` renders it, and its `.md` is kept as a reference
to it (`kind: rendered`) when it renders the same. Another JSON is kept whole (`doc`), a text file whole under 20 KB
(`text`), else its head, tail and the lines with figures; a folder as its files (`files`).

A file backs a section when the section names it, or names a pattern that matches it (`2026-12-01_*_s9_*.json`,
`{a,b}` alternatives): the most specific pattern wins. A file no section names is placed by its commit (and its
run's time, HH:MM, when its JSON has one) in the sections of the same day; the table says "by commit" then (or
"by hand": HINTS below, for a folder whose name has no commit).
Nothing is run and no figure is computed: tokens/s, statuses and test counts are read from the records.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import re
import shlex
import sys
import unicodedata
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
LOGS = REPO / "docs" / "benchmarks" / "log"
INDEX = RESULTS / "README.md"

GROUPS = [  # name token -> title, in the order they are listed
    ("W1", "W1: 3.2 B Llama (Llama-3.2-3B shape), 16k tokens per step"),
    ("W1nvme", "W1 on the NVMe tier against DeepSpeed ZeRO-Infinity (4 micro-batches)"),
    ("W1-ga32", "W1-ga32: W1 with 32 micro-batches per step (the disk tier against DeepSpeed ZeRO-Infinity)"),
    ("W2", "W2: 6.7 B Llama (Llama-2-7B shape), 16k tokens per step (also W3a's runs before the W3a name)"),
    ("W2-ga32", "W2-ga32: W3a with 32 micro-batches per step"),
    ("W3a", "W3a: the 7B shape under a 32 GiB host budget, the rest on the disk"),
    ("W3b", "W3b: the 13B shape on one GPU with the disk tier"),
    ("W4", "W4: offloaded generation of the 13B shape (bench/infer.py)"),
    ("L8", "L8: the Llama-3.1-8B shape in LoRA, one long sequence per step (docs/long-context.md)"),
    ("L8full", "L8-full: the Llama-3.1-8B shape in full fine-tuning, one long sequence per step"),
    ("L13", "L13: the Llama-2-13B shape in LoRA, one long sequence per step"),
    ("W5", "W5: the 13B shape on 2 GPUs"),
    ("W6a", "W6a: the 13B shape in LoRA, bf16 base"),
    ("W6c", "W6c: the 70B shape (Llama-3-70B) in QLoRA on one GPU"),
    ("W1-2", "W1-2: W1 cut to 2 blocks, its start-up on the CPU (bench/startup.py)"),
    ("W6c-4", "W6c-4: W6c cut to 4 blocks, its start-up (bench/startup.py)"),
    ("W6c-8", "W6c-8: W6c cut to 8 blocks, its start-up from a meta model (bench/startup.py)"),
    ("serve", "serve: zerofit serve under load (bench/serve.py)"),
    ("other", "Probes, GPU tests, zerofit doctor, estimates"),
]
NAMED_GROUPS = ("serve",)  # name tokens that are a group of their own besides the workloads (W..., L...)
OTHER_KINDS = [  # name part -> what the file holds
    ("disk_probe", "bench/probes/disk_probe.py output (JSON lines)"),
    ("split_rounding", "bench/probes/split_probe.py --rounding output"),
    ("split_probe", "bench/probes/split_probe.py output"),
    ("doctor", "zerofit doctor output"),
    ("gpu_tests", "pytest output of the GPU tests"),
    ("compute_probe", "bench/probes/compute_probe.py output"),
    ("mem_peak", "bench/probes/mem_peak.py output"),
    ("_gaps", "bench/trace.py --gaps output"),
    ("_mem.log", "host memory every 2 s (free -m) beside the run"),
    ("_log.txt", "bench/run.py's log (every engine's output)"),
]
HEX7 = re.compile(r"^[0-9a-f]{7,12}$")
WEAK = 10  # a pattern matching more files than this names a whole round's files, not a run's
# files that no section names and whose name has no commit: the section they belong to, placed by hand
HINTS = {
    "2026-11-30_W2_finetune": ("2026-11-30", "A W2-shaped model directory fine-tuned"),
}


# --------------------------------------------------------------------------- headings and their anchors


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text (before duplicates are numbered): markdown marks and punctuation dropped,
    lower case, each space a hyphen."""
    text = re.sub(r"[`*]", "", heading).lower()
    keep = "".join(c for c in text if c.isalnum() or c in "-_ " or unicodedata.category(c).startswith("M"))
    return keep.replace(" ", "-")


def sections(path: Path) -> list[dict]:
    """The headings of a markdown file with their anchors (duplicates numbered as GitHub does), levels, parents and
    text (up to the next heading of any level)."""
    out, seen, stack, fence = [], {}, [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^(#{1,6}) (.*)$", line)
        if m:
            level, title = len(m.group(1)), m.group(2).strip()
            base = slug(title)
            n = seen.get(base, 0)
            seen[base] = n + 1
            while stack and stack[-1]["level"] >= level:
                stack.pop()
            sec = {
                "file": path,
                "level": level,
                "title": title,
                "anchor": base if n == 0 else f"{base}-{n}",
                "parent": stack[-1] if stack else None,
                "text": [line],
            }
            stack.append(sec)
            out.append(sec)
        elif out:
            out[-1]["text"].append(line)
    for s in out:
        s["text"] = "\n".join(s["text"])
    return out


def patterns(text: str) -> list[str]:
    """The result-file names and patterns a section's text names, braces expanded."""
    found = []
    for ref in re.findall(r"20\d\d-\d\d-\d\d_(?:\{[^{}\s]*\}|[^\s`'\"(),;{])+", text):
        ref = ref.rstrip(".:/")
        found += expand(ref)
    return found


def expand(ref: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", ref)
    if not m:
        return [ref]
    return [x for alt in m.group(1).split(",") for x in expand(ref[: m.start()] + alt + ref[m.end() :])]


# --------------------------------------------------------------------------- the compact files and their records


DATED = re.compile(r"^20\d\d-\d\d-\d\d_")
TEXT_WHOLE = 20_000  # a text file up to this many bytes is kept whole; a longer one as its head, tail and figures
FIGURE = re.compile(r"\d[\d.,]*\s*(?:GiB|MiB|GB|MB|ms|s\b|s/step|tokens/s|x\b|%)|passed|failed|error|Error|rc=")


def group_file(group: str) -> Path:
    return RESULTS / f"{group}.jsonl"


def is_group_file(path: Path) -> bool:
    return path.is_file() and path.suffix == ".jsonl" and not DATED.match(path.name)


def loose_files() -> list[Path]:
    """What sits in bench/results/ besides README.md and the compact files: results not folded in yet."""
    return [p for p in sorted(RESULTS.iterdir()) if p.name != INDEX.name and not is_group_file(p)]


def read_group(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def records() -> list[dict]:
    """Every record of every compact file, in the files' order."""
    return [r for p in sorted(RESULTS.iterdir()) if is_group_file(p) for r in read_group(p)]


def write_group(group: str, recs: list[dict]) -> None:
    lines = [json.dumps(r, ensure_ascii=False, separators=(",", ":")) for r in sorted(recs, key=lambda r: r["file"])]
    group_file(group).write_text("".join(line + "\n" for line in lines))


def find(ref: str) -> list[dict]:
    """The records a reference names: `FILE.jsonl#NAME`, a name or a path ending in one (`bench/results/NAME`), or a
    glob pattern of names."""
    if "#" in ref:
        path, name = ref.split("#", 1)
        return [r for r in read_group(Path(path)) if r["file"].rstrip("/") == name.rstrip("/")]
    name = ref.rstrip("/").rsplit("/", 1)[-1]
    return [r for r in records() if fnmatch.fnmatchcase(r["file"].rstrip("/"), name)]


def record(ref: str) -> dict:
    """The one record `ref` names (see find); SystemExit when there is none or several."""
    found = find(ref)
    if len(found) != 1:
        where = f"{RESULTS.relative_to(REPO) if RESULTS.is_relative_to(REPO) else RESULTS}/*.jsonl"
        raise SystemExit(f"{ref}: {'no record' if not found else f'{len(found)} records'} in {where}")
    return found[0]


_MODULES: dict = {}


def _bench_module(name: str):
    """bench/<name>.py, loaded from its file (bench/trace.py's name is also the standard library's)."""
    if name not in _MODULES:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
        assert spec is not None and spec.loader is not None
        _MODULES[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_MODULES[name])
    return _MODULES[name]


def strip_traces(obj):
    """The object with every trace (a list of {lane, label, start, end} intervals under a key "trace") replaced by
    bench/trace.py's table and gaps of it, and the number of its intervals."""
    if isinstance(obj, list):
        return [strip_traces(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for k, v in obj.items():
        if k == "trace" and isinstance(v, list) and v and all(isinstance(e, dict) and "lane" in e for e in v):
            tr = _bench_module("trace")
            out["trace_intervals"] = len(v)
            out["trace_summary"] = tr.summarize(v)
            out["trace_gaps"] = tr.gaps(v)
        else:
            out[k] = strip_traces(v)
    return out


def _text_fields(text: str) -> dict:
    if len(text.encode()) <= TEXT_WHOLE:
        return {"text": text}
    lines = text.splitlines()
    head, mid, tail = lines[:60], lines[60:-60], lines[-60:]
    return {
        "text_bytes": len(text.encode()),
        "text_lines": len(lines),
        "head": "\n".join(head),
        "figures": "\n".join(ln for ln in mid if FIGURE.search(ln))[:TEXT_WHOLE],
        "tail": "\n".join(tail),
    }


def _is_run(doc) -> bool:
    return isinstance(doc, dict) and "meta" in doc and "results" in doc


def compact(path: Path, name: str, known: dict[str, dict] | None = None) -> dict:
    """The record of a result file or folder, to be kept under `name`. `known`: the records by name, for a `.md`
    that bench/run.py rendered from one of them."""
    parts = name_parts(name)
    rec: dict = {"file": name.rstrip("/") + ("/" if path.is_dir() else ""), "group": parts["group"]}
    rec["date"], rec["commit"] = parts["date"], parts["commit"]
    if path.is_dir():
        rec["kind"] = "dir"
        files: dict = {}
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            rel = f.relative_to(path).as_posix()
            if f.suffix == ".json":
                files[rel] = strip_traces(json.loads(f.read_text()))
            else:
                files[rel] = _text_fields(f.read_text(errors="replace"))
        rec["files"] = files
        return rec
    if path.suffix == ".json":
        doc = strip_traces(json.loads(path.read_text()))
        if _is_run(doc):
            rec["kind"] = "bench/run.py"
            rec["date"] = doc["meta"].get("date", "").replace(" UTC", "") or rec["date"]
            rec["commit"] = doc["meta"].get("commit") or rec["commit"]
            rec["meta"], rec["results"] = doc["meta"], doc["results"]
        else:
            rec["kind"], rec["doc"] = "json", doc
        return rec
    text = path.read_text(errors="replace")
    source = (known or {}).get(name[: -len(".md")] + ".json") if name.endswith(".md") else None
    if source and source.get("kind") == "bench/run.py" and _bench_module("run").render(source) == text:
        rec["kind"], rec["from"] = "rendered", source["file"]
        return rec
    rec["kind"] = "text"
    rec.update(_text_fields(text))
    return rec


def add(path: Path, name: str, replace: bool = False) -> dict:
    """Fold a result file (or folder) into its workload's compact file under `name`; a file of bench/results/ itself
    is removed once folded. Returns the record."""
    if not DATED.match(name) or "/" in name.rstrip("/"):
        raise SystemExit(
            f"{name}: a result's name is DATE_WORKLOAD[_CAP]_COMMIT_WHAT.ext (2026-12-06_L8_3c6acea_32k.json)"
        )
    known = {r["file"]: r for r in records()}
    key = name.rstrip("/") + ("/" if path.is_dir() else "")
    if (key in known or key.rstrip("/") in known or key + "/" in known) and not replace:
        raise SystemExit(f"{name}: already recorded (--replace to overwrite it)")
    rec = compact(path, name, known)
    group = rec["group"]
    recs = read_group(group_file(group)) if group_file(group).is_file() else []
    recs = [r for r in recs if r["file"].rstrip("/") != key.rstrip("/")] + [rec]
    write_group(group, recs)
    if path.resolve().parent == RESULTS.resolve():
        if path.is_dir():
            for f in sorted(path.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
            path.rmdir()
        else:
            path.unlink()
    return rec


# --------------------------------------------------------------------------- what a record holds


def name_parts(name: str) -> dict:
    date, rest = name[:10], name[11:]
    tokens = rest.split("_")
    group = tokens[0] if re.match(r"^[WL]\d", tokens[0]) or tokens[0] in NAMED_GROUPS else "other"
    commit = next((t.split(".")[0] for t in tokens if HEX7.match(t.split(".")[0])), "")
    cap = next((t for t in tokens[1:3] if re.match(r"^\d+GiB$", t)), "")
    # what follows the commit, less the round's tag (s9) and the extension: compute_probe, mem_peak, clip1_both
    after = tokens[[t.split(".")[0] for t in tokens].index(commit) + 1 :] if commit else tokens[1:]
    tag = "_".join(t for t in after if not re.match(r"^s\d+$", t)).split(".")[0]
    return {"date": date, "group": group, "commit": commit, "cap": cap, "tag": tag if len(tag) >= 5 else ""}


def _engine_args(command: str) -> list[str]:
    try:
        argv = shlex.split(command)
    except ValueError:
        return []
    out = []
    for i, a in enumerate(argv):
        if a == "--engine-args" and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith("--engine-args="):
            out.append(a.split("=", 1)[1])
        elif a == "--gpus" and i + 1 < len(argv) and argv[i + 1] != "1":
            out.append(f"{argv[i + 1]} GPUs")
    return out


def _tps(v) -> str:
    return f"{v:,.0f}" if isinstance(v, (int, float)) else "?"


def describe_json(doc: dict) -> tuple[dict, str]:
    """(date/commit/cap found in the file, what it measured) of a JSON result."""
    if "meta" in doc and "results" in doc:  # bench/run.py
        m = doc["meta"]
        engines = "; ".join(
            f"{r.get('engine')} {r.get('status')}"
            + (f", {_tps(r['tokens_per_s'])} tokens/s" if r.get("tokens_per_s") else "")
            for r in doc["results"]
        )
        what = f"bench/run.py: {engines}"
        args = _engine_args(m.get("command", ""))
        if args:
            what += "; " + ", ".join(f"`{a}`" for a in args)
        return {"date": m.get("date", ""), "commit": m.get("commit", ""), "cap": m.get("cap", "")}, what
    if doc.get("engine") == "zerofit-trainer":  # bench/trainer_bench.py
        return {}, (
            f"bench/trainer_bench.py (zerofit.hf.Trainer): {_tps(doc.get('tokens_per_s'))} tokens/s, "
            f"{doc.get('s_per_step', 0):.2f} s/step"
        )
    if "runs" in doc and doc.get("engine") in ("zerofit", "accelerate"):  # bench/infer.py, one engine
        runs = ", ".join(f"batch {r.get('batch')}: {r.get('decode_tokens_per_s')}" for r in doc["runs"])
        extra = ""
        if doc.get("max_host_memory"):
            extra = f", host budget {doc['max_host_memory']}, blocks on the disk"
        return {"cap": doc.get("cap", "")}, (f"bench/infer.py, {doc['engine']}{extra}: decode tokens/s {runs}")
    return {}, "JSON: " + ", ".join(sorted(doc)[:8])


def describe_text(name: str, text: str) -> str:
    what = next((w for key, w in OTHER_KINDS if key in name), "text output")
    if "gpu_tests" in name:
        counts = re.findall(r"^=*\s*(\d+ passed[^=\n]*?)\s*=*$", text, re.M)
        if not counts:  # run with -qq: no summary line, only pytest's progress characters
            marks = "".join(re.findall(r"^([.sxXFE]+)\s+\[\s*\d+%\]$", text, re.M))
            if marks:
                kinds = (("passed", "."), ("failed", "F"), ("errors", "E"), ("skipped", "s"))
                counts = [
                    ", ".join(f"{marks.count(c)} {w}" for w, c in kinds if marks.count(c))
                    + " (pytest's progress marks)"
                ]
        rcs = re.findall(r"^rc=(-?\d+)$", text, re.M)
        if counts:
            what += ": " + "; ".join(counts)
        if rcs:
            what += (", " if counts else ": ") + "exit " + ", ".join(rcs)
    elif "mem_peak" in name:
        m = re.search(r"replayed peak ([\d.]+ GiB), during (\w+)", text)
        if m:
            what += f": peak {m.group(1)}, in {m.group(2)}"
    elif "_gaps" in name:
        m = re.search(r"^== \S+ .*?: ([\d.]+) s/step", text, re.M)
        if m:
            what += f": {float(m.group(1)):.3f} s/step"
    elif name.endswith("_log.txt"):
        oks = re.findall(r"^\[(\S+)\] ok: (\d+) tokens/s", text, re.M)
        if oks:
            what += ": " + "; ".join(f"{e} {int(t):,} tokens/s" for e, t in oks)
    elif "disk_probe" in name:
        what += f": {len([ln for ln in text.splitlines() if ln.strip()])} tests"
    return what


def describe_dir(files: dict) -> str:
    names = sorted(files)
    if names and all(n.startswith("est_") for n in names):
        what = "zerofit estimate's JSON per workload and budget: " + ", ".join(names)
    else:
        what = "a zerofit train fine-tuning job (bench/finetune.py, bench/finetune_run.sh): " + ", ".join(names)
    c = files.get("compare.json")
    if isinstance(c, dict):
        what += (
            f"; compare.json: same_losses {str(c.get('same_losses')).lower()}, "
            f"same_exported_weights {str(c.get('same_exported_weights')).lower()}"
        )
    return what


def record_text(rec: dict) -> str:
    """A text record's text: whole, or its head, the lines with figures and its tail."""
    if "text" in rec:
        return rec["text"]
    return "\n".join(
        [rec.get("head", ""), f"[... {rec.get('text_lines')} lines in all; the lines with figures:]"]
        + [rec.get("figures", ""), "[...]", rec.get("tail", "")]
    )


def entries() -> list[dict]:
    out = []
    for rec in records():
        name = rec["file"].rstrip("/")
        e = {"name": rec["file"], **name_parts(name)}
        e["time"], e["commits"] = "", [e["commit"]] if e["commit"] else []
        kind = rec.get("kind")
        if kind == "dir":
            e["what"] = describe_dir(rec["files"])
        elif kind in ("bench/run.py", "json"):
            found, e["what"] = describe_json(rec if kind == "bench/run.py" else rec["doc"])
            if found.get("date"):
                e["time"] = found["date"][11:16]
                e["date"] = found["date"].replace(" UTC", "")
            if found.get("commit") and HEX7.match(found["commit"].split("+")[0]):
                e["commits"].append(found["commit"].split("+")[0])
            if found.get("commit") and found["commit"] != e["commit"]:  # the name's, and the file's if other
                e["commit"] = f"{e['commit']} (file: {found['commit']})" if e["commit"] else found["commit"]
            e["cap"] = found.get("cap") or e["cap"]
        elif kind == "rendered":
            e["what"] = f"bench/run.py's section of `{rec['from']}` (`bench/run.py --from-json {name}` renders it)"
        else:
            e["what"] = describe_text(name, record_text(rec))
        out.append(e)
    return out


# --------------------------------------------------------------------------- which section a file backs


def place(items: list[dict], secs: list[dict]) -> None:
    names = [e["name"].rstrip("/") for e in items]
    refs = [(s, p) for s in secs for p in patterns(s["text"])]
    hits = {p: [n for n in names if fnmatch.fnmatchcase(n, p)] for _, p in refs}
    for e in items:
        name = e["name"].rstrip("/")
        exact = [s for s, p in refs if p == name]
        matched = [(len(hits[p]), s) for s, p in refs if name in hits[p] and p != name]
        best = min((n for n, _ in matched), default=0)
        if exact:  # and the sections of the most specific pattern that matches it too
            more = [s for n, s in matched if n == best and n <= WEAK]
            e["backs"], e["how"] = _unique(exact + more), "named"
            continue
        if matched:
            chosen = _unique([s for n, s in matched if n == best])
            e["backs"], e["how"] = chosen, "named"
            if best > WEAK:  # a round's "Result files: 2026-12-01_*": its subsection, else the day's, by commit
                inside = [t for t in secs if any(t is s or _under(t, s) for s in chosen)]
                same_day = [t for t in secs if t["file"].stem == e["date"][:10]]
                better = _by_commit(inside, e) or _by_commit(same_day, e)
                if better:
                    e["backs"], e["how"] = better, "by commit"
            continue
        if name in HINTS:
            day, prefix = HINTS[name]
            e["backs"] = [s for s in secs if s["file"].stem == day and s["title"].startswith(prefix)]
            e["how"] = "by hand"
            continue
        same_day = [s for s in secs if s["file"].stem == e["date"][:10]]
        e["backs"], e["how"] = _by_commit(same_day, e), "by commit"


def _unique(ss: list[dict]) -> list[dict]:
    out = []
    for s in ss:
        if all(s is not t for t in out):
            out.append(s)
    return out


def _under(t: dict, s: dict) -> bool:
    p = t["parent"]
    while p is not None:
        if p is s:
            return True
        p = p["parent"]
    return False


def _mentions(s: dict, e: dict) -> int:
    """How well a section matches a file by its commit, its run's time and its workload (0: not its commit)."""
    if not any(c[:7] in s["text"] for c in e["commits"]):
        return 0
    score = 1
    if e["time"] and e["time"] in s["title"]:
        score += 4
    elif e["time"] and e["time"] in s["text"]:
        score += 2
    if e["group"] != "other" and re.search(rf"\b{re.escape(e['group'])}\b", s["title"]):
        score += 1
    if e["tag"] and e["tag"] in s["text"]:
        score += 2
    return score


def _by_commit(candidates: list[dict], e: dict) -> list[dict]:
    scored = [(_mentions(s, e), s) for s in candidates]
    best = max((n for n, _ in scored), default=0)
    return [s for n, s in scored if n == best] if best else []


# --------------------------------------------------------------------------- the index


def link(s: dict) -> str:
    top = s
    while top["parent"] is not None and top["parent"]["level"] >= 2:
        top = top["parent"]
    title = s["title"] if top is s else f"{_short(top['title'])} › {s['title']}"
    title = re.sub(r"[`*]", "", title).replace("|", "/")
    if len(title) > 110:
        title = title[:107].rstrip() + "..."
    return f"[{s['file'].stem}: {title}](../../{s['file'].relative_to(REPO).as_posix()}#{s['anchor']})"


def _short(title: str) -> str:
    return title.split(":")[0]


def render(items: list[dict]) -> str:
    lines = [
        "# bench/results: an index",
        "",
        "Written by `python3 bench/results_index.py` (do not edit by hand; run it again after adding results).",
        "The results live in one compact file per workload, `WORKLOAD.jsonl` (the headings below link them): one JSON",
        "record a line per run, under the name its result file had. This index lists every record, grouped by",
        "workload: the date and commit it records (from its JSON where it has one, else its name), what it measured",
        "(read from the record: each engine's status and tokens/s for a `bench/run.py` result, the engine arguments",
        "of its command), and the section of the dated logs under docs/benchmarks/log/ that it backs",
        '([docs/benchmarks.md](../../docs/benchmarks.md) has the current figures). "by commit": no section names',
        "the file; the section is the one of the same day that names its commit (and its run's time, when known);",
        '"by hand": placed by bench/results_index.py\'s HINTS.',
        "",
        "A record by its name (the docs name results so, or by a pattern such as `2026-12-01_*_s9_*.json`):",
        "",
        "    python3 bench/results_index.py --show 2026-12-06_L8_3c6acea_h100_32k.json    # the record, as JSON",
        "    python3 bench/run.py --from-json 2026-12-06_L8_3c6acea_h100_32k.json         # its section of the log",
        "    python3 bench/trace.py 2026-12-01_W2_8cf53f1_s12.json --gaps                 # its last step's trace",
        "",
        "A new result goes into its workload's file, never as a loose file here (`--check` fails on one):",
        "",
        "    python3 bench/results_index.py --add $OUT/w1_24/results_W1.json --name DATE_W1_COMMIT_WHAT.json",
        "",
        "Names: `DATE_WORKLOAD[_CAP]_COMMIT_WHAT.ext`. A `bench/run.py` record keeps the run's `meta` and each",
        "engine's entry (status, error, tokens/s, s/step, `step_s`, losses, peak GPU and RSS, first step, setup,",
        "device, versions, `extra`: config, plan, estimate, ...) but not the trace's intervals: `extra.trace_summary`",
        "and `extra.trace_gaps` keep bench/trace.py's table and gaps of them. Its `.md` is a `rendered` record (the",
        "section renders again from the run). Other JSON is kept whole, text whole up to 20 KB (else its head, tail",
        "and the lines with figures), a folder as its files.",
        "",
        "Contents: "
        + ", ".join(f"[{key}](#{slug(title)})" for key, title in GROUPS if any(e["group"] == key for e in items)),
        "",
    ]
    known = {k for k, _ in GROUPS}
    for key, title in GROUPS + [(g, g) for g in sorted({e["group"] for e in items} - known)]:
        rows = [e for e in items if e["group"] == key]
        if not rows:
            continue
        lines += [
            f"## {title}",
            "",
            f"Records: [`{key}.jsonl`]({key}.jsonl), {len(rows)}.",
            "",
            "| file | date (UTC) | commit | cap | what it measured | backs |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for e in sorted(rows, key=lambda e: (e["date"], e["name"])):
            backs = "<br>".join(link(s) for s in e["backs"]) or "not found in the dated logs"
            if e["backs"] and e["how"] != "named":
                backs = f"{e['how']}: " + backs
            what = e["what"].replace("|", "/")
            lines.append(f"| `{e['name']}` | {e['date']} | `{e['commit'] or '?'}` | {e['cap']} | {what} | {backs} |")
        lines.append("")
    return "\n".join(lines)


def build() -> str:
    items = entries()
    secs = [s for f in sorted(LOGS.glob("20*.md")) for s in sections(f)]
    place(items, secs)
    return render(items)


def show(rec: dict) -> str:
    """A record as a reader wants it: a text file's text, a rendered section rendered, else the record as JSON."""
    if rec.get("kind") == "text":
        return record_text(rec)
    if rec.get("kind") == "rendered":
        return _bench_module("run").render(record(rec["from"]))
    return json.dumps(rec, indent=1, ensure_ascii=False)


def main(argv: list[str] | None = None) -> int:
    global RESULTS, INDEX
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check that README.md is up to date (and no loose file)")
    ap.add_argument("--show", nargs="+", metavar="NAME", help="print the records of these names or glob patterns")
    ap.add_argument("--add", nargs="+", metavar="FILE", help="fold these result files (or folders) into their files")
    ap.add_argument("--name", help="with one --add FILE: the name to keep it under (default: FILE's name)")
    ap.add_argument("--replace", action="store_true", help="with --add: overwrite a record of the same name")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the results folder (default: bench/results)")
    a = ap.parse_args(argv)
    RESULTS, INDEX = a.results.resolve(), a.results.resolve() / "README.md"
    where = INDEX.relative_to(REPO) if INDEX.is_relative_to(REPO) else INDEX
    if a.show:
        recs = [r for ref in a.show for r in find(ref)]
        if not recs:
            print(f"no record named {' '.join(a.show)} in {RESULTS}/*.jsonl", file=sys.stderr)
            return 1
        for r in recs:
            if len(recs) > 1:
                print(f"== {r['file']} ({r['group']}.jsonl)")
            print(show(r))
        return 0
    if a.add:
        if a.name and len(a.add) > 1:
            ap.error("--name names one --add FILE")
        # a run's .md after its .json: it is kept as a reference to the run when it renders the same
        for f in sorted((Path(x) for x in a.add), key=lambda p: p.suffix == ".md"):
            if not f.exists():
                ap.error(f"{f}: no such file")
            rec = add(f, a.name or f.name, a.replace)
            print(f"{f} -> {rec['group']}.jsonl#{rec['file']} ({rec['kind']})")
    text = build()
    if a.check:
        loose = loose_files()
        same = INDEX.is_file() and INDEX.read_text() == text
        print(f"{where} is {'up to date' if same else 'out of date: run bench/results_index.py'}")
        for p in loose:
            print(f"loose file {p.name}: fold it in with bench/results_index.py --add {p}")
        return 0 if same and not loose else 1
    INDEX.write_text(text)
    print(f"wrote {where}: {text.count(chr(10) + '| `')} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
