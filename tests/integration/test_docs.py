"""The docs say what the code does: every Python block of README.md and docs/*.md runs on the CPU as written
(tests/support/doc_blocks.py: the paths and names the text around it defines made first), every ``zerofit``
command line in them names a command and options the CLI has, and the console examples print what they show."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tests.support import doc_blocks
from zerofit.cli import app

ROOT = Path(__file__).resolve().parents[2]
PYTHON_BLOCKS = doc_blocks.python_blocks()


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict:
    """Every Python block's result, from one process (they take about half a minute together)."""
    out = tmp_path_factory.mktemp("docs") / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    r = subprocess.run(
        [sys.executable, "-m", "tests.support.doc_blocks", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b["id"] for b in PYTHON_BLOCKS])
def test_the_python_block_runs_on_a_cpu_as_written(ran, block):
    assert ran[block["id"]] == "ok", f"{block['id']}:\n{block['body']}\n{ran[block['id']]}"


def test_the_blocks_left_out_still_exist_and_are_few():
    every = {(b["file"], b["first"]) for b in doc_blocks.blocks()}
    assert set(doc_blocks.NOT_ON_A_CPU) <= every
    assert len(doc_blocks.NOT_ON_A_CPU) <= 2 and len(PYTHON_BLOCKS) >= 15


def _command_lines() -> list[tuple[str, list[str]]]:
    """(block id, the arguments after ``zerofit``) of every zerofit command in a bash or console block."""
    out = []
    for b in doc_blocks.blocks():
        if b["lang"] not in ("bash", "console", "sh", "shell"):
            continue
        text = re.sub(r"\\\n\s*", " ", b["body"])
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            elif b["lang"] == "console":
                continue  # output
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            if words and words[0] == "zerofit":
                out.append((b["id"], [w.strip("[]") for w in words[1:]]))
    return out


COMMANDS = _command_lines()


@pytest.mark.parametrize("where,args", COMMANDS, ids=[f"{w}:{' '.join(a[:2])}" for w, a in COMMANDS])
def test_every_zerofit_command_in_the_docs_is_one_the_cli_has(where, args):
    cmd = typer.main.get_command(app)
    words = list(args)
    while words and hasattr(cmd, "commands") and not words[0].startswith("-"):
        name = words.pop(0)
        assert name in cmd.commands, f"{where}: zerofit has no command {name!r}"
        cmd = cmd.commands[name]
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    passes_on = cmd.context_settings.get("ignore_unknown_options") or cmd.context_settings.get("allow_extra_args")
    if passes_on and not cmd.params:
        return  # every argument is passed on (zerofit deepspeed: DeepSpeed's launcher's)
    for w in words:
        if passes_on and not w.startswith("-"):
            break  # the script's own arguments from here (zerofit deepspeed script.py ...)
        if w.startswith("--"):
            assert w.split("=")[0] in known, f"{where}: zerofit {cmd.name} has no option {w}"


def test_the_config_show_example_prints_what_the_docs_show(tmp_path):
    text = (ROOT / "docs" / "cli.md").read_text()
    shown = re.search(r"\$ zerofit config show bad.json\n(.*)\n\$ echo \$\?\n(\d+)", text)
    assert shown, "docs/cli.md's config show example"
    (tmp_path / "bad.json").write_text(json.dumps({"train_batch_size": 8, "zero_optimisation": {"stage": 3}}))
    os.chdir(tmp_path)
    try:
        r = CliRunner().invoke(app, ["config", "show", "bad.json"])
    finally:
        os.chdir(ROOT)
    assert r.exit_code == int(shown.group(2))
    assert " ".join(r.output.split()) == shown.group(1)
