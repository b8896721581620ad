"""The ``zerofit`` command, driven through typer's CliRunner (stdout and stderr together)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from zerofit.cli import app

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
FIXTURE_FILES = sorted(FIXTURES.glob("*.json")) if FIXTURES.is_dir() else []
needs_fixtures = pytest.mark.skipif(not FIXTURE_FILES, reason="shared/fixtures not beside the repository")
runner = CliRunner()
TINY = ["--steps", "3", "--micro-batch-size", "2", "--seq-len", "32", "--sample-tokens", "8"]


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_help_lists_the_commands():
    r = invoke("--help")
    assert r.exit_code == 0
    for name in ("train", "config", "doctor"):
        assert name in r.output


# ---------------------------------------------------------------- config show


@needs_fixtures
@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name)
def test_config_show_every_fixture(path):
    r = invoke("config", "show", path)
    assert r.exit_code == 0, r.output
    assert "zerofit configuration" in r.output and "deepspeed" in r.output
    assert '"micro_batch_size"' in r.output and "DeepSpeed keys" in r.output


def test_config_show_zerofit_json(tmp_path):
    path = tmp_path / "zf.json"
    path.write_text(json.dumps({"micro_batch_size": 2, "gradient_accumulation_steps": 2, "precision": "fp32"}))
    r = invoke("config", "show", path)
    assert r.exit_code == 0, r.output
    assert '"train_batch_size": 4' in r.output


@pytest.mark.parametrize(
    "config, field",
    [
        ({"train_batch_size": 8, "zero_optimisation": {"stage": 3}}, "zero_optimisation"),
        (
            {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
            "train_batch_size",
        ),
        ({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16"),
        ({"micro_batch_size": -1}, "micro_batch_size"),
    ],
)
def test_config_show_bad_config_exits_2_naming_the_field(tmp_path, config, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    r = invoke("config", "show", path)
    assert r.exit_code == 2, r.output
    assert field in r.output


def test_config_show_missing_or_broken_file(tmp_path):
    r = invoke("config", "show", tmp_path / "nope.json")
    assert r.exit_code == 2 and "nope.json" in r.output
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    r = invoke("config", "show", broken)
    assert r.exit_code == 2 and "JSON" in r.output


# ---------------------------------------------------------------- doctor


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_doctor_json_without_gpu_in_under_30s(tmp_path):
    r = invoke("doctor", "--disk", tmp_path, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["gpu"]["available"] is False and report["gpu"]["reason"]
    assert report["seconds"] < 30
    assert report["optimizer"]["params_per_s"] > 0
    assert report["disk"]["bytes_tested"] > 0 and report["host"]["total_bytes"] > 0
    assert report["errors"] == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_doctor_table_says_there_is_no_gpu(tmp_path, monkeypatch):
    from zerofit.cli import doctor

    real = doctor.run_doctor
    monkeypatch.setattr(doctor, "run_doctor", lambda disk: real(disk, optimizer_params=1 << 20, disk_bytes=16 << 20))
    r = invoke("doctor", "--disk", tmp_path)
    assert r.exit_code == 0, r.output
    assert "none" in r.output and "CPU AdamW" in r.output and "host RAM" in r.output and "disk" in r.output


def test_doctor_disk_must_exist(tmp_path):
    r = invoke("doctor", "--disk", tmp_path / "missing")
    assert r.exit_code == 2 and "not a folder" in r.output


# ---------------------------------------------------------------- train


@pytest.mark.timeout(300)
def test_train_tiny_budget():
    r = invoke("train", *TINY)
    assert r.exit_code == 0, r.output
    for text in ("zerofit train", "summary", "training loss", "held-out loss", "tokens/s", "sample"):
        assert text in r.output
    assert "where the time of one step went" in r.output


@needs_fixtures
@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name)
@pytest.mark.timeout(300)
def test_train_with_each_fixture(path):
    r = invoke(
        "train",
        "--config",
        path,
        "--steps",
        "1",
        "--seq-len",
        "32",
        "--sample-tokens",
        "0",
        "--micro-batch-size",
        "1",
        "--grad-accum",
        "2",
    )
    assert r.exit_code == 0, r.output
    assert "deepspeed" in r.output and "summary" in r.output


def test_train_bad_config_exits_2(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"train_batch_size": 8, "optimiser": {}}))
    r = invoke("train", "--config", path, *TINY)
    assert r.exit_code == 2 and "optimiser" in r.output


def test_train_bad_option_exits_2():
    assert invoke("train", "--precision", "fp8").exit_code == 2
    r = invoke("train", "--device", "abacus", *TINY)
    assert r.exit_code == 2 and "--device abacus" in r.output
    r = invoke("train", "--max-gpu-memory", "lots", *TINY)
    assert r.exit_code == 2 and "max_gpu_memory" in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_train_on_cuda_without_a_gpu_exits_2():
    r = invoke("train", "--device", "cuda", *TINY)
    assert r.exit_code == 2 and "--device" in r.output


def test_config_keys_lists_every_key_of_the_design_table():
    """Every DeepSpeed key CONFIG.md's table names is known, with its status."""
    from typer.testing import CliRunner

    from zerofit.cli import app

    out = CliRunner().invoke(app, ["config", "keys"])
    assert out.exit_code == 0, out.output
    rows = {line.split()[0]: line.split()[1] for line in out.output.splitlines() if line.strip()}
    for key in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "fp16.loss_scale",
        "fp16.initial_scale_power",
        "fp16.loss_scale_window",
        "fp16.hysteresis",
        "fp16.min_loss_scale",
        "bf16.enabled",
        "zero_optimization.stage",
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_param.buffer_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.sub_group_size",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "aio.block_size",
        "aio.queue_depth",
        "steps_per_print",
        "wall_clock_breakdown",
    ):
        assert key in rows, key
        assert rows[key] in ("honoured", "mapped", "not-applicable"), (key, rows[key])
