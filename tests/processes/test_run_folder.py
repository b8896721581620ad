"""One run per run folder, and a `--resume` that never destroys.

The run folder is held by one `zerofit train` ([Note: one writer per folder], checkpoint/lock.py): three at
once into one `--output`, two `--resume` at once, a holder killed with SIGKILL; an engine holds the folder it
saves checkpoints into. `--resume` picks its start by [Note: where a run starts] (train/resume.py): without
`latest` the newest complete checkpoint by recorded global step, bitwise as a run that was never stopped;
before any checkpoint a clean fresh start; pruning never removes what it started from or anything newer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from tests.support.train_cli import (
    REPO,
    args,
    assert_same_tensors,
    invoke,
    losses,
    records,
    spawn,
    tensors,
    wait_for_steps,
    workspace,
)
from zerofit.checkpoint import prune
from zerofit.checkpoint.commit import LATEST, RECORD, survey
from zerofit.checkpoint.format import Entry
from zerofit.checkpoint.lock import RUN_LOCK, SAVE_LOCK, CheckpointFolderInUseError, FolderInUseError, read_holder
from zerofit.checkpoint.save import Content, write_checkpoint
from zerofit.train.resume import RunFolderError, hold_run_folder, plan_start

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock and fork semantics of Linux")


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("runfolder")
    model, data = workspace(root)
    return root, model, data


def _holder(folder: Path, name: str) -> subprocess.Popen:
    """Another process that holds ``folder`` (through lock file ``name``) until it is killed."""
    code = (
        "import sys, time; from zerofit.checkpoint.lock import hold; "
        f"hold(sys.argv[1], {name!r}, what='zerofit train', advice='x', command='zerofit train --steps 9'); "
        "print('held', flush=True); time.sleep(600)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "held"
    return p


# ---------------------------------------------------------------------------------------------- the lock


def test_a_held_run_folder_is_refused_naming_its_holder_and_a_kill_releases_it(tmp_path):
    p = _holder(tmp_path, RUN_LOCK)
    try:
        with pytest.raises(FolderInUseError) as err:
            hold_run_folder(tmp_path)
        msg = str(err.value)
        assert msg.startswith(f"{tmp_path} is in use by pid {p.pid} on host {socket.gethostname()}, started "), msg
        assert msg.endswith(": `zerofit train --steps 9`; wait for it or choose another --output"), msg
        assert time.strftime("%H:") in msg
    finally:
        p.kill()  # SIGKILL: no cleanup of any kind ran
        p.wait()
    stale = tmp_path / RUN_LOCK
    assert read_holder(stale)["pid"] == p.pid  # its record stays behind; its lock went with it
    with hold_run_folder(tmp_path):
        assert read_holder(stale)["pid"] == os.getpid()
        with pytest.raises(FolderInUseError, match=f"another zerofit train of this process \\(pid {os.getpid()}"):
            hold_run_folder(tmp_path)  # a second open file description of the same file: refused
    assert not stale.exists(), "the holder removes its lock file on release"


# ---------------------------------------------------------------------------------------------- zerofit train


@pytest.fixture(scope="module")
def three(ws):
    """Three `zerofit train` started at once into one --output."""
    root, model, data = ws
    run = root / "shared"
    procs = [spawn(args(model, data, run, "--steps", "6", "--save-every", "2", "--keep", "3")) for _ in range(3)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    return run, procs, outs


@pytest.mark.slow
def test_three_runs_into_one_folder_one_trains_the_others_are_refused(three):
    run, procs, outs = three
    assert sorted(p.returncode for p in procs) == [0, 1, 1], outs
    winner = next(p for p in procs if p.returncode == 0)
    for p, out in zip(procs, outs):
        if p is winner:
            continue
        assert f"{run} is in use by pid {winner.pid} on host {socket.gethostname()}, started " in out, out
        assert "`zerofit train --model" in out and "wait for it or choose another --output" in out, out
        assert "Traceback" not in out and "zerofit train:" not in out, out  # refused before anything ran
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4, 5, 6]  # one run's records, each step once
    assert sum("load_seconds" in r for r in records(run)) == 1
    assert [f.tag for f in survey(run / "checkpoints")] == ["global_step2", "global_step4", "global_step6"]
    assert not (run / RUN_LOCK).exists()


@pytest.mark.slow
def test_two_resumes_at_once_one_continues(ws, three):
    root, model, data = ws
    run = three[0]
    procs = [
        spawn(args(model, data, run, "--steps", "8", "--save-every", "2", "--keep", "3", "--resume")) for _ in range(2)
    ]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert sorted(p.returncode for p in procs) == [0, 1], outs
    refused = outs[[p.returncode for p in procs].index(1)]
    assert "is in use by pid" in refused and "--resume" in refused, refused
    assert [s for s, _ in losses(run)] == list(range(1, 9))
    assert (run / "checkpoints" / LATEST).read_text() == "global_step8"


@pytest.mark.slow
def test_a_killed_run_releases_its_folder_and_resume_before_any_checkpoint_starts_cleanly(ws):
    """kill -9 before the first checkpoint: the next run takes the folder over; --resume finds nothing to
    resume, says so, and trains from scratch: the same losses as a run in a fresh folder."""
    root, model, data = ws
    run, fresh = root / "killed", root / "fresh"
    p = spawn(args(model, data, run, "--steps", "400"))
    wait_for_steps(p, run, 2)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert read_holder(run / RUN_LOCK)["pid"] == p.pid and not (run / "checkpoints").exists()
    res = invoke(args(model, data, run, "--steps", "3", "--resume"))
    assert res.exit_code == 0, res.output
    assert f"--resume: nothing to resume in {run / 'checkpoints'}" in res.output, res.output
    ref = invoke(args(model, data, fresh, "--steps", "3"))
    assert ref.exit_code == 0, ref.output
    assert losses(run) == losses(fresh) and [s for s, _ in losses(run)] == [1, 2, 3]  # the killed run's dropped
    assert_same_tensors(tensors(run / "checkpoints" / "global_step3"), tensors(fresh / "checkpoints" / "global_step3"))


def test_resume_without_latest_continues_from_the_newest_complete_checkpoint_bitwise(ws):
    """checkpoints 2, 4, 6, 8 of an 8-step run; `latest` and global_step8 deleted, global_step4 touched (newest
    by file time), a half-written global_step7 beside them: --resume continues from global_step6 (newest by
    recorded step) and ends bitwise where a run that never stopped ends; --keep 1 then keeps global_step6."""
    root, model, data = ws
    straight, broken = root / "straight8", root / "broken8"
    common = ("--steps", "8", "--save-every", "2", "--keep", "4")
    for run in (straight, broken):
        res = invoke(args(model, data, run, *common))
        assert res.exit_code == 0, res.output
    ck = broken / "checkpoints"
    (ck / LATEST).unlink()
    (ck / "global_step8").rename(ck / ".gone")
    (ck / ".gone" / RECORD).unlink()
    (ck / ".gone").rename(ck / "global_step7")  # a tag folder without a commit record
    os.utime(ck / "global_step4" / RECORD, (time.time() + 60, time.time() + 60))
    res = invoke(args(model, data, broken, "--steps", "8", "--save-every", "2", "--keep", "1", "--resume"))
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert f"--resume: {ck / LATEST} is missing; resuming from global_step6, the newest complete checkpoint" in out
    assert "global_step7 (no commit record" in out and "resumed from" in out and "at step 6 of 8" in out, out
    assert losses(broken) == losses(straight)  # bitwise: json keeps every float exactly
    assert_same_tensors(tensors(ck / "global_step8"), tensors(straight / "checkpoints" / "global_step8"))
    tags = sorted(p.name for p in ck.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert tags == ["global_step6", "global_step7", "global_step8"], tags  # 2 and 4 pruned; 6 it started from


def test_a_new_run_into_a_folder_with_checkpoints_is_refused(ws):
    root, model, data = ws
    run = root / "straight8"  # from the test above, or made here
    if not (run / "checkpoints").is_dir():
        assert invoke(args(model, data, run, "--steps", "2")).exit_code == 0
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    res = invoke(args(model, data, run, "--steps", "2"))
    assert res.exit_code == 2, res.output
    assert "holds checkpoints of an earlier run" in res.output and "--resume" in res.output, res.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


# ---------------------------------------------------------------------------------------------- where a run starts


def _ckpt(save_dir: Path, tag: str, step: int) -> None:
    t = torch.arange(8, dtype=torch.float32) + step
    write_checkpoint(save_dir, Content(tag, [Entry("w", (8,), torch.float32, t)], state={"global_step": step}))


def test_where_a_run_starts(tmp_path):
    ck = tmp_path / "checkpoints"
    start = plan_start(ck, resume=True)  # nothing saved yet
    assert not start.resume and "nothing to resume" in start.note
    ck.mkdir()
    (ck / ".tmp-global_step2-123-ab").mkdir()  # a first save killed: hidden, not a checkpoint
    assert not plan_start(ck, resume=True).resume
    assert not plan_start(ck, resume=False).resume
    (ck / "global_step2").mkdir()  # a tag folder without a record, and nothing else
    with pytest.raises(
        RunFolderError,
        match="no 'latest' and no complete checkpoint, only global_step2 "
        r"\(no commit record",
    ):
        plan_start(ck, resume=True)
    _ckpt(ck, "global_step4", 4)
    _ckpt(ck, "global_step6", 6)
    (ck / LATEST).unlink()
    os.utime(ck / "global_step4" / RECORD, (time.time() + 60, time.time() + 60))
    start = plan_start(ck, resume=True)
    assert (start.resume, start.tag, start.step) == (True, "global_step6", 6)
    assert start.protect == {"global_step6"}
    with pytest.raises(RunFolderError) as err:
        plan_start(ck, resume=False)
    assert err.value.exit_status == 2 and "global_step4 (step 4), global_step6 (step 6)" in str(err.value)
    (ck / LATEST).write_text("global_step4")  # latest names an older one: the newer one is protected
    start = plan_start(ck, resume=True)
    assert (start.tag, start.step, start.protect) == (None, 4, {"global_step4", "global_step6"})
    assert prune(ck, keep=1, protect=start.protect) == []
    (ck / LATEST).unlink()
    _ckpt(ck, "mine", 6)
    (ck / LATEST).unlink()
    with pytest.raises(RunFolderError, match="2 complete checkpoints are at step 6: global_step6, mine"):
        plan_start(ck, resume=True)


def test_prune_orders_by_recorded_step_not_file_time(tmp_path):
    for step in (6, 2, 4):
        _ckpt(tmp_path, f"global_step{step}", step)
        time.sleep(0.01)
    (tmp_path / LATEST).write_text("global_step6")
    os.utime(tmp_path / "global_step2" / RECORD, (time.time() + 60, time.time() + 60))
    assert prune(tmp_path, keep=2) == ["global_step2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step4", "global_step6", "latest"]


# ---------------------------------------------------------------------------------------------- save_checkpoint


def _engine():
    torch.manual_seed(0)
    e = zerofit.initialize(
        tm.llama(),
        {
            "device": "cpu",
            "precision": "fp32",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"lr": 1e-3},
        },
    )
    e.train_batch(tm.batches(1, 2)[0])
    return e


def test_save_checkpoint_into_a_folder_another_engine_holds_is_refused(tmp_path):
    a, b = _engine(), _engine()
    d = tmp_path / "ckpt"
    a.save_checkpoint(d, tag="a1")
    with pytest.raises(CheckpointFolderInUseError) as err:
        b.save_checkpoint(d, tag="b1")
    assert f"{d} is in use by another engine of this process (pid {os.getpid()}" in str(err.value)
    assert "close the engine that holds it first" in str(err.value)
    assert [f.tag for f in survey(d)] == ["a1"] and (d / LATEST).read_text() == "a1"
    a.save_checkpoint(d, tag="a2")  # the holder saves on
    a.close()  # and lets go
    b.save_checkpoint(d, tag="b1")
    assert (d / LATEST).read_text() == "b1"

    other = tmp_path / "other"
    p = _holder(other, SAVE_LOCK)  # another process holds it
    try:
        with pytest.raises(CheckpointFolderInUseError, match=f"in use by pid {p.pid} on host"):
            b.save_checkpoint(other)
        with pytest.raises(CheckpointFolderInUseError):
            prune(other, keep=1)
        assert not [x for x in other.iterdir() if x.name != SAVE_LOCK]
    finally:
        p.kill()
        p.wait()
    b.save_checkpoint(other)  # its lock went with it
    assert json.loads((other / SAVE_LOCK).read_text())["pid"] == os.getpid()
    b.close()
    assert not (other / SAVE_LOCK).exists() and not (d / SAVE_LOCK).exists()
