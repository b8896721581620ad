"""Errors as one line ([Note: one line per error], zerofit/cli_errors.py).

Each case as a user meets it: through the real command (typer's CliRunner, stdout and stderr together) with
the exit status docs/cli.md promises and one line naming the path or field and what to do, no traceback; or,
for the Python API, the exception's type and text. Each test reproduces what failed before the change (in its
docstring: what it did then).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import zerofit
from tests.support import tiny_models as tm
from tests.support.model_dirs import make_model_dir, write_data
from zerofit.cli import app

ROOT = Path(__file__).resolve().parents[2]
_CFG = {"device": "cpu", "precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": 1}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A model directory, data, and one finished run with two checkpoints (global_step1, global_step2)."""
    root = tmp_path_factory.mktemp("errors")
    model = make_model_dir(root / "model", "llama", torch.bfloat16)
    data = write_data(root / "data")
    run = root / "run"
    r = _train(model, data, run, "--steps", "2", "--save-every", "1")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["global_step1", "global_step2", "latest"]
    return root, model, data, run


def _train(model: Path, data: list[Path], out: Path, *extra: str, env: dict | None = None):
    args = [
        "train",
        "--model",
        str(model),
        "--data",
        *map(str, data),
        "--output",
        str(out),
        "--device",
        "cpu",
        "--seq-len",
        "32",
        "--micro-batch-size",
        "2",
        "--grad-accum",
        "1",
        "--precision",
        "fp32",
        "--eval-size",
        "2",
        "--no-progress",
        "--no-export",
        *extra,
    ]
    return CliRunner().invoke(app, args, env=env)


def _one_line(output: str, marker: str, *fragments: str) -> str:
    """The single line of ``output`` holding ``marker`` (the error's type), holding every fragment too; no
    traceback anywhere."""
    assert "Traceback" not in output and "╭" not in output, output
    lines = [line for line in output.splitlines() if marker in line]
    assert len(lines) == 1, output
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def _copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


# ---------------------------------------------------------------- zerofit train: the run folder and resume


def test_resume_from_a_corrupt_checkpoint_is_one_line_exit_2(workspace, tmp_path):
    """Before: exit 1 with a full traceback ending in ChecksumMismatchError, and no word on what to do."""
    root, model, data, run = workspace
    run = _copy_run(run, tmp_path / "run")
    shard = run / "checkpoints" / "global_step2" / "weights-00001-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    r = _train(model, data, run, "--steps", "3", "--resume")
    assert r.exit_code == 2, r.output
    _one_line(
        r.output,
        "ChecksumMismatchError",
        str(shard),
        "CRC32",
        "--resume cannot continue from it",
        f"writing its tag into {run / 'checkpoints' / 'latest'}",
        "global_step1",
        "without --resume",
    )


def test_resume_with_a_latest_of_non_utf8_bytes(workspace, tmp_path):
    """Before: a raw UnicodeDecodeError without a path (Python), a traceback (CLI)."""
    from zerofit.checkpoint import CheckpointCorruptError
    from zerofit.checkpoint.commit import read_latest

    root, model, data, run = workspace
    run = _copy_run(run, tmp_path / "run")
    latest = run / "checkpoints" / "latest"
    latest.write_bytes(b"\xff\xfeglobal_step2\x80")
    with pytest.raises(CheckpointCorruptError) as info:
        read_latest(run / "checkpoints")
    assert info.value.path == latest
    assert str(info.value).startswith(f"{latest}: holds 15 bytes that are not UTF-8 text")
    assert "global_step1, global_step2" in str(info.value) and "write the tag" in str(info.value)
    engine = zerofit.initialize(str(model), {**_CFG, "seq_len": 32})
    with pytest.raises(CheckpointCorruptError, match="not UTF-8"):
        engine.load_checkpoint(run / "checkpoints")
    engine.close()
    r = _train(model, data, run, "--steps", "3", "--resume")
    assert r.exit_code == 2, r.output
    _one_line(r.output, "CheckpointCorruptError", str(latest), "not UTF-8", "write the tag")


def test_full_disk_at_save_is_one_line_exit_1(workspace, tmp_path, monkeypatch):
    """Before: exit 1 with a full traceback through the training loop to CheckpointDiskFullError."""
    from zerofit.checkpoint import save as save_mod

    root, model, data, run = workspace
    monkeypatch.setattr(save_mod, "free_bytes", lambda p: 1000)  # the disk as the saver sees it: full
    out = tmp_path / "full"
    r = _train(model, data, out, "--steps", "1")
    assert r.exit_code == 1, r.output
    _one_line(
        r.output,
        "CheckpointDiskFullError",
        str(out / "checkpoints"),
        "not enough disk space",
        "1000 bytes) are free",
        "Free space on that disk",
        "No checkpoint of this run was saved before",
    )
    # a run with checkpoints from before the disk filled up: --resume continues from the newest
    run = _copy_run(run, tmp_path / "run")
    r = _train(model, data, run, "--steps", "3", "--resume")
    assert r.exit_code == 1, r.output
    _one_line(
        r.output,
        "CheckpointDiskFullError",
        str(run / "checkpoints" / "global_step3"),
        "Then zerofit train --resume continues from global_step2",
    )


