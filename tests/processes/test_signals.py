"""Ctrl-C and SIGTERM in `zerofit train`: [Note: signals of a run] (train/signals.py).

SIGTERM with the disk tier saves, exits 143, removes the swap file and resumes bitwise; a second Ctrl-C
(here: during the save the first one asked for) exits 130 at once, saving nothing and leaving nothing half
written; a Ctrl-C during start-up leaves a folder `--resume` accepts. The engine holds SIGTERM back as it
holds Ctrl-C when a program gives SIGTERM Python's SIGINT handler ([Note: Ctrl-C inside a step]).

The processes pause themselves at exact points with the test seams (``ZEROFIT_TRAIN_PAUSE_AT``,
``ZEROFIT_CHECKPOINT_PAUSE_AT``: SIGSTOP), so a signal lands where the test means it to.
"""

from __future__ import annotations

import copy
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerofit
from tests.support import tiny_models as tm
from tests.support.train_cli import args, assert_same_tensors, invoke, losses, spawn, tensors, wait_for_steps, workspace
from zerofit.checkpoint import seams
from zerofit.checkpoint.commit import LATEST, TMP_PREFIX, survey
from zerofit.engine.lifecycle import EngineState
from zerofit.train.resume import plan_start
from zerofit.train.signals import PAUSE_ENV, RunSignals, StopNow, exit_on_signal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP seams and /proc (Linux)")

TIER = ("--max-host-memory", "1.45MiB")  # this model's plan then keeps two blocks' moments on the disk


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    model, data = workspace(root)
    return root, model, data


def _swap_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("zerofit-swap-*.bin"))