@pytest.fixture
def read_only_folder(tmp_path):
    """An existing folder nothing can be written in: a read-only tmpfs (root, where mounting is allowed), else
    a folder without write permission (a user that is not root)."""
    point = tmp_path / "ro"
    point.mkdir()
    if os.geteuid() != 0:
        point.chmod(0o555)
        yield point
        point.chmod(0o755)
        return
    if shutil.which("mount") is None:
        pytest.skip("root without a mount command: no folder is read-only to root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1M,ro", "tmpfs", str(point)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({r.stderr.strip() or r.returncode})")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def test_read_only_output_is_one_line_exit_2(workspace, read_only_folder):
    """Before: exit 1 with a full traceback ending in OSError [Errno 30] Read-only file system."""
    root, model, data, _ = workspace
    out = read_only_folder / "run"
    r = _train(model, data, out, "--steps", "1")
    assert r.exit_code == 2, r.output
    _one_line(r.output, "Error:", f"--output {out}: not writable", "choose a folder this user can write to")


def test_model_directory_with_a_config_field_of_the_wrong_type(workspace, tmp_path):
    """Before: exit 1 with a traceback ending in huggingface_hub's StrictDataclassFieldValidationError."""
    from zerofit.models import ModelDir, ModelDirError

    root, model, data, _ = workspace
    bad = tmp_path / "model"
    shutil.copytree(model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = "32"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError) as info:
        ModelDir.open(bad)
    assert str(info.value).startswith(f"{bad / 'config.json'}: field 'hidden_size': expected an integer, found \"32\"")
    assert "write hidden_size as an integer in config.json" in str(info.value)
    r = _train(bad, data, tmp_path / "out", "--steps", "1")
    assert r.exit_code == 2, r.output
    _one_line(
        r.output,
        "ModelDirError",
        str(bad / "config.json"),
        "'hidden_size'",
        "expected an integer",
        "write hidden_size as an integer",
    )
    # the same for estimate (only config.json is read), and for a value whose type is right but which the
    # model cannot be built with
    cfg["hidden_size"] = 30  # not a multiple of the 4 heads
    (bad / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["estimate", "--model", str(bad), "--cpu", "--no-measure"])
    assert r.exit_code == 2, r.output
    _one_line(r.output, "ModelDirError", str(bad / "config.json"), "hidden size (30)", "correct config.json")


def test_debug_shows_the_traceback(workspace, tmp_path):
    """``ZEROFIT_DEBUG=1`` (and ``zerofit --debug``) raise the error itself: the traceback is there to see."""
    from zerofit.models import ModelDirError

    root, model, data, _ = workspace
    bad = tmp_path / "model"
    shutil.copytree(model, bad)
    (bad / "config.json").write_text("[1, 2]")
    r = _train(bad, data, tmp_path / "out", "--steps", "1", env={"ZEROFIT_DEBUG": "1"})
    assert r.exit_code == 1 and isinstance(r.exception, ModelDirError), r.output
    assert "holds a JSON list" in str(r.exception)
    r = CliRunner().invoke(app, ["--debug", "estimate", "--model", str(bad), "--cpu", "--no-measure"])
    assert isinstance(r.exception, ModelDirError), r.output
    r = _train(bad, data, tmp_path / "out", "--steps", "1")
    assert r.exit_code == 2, r.output
    _one_line(r.output, "ModelDirError", "holds a JSON list")


def test_an_unexpected_error_is_one_line_exit_1_saying_how_to_see_it(workspace, tmp_path, monkeypatch):
    """An error zerofit did not anticipate (a bug) is one line too, saying so and how to get the traceback."""
    import zerofit.train

    root, model, data, _ = workspace

    def broken(opts, console, **kw):  # (the CLI also passes the run folder's lock)
        raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'\n(second line)")

    monkeypatch.setattr(zerofit.train, "run_training", broken)
    r = _train(model, data, tmp_path / "out", "--steps", "1")
    assert r.exit_code == 1, r.output
    _one_line(r.output, "TypeError", "'NoneType' (second line)", "did not expect", "zerofit --debug", "ZEROFIT_DEBUG=1")


# ---------------------------------------------------------------- the batch


def test_int32_token_ids_and_labels_train_as_int64_bitwise():
    """Before: int32 ids passed the batch check and the step failed in the loss ("expected target dtype to be
    Long or Byte, but got Int"). Now ids and labels of any integer dtype up to int64 or uint32 are converted
    to int64 on their way to the device: the same losses and weights, bitwise."""
    from zerofit.engine.step.batch import BatchError

    mb = tm.batches(1, 1)[0][0]
    with pytest.raises(RuntimeError, match="Long"):  # the premise: torch's loss takes int64 targets only
        F.cross_entropy(torch.zeros(4, 3), torch.zeros(4, dtype=torch.int32))
    runs = {}
    for dtype in (torch.int64, torch.int32, torch.uint8):
        torch.manual_seed(0)
        engine = zerofit.initialize(tm.llama(), _CFG)
        batch = {
            "input_ids": mb["input_ids"].to(dtype),
            "labels": mb["labels"].to(dtype if dtype != torch.uint8 else torch.int32),
        }
        losses = [engine.train_batch([batch]) for _ in range(2)]
        runs[dtype] = losses, {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        engine.close()
    ref_losses, ref_weights = runs[torch.int64]
    for dtype, (losses, weights) in runs.items():
        assert losses == ref_losses, dtype
        assert all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights), dtype
    engine = zerofit.initialize(tm.llama(), _CFG)
    with pytest.raises(BatchError, match=r"micro-batch 0\['input_ids'\] has dtype torch.uint64.*input_ids.long\(\)"):
        engine.train_batch([{"input_ids": mb["input_ids"].to(torch.uint64), "labels": mb["labels"]}])
    engine.close()


def test_a_batch_without_labels_is_refused_before_the_step():
    """Before: KeyError: 'loss' from transformers' ModelOutput in the middle of train_batch (loss_of read
    ``output["loss"]``, which a ModelOutput without a loss does not have)."""
    from zerofit.engine.model.adapter import loss_of
    from zerofit.engine.step.batch import BatchError

    mb = tm.batches(1, 1)[0][0]
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(), _CFG)
    with pytest.raises(BatchError) as info:
        engine.train_batch([{"input_ids": mb["input_ids"]}])
    msg = str(info.value)
    assert msg.startswith(
        "micro-batch 0 has no 'labels' (keys ['input_ids']): LlamaForCausalLM returns a loss only when given labels"
    ), msg
    assert "Pass labels with input_ids' shape" in msg and "-100" in msg
    assert engine.train_batch([mb]) > 0  # nothing of the refused step happened: the engine trains on
    with torch.no_grad():  # a forward without labels is still fine (evaluation, logits)
        assert engine(input_ids=mb["input_ids"]).loss is None
    engine.close()
    out = tm.llama()(input_ids=mb["input_ids"])  # what the generic path's loss_of reads
    with pytest.raises(ValueError, match="the model returned no loss: pass 'labels'"):
        loss_of(out)


# ---------------------------------------------------------------- the disk tier's folder


def test_nvme_path_on_proc_is_not_writable_not_zero_bytes_free(tmp_path, read_only_folder):
    """Before: offload.nvme_path: expected at least 1 bytes free, found 0 bytes free at /proc/zz (root passes
    os.access on /proc). Now: not writable, why, and what to do; the same for a read-only mount, in the
    config check, in the disk tier's own preflight (generation's --nvme) and at the command line."""
    from zerofit.config import ConfigError, check_nvme_path, load_config
    from zerofit.engine.disk.tier import DiskTierError, SwapFile

    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc")
    cfg = {**_CFG, "offload": {"optimizer_device": "nvme", "nvme_path": "/proc/zz"}}
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    msg = str(info.value)
    assert msg.startswith("offload.nvme_path: expected a writable folder"), msg
    assert "'/proc/zz' (missing, and its parent /proc is not writable: a virtual file system" in msg, msg
    assert "bytes free" not in msg and "choose a folder on a local disk this user can write to" in msg
    with pytest.raises(ConfigError, match="not writable: (a read-only file system|this user may not)"):
        check_nvme_path(read_only_folder / "tier")
    with pytest.raises(
        DiskTierError,
        match=r"nvme_path: .*'/proc/zz' \(missing, and its parent /proc is not "
        r"writable",
    ):
        SwapFile("/proc/zz", 1 << 20)
    assert not Path("/proc/zz").exists()
    r = CliRunner().invoke(app, ["estimate", "--shape", "llama-3.2-3b", "--cpu", "--no-measure", "--nvme", "/proc/zz"])
    assert r.exit_code == 2, r.output
    assert "not writable" in r.output and "/proc/zz" in r.output and "bytes free" not in r.output, r.output


# ---------------------------------------------------------------- a host budget too small