def _stopped(pid: int, timeout: float = 240) -> None:
    """Until process ``pid`` has stopped itself at a seam (SIGSTOP)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                return
        except FileNotFoundError:
            break
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never reached its pause")


@pytest.mark.slow
def test_sigterm_with_the_disk_tier_saves_exits_143_removes_the_swap_file_and_resumes_bitwise(ws):
    root, model, data = ws
    straight, broken = root / "straight", root / "broken"
    steps = ("--steps", "120", "--keep", "2")  # a step takes ~10 ms on a fast machine: the signal lands early
    ref = invoke(args(model, data, straight, *steps, "--nvme", str(root / "nvme-straight"), *TIER))
    assert ref.exit_code == 0, ref.output
    assert "moments of blocks" in " ".join(ref.output.split()), ref.output  # the plan uses the tier

    nvme = root / "nvme-broken"
    p = spawn(args(model, data, broken, *steps, "--nvme", str(nvme), *TIER))
    wait_for_steps(p, broken, 3)
    assert _swap_files(nvme), "the tier's swap file exists while the run trains"
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 143, out
    assert "SIGTERM: finishing this step, then saving a checkpoint" in out, out
    stopped = max(s for s, _ in losses(broken))
    assert 3 <= stopped < 120, out
    assert (broken / "checkpoints" / LATEST).read_text() == f"global_step{stopped}"
    assert not _swap_files(nvme), "the swap file is removed (the engine was closed)"

    res = invoke(args(model, data, broken, *steps, "--nvme", str(nvme), *TIER, "--resume"))
    assert res.exit_code == 0, res.output
    assert f"at step {stopped} of 120" in " ".join(res.output.split()), res.output
    assert losses(broken) == losses(straight)  # bitwise: json keeps every float exactly
    assert_same_tensors(
        tensors(broken / "checkpoints" / "global_step120"), tensors(straight / "checkpoints" / "global_step120")
    )
    assert not _swap_files(nvme)


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_save_exits_130_at_once_leaving_nothing_half_written(ws):
    """The first Ctrl-C asks for a checkpoint; the second lands inside that save (paused at its shards
    phase): the save is abandoned whole, the process exits 130 (never -2), the swap file goes, and the folder
    is one --resume accepts (nothing was saved: it starts afresh)."""
    root, model, data = ws
    run, nvme = root / "twice", root / "nvme-twice"
    p = spawn(args(model, data, run, "--steps", "400", "--nvme", str(nvme), *TIER), **{seams.PAUSE_ENV: "shards"})
    wait_for_steps(p, run, 2)
    p.send_signal(signal.SIGINT)  # finish the step, then save: the save stops itself at "shards"
    _stopped(p.pid)
    p.send_signal(signal.SIGINT)  # delivered as it continues, inside the save
    p.send_signal(signal.SIGCONT)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 130, out
    assert "Ctrl-C again: stopped at once, without saving" in out and "Traceback" not in out, out
    ck = run / "checkpoints"
    assert not (ck / LATEST).exists() and not survey(ck), "no checkpoint, not even a partial tag folder"
    assert not list(ck.glob(f"{TMP_PREFIX}*")), "the abandoned save removed its temporary folder"
    assert not _swap_files(nvme), "the engine's resources were released at exit"
    assert not plan_start(ck, resume=True).resume  # --resume: nothing to resume, a fresh start


@pytest.mark.slow
def test_ctrl_c_during_start_up_leaves_a_folder_that_resume_accepts(ws):
    """Ctrl-C while the data is about to be read (a fresh run), then while a resumed run's engine is built (its
    swap file reserved, the checkpoint not yet loaded): exit 130 each time, and --resume then trains on."""
    root, model, data = ws
    run, nvme = root / "startup", root / "nvme-startup"
    for phase, extra, step in (("data", (), 0), ("engine", ("--resume", "--nvme", str(nvme), *TIER), 2)):
        p = spawn(args(model, data, run, "--steps", "4", *extra), **{PAUSE_ENV: phase})
        _stopped(p.pid)
        p.send_signal(signal.SIGINT)
        p.send_signal(signal.SIGCONT)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 130, out
        assert "Ctrl-C during start-up: stopped; nothing was trained" in out and "Traceback" not in out, out
        assert not _swap_files(nvme)
        if step:
            assert [s for s, _ in losses(run)] == [1, 2]  # the earlier run's records, untouched
        else:
            assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
        res = invoke(args(model, data, run, "--steps", str(step + 2), "--resume"))
        assert res.exit_code == 0, res.output
        said = " ".join(res.output.split())
        assert ("nothing to resume" if not step else f"at step {step} of {step + 2}") in said, res.output
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------- the handlers


def test_run_signals_phases():
    said = []
    with RunSignals(said.append) as sig:
        with pytest.raises(StopNow) as err:  # start-up: at once
            signal.raise_signal(signal.SIGTERM)
        assert err.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with RunSignals(said.append) as sig:
        sig.training = True
        signal.raise_signal(signal.SIGTERM)  # training: only a request
        assert sig.signum == signal.SIGTERM and "SIGTERM: finishing this step" in said[-1]
        with pytest.raises(StopNow, match="Ctrl-C again: stopped at once") as err:
            signal.raise_signal(signal.SIGINT)
        assert err.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with exit_on_signal():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_exit_at_once_ends_the_process_with_128_plus_the_signal(tmp_path):
    import subprocess

    code = (
        "import os, signal, sys; from zerofit.train.signals import exit_at_once; exit_at_once(); "
        "os.kill(os.getpid(), signal.SIGINT if sys.argv[1] == 'INT' else signal.SIGTERM); "
        "import time; time.sleep(30)"
    )
    for name, status in (("INT", 130), ("TERM", 143)):
        p = subprocess.run(
            [sys.executable, "-c", code, name],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
        )
        assert p.returncode == status, p.stderr


class _SignallingBlock(tm.Block):
    """A block that sends this process SIGTERM in its forward or backward once, when armed."""

    def __init__(self, d: int, index: int, arm: dict):
        super().__init__(d)
        self.index, self.arm = index, arm

    def forward(self, x, scale: float = 1.0):
        phase = "backward" if torch.is_grad_enabled() else "forward"
        if self.arm.get(phase) == self.index:
            self.arm.clear()
            signal.raise_signal(signal.SIGTERM)
        return super().forward(x, scale)


class _LM(tm.PlainLM):
    def __init__(self, arm: dict):
        super().__init__(24, 4)
        self.blocks = nn.ModuleList(_SignallingBlock(24, i, arm) for i in range(4))

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x, scale=0.5)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.fixture
def sigterm_as_ctrl_c():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT does not have Python's default handler here")
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("phase,applied", [("forward", False), ("backward", True)])
def test_the_engine_holds_sigterm_back_like_ctrl_c(sigterm_as_ctrl_c, phase, applied):
    """With SIGTERM given Python's SIGINT handler: in the forward the step stops at the next block with nothing
    applied; once its updates began (no clipping: during the backward) it runs to its end, then raises."""
    cfg = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "seq_len": 16,
        "optimizer": {"lr": 1e-3},
    }
    arm: dict = {}
    torch.manual_seed(0)
    model = _LM(arm)
    clean = zerofit.initialize(_clone(model), cfg)
    engine = zerofit.initialize(model, cfg)
    data = tm.batches(3, 2)
    engine.train_batch(data[0])
    arm[phase] = 1
    with pytest.raises(KeyboardInterrupt, match="finished the step" if applied else "SIGTERM: the step stopped"):
        engine.train_batch(data[1])
    assert engine.state is EngineState.OPEN and engine.global_step == (2 if applied else 1)
    assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler
    engine.train_batch(data[2])
    for mbs in data if applied else [data[0], data[2]]:
        clean.train_batch(mbs)
    a, b = engine.master_state_dict(), clean.master_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _clone(model: nn.Module) -> nn.Module:
    """The same model, never signalling."""
    twin = copy.deepcopy(model)
    for b in twin.blocks:
        b.arm = {}
    return twin