def test_the_host_budget_a_refusal_suggests_trains(workspace):
    """Before: the refusal rounded the budget it suggested to the nearest 0.01 MiB, often down ("at least
    1.38 MiB" for 1447249 bytes), and that budget was refused again. Now the figure is rounded up, checked
    by planning with it, and a step trains with it."""
    import re

    from zerofit.config import parse_bytes
    from zerofit.engine.plan.search import PlanError, fmt_at_least

    for n in (1, 1023, 1024, 1447249, 43059425, 2**30 - 1, 2**30 + 1, 123456789012):
        text = fmt_at_least(n)
        assert n <= parse_bytes(text.replace(" ", "")) <= n * 1.01 + 1, (n, text)
    root, model, data, _ = workspace
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    mb = {k: v % vocab for k, v in tm.batches(1, 1, T=32)[0][0].items()}  # ids of the model dir's vocabulary
    for seq in (32, 256):
        cfg = {**_CFG, "seq_len": seq, "max_host_memory": "1MiB"}
        with pytest.raises(PlanError) as info:
            zerofit.initialize(str(model), cfg)
        tip = re.search(r"max_host_memory\) of at least ([\d.]+) (\w+)", str(info.value))
        assert tip, str(info.value)
        budget = tip.group(1) + tip.group(2)
        engine = zerofit.initialize(str(model), {**cfg, "max_host_memory": budget})
        assert engine.plan.host_total <= parse_bytes(budget)
        if seq == 32:
            assert engine.train_batch([mb]) > 0
        engine.close()
    r = _train(model, data, root / "tight", "--steps", "1", "--max-host-memory", "1MiB")
    assert r.exit_code == 2, r.output
    line = _one_line(
        r.output,
        "PlanError",
        "no placement fits: host needs",
        "what would fit: a host budget (max_host_memory) of at least",
        "zerofit estimate shows the plans",
    )
    assert "smallest plan" not in line


# ---------------------------------------------------------------- engine.module on one rank

_MODULE_SCRIPT = r"""
import json, os, sys, time
import torch, zerofit
from tests.support import tiny_models as tm

rank = int(os.environ["RANK"])
torch.manual_seed(0)
engine = zerofit.initialize(tm.llama(), {"device": "cpu", "precision": "fp32", "micro_batch_size": 2,
                                         "gradient_accumulation_steps": 1})
data = tm.batches(2, 2)
engine.train_batch([data[0][rank]])
total = sum(float(p.detach().double().sum()) for p in engine.module.parameters())   # every rank: the collective
print(json.dumps({"rank": rank, "weights": total}), flush=True)
if rank == 0:
    t0 = time.monotonic()
    try:
        engine.module                                                        # rank 0 only: a mistake
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}),
              flush=True)
        sys.exit(3)
else:
    engine.train_batch([data[1][rank]])        # waits for rank 0 in the step's first collective
print(json.dumps({"rank": rank, "went_on": True}), flush=True)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_engine_module_on_one_rank_fails_fast_naming_the_collective(tmp_path):
    """Before: rank 0 waited in a plain barrier, silently, until the process group's timeout (600 s). Now
    engine.module read on every rank works, and read on one rank fails within the collective wait
    (ZEROFIT_COLLECTIVE_WAIT_S, 3 s here; 30 s by default), naming engine.module, the rank that did not read it
    and what to do; the other rank ends too ([Note: a failing rank])."""
    script = tmp_path / "module_one_rank.py"
    script.write_text(_MODULE_SCRIPT)
    port, wait = _port(), 3.0
    procs = []
    t0 = time.monotonic()
    for r in range(2):
        env = {
            **os.environ,
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "ZEROFIT_COLLECTIVE_WAIT_S": str(wait),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180))
        except subprocess.TimeoutExpired as e:
            for q in procs:
                q.kill()
            raise AssertionError("a rank still runs after 180 s: the one-rank engine.module hung") from e
    wall = time.monotonic() - t0
    records = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out, _ in outs]
    assert procs[0].returncode == 3, outs[0]
    assert procs[1].returncode not in (0, None), outs[1]
    assert records[0][0]["weights"] == records[1][0]["weights"]  # both read the same, once all had applied
    err = records[0][1]
    assert err["error"] == "CollectiveMismatchError", err
    assert err["message"].startswith("engine.module is a collective with 2 ranks"), err
    assert "rank 0 waited 3 s and rank 1 did not read it" in err["message"], err
    assert "Read engine.module on every rank" in err["message"] and "ZEROFIT_COLLECTIVE_WAIT_S" in err["message"]
    assert wait - 0.5 <= err["seconds"] < wait + 5, err
    assert not any(rec.get("went_on") for rec in records[1]), outs[1]
    assert wall < 150, wall
