"""Exports keep the model's dtype unless told otherwise (engine.save_pretrained, zerofit export): an fp32 model
trained with a tiny learning rate keeps its small updates (a norm weight of 1 + 1e-5 is exactly 1.0 in bf16)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from typer.testing import CliRunner

import zerofit
from tests.support import tiny_models as tm
from tests.support.model_dirs import make_model_dir
from zerofit.checkpoint import export_checkpoint
from zerofit.cli import app

NORM = "model.norm.weight"


def _engine(model, precision="fp32"):
    return zerofit.initialize(
        model,
        {
            "device": "cpu",
            "precision": precision,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "optimizer": {"lr": 1e-5},
        },
    )


def _one_step(model, precision="fp32"):
    torch.manual_seed(0)
    engine = _engine(model, precision)
    engine.train_batch(tm.batches(1, 1)[0])
    return engine


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    got = {}
    for f in sorted(out.glob("model*.safetensors")):
        with safe_open(f, "pt") as st:
            got.update({k: st.get_tensor(k) for k in st.keys()})
    return got


def _config_dtype(out: Path) -> str:
    return json.loads((out / "config.json").read_text())["dtype"]


def _assert_fp32_kept(out: Path, master: dict[str, torch.Tensor]) -> None:
    got = _tensors(out)
    assert _config_dtype(out) == "float32"
    assert {t.dtype for t in got.values()} == {torch.float32}
    assert all(torch.equal(got[k], master[k]) for k in got)
    norm = got[NORM]
    assert not torch.all(norm == 1.0), "the tiny update was rounded away"
    assert torch.all(norm.to(torch.bfloat16) == 1.0)  # ... as a bf16 export would have: it differs from that
    assert not torch.equal(norm, norm.to(torch.bfloat16).float())


def test_an_fp32_model_exports_fp32_by_default_through_save_pretrained_and_zerofit_export(tmp_path):
    engine = _one_step(tm.llama())
    assert engine.model_dtype == torch.float32
    master = engine.master_state_dict()
    _assert_fp32_kept(Path(engine.save_pretrained(tmp_path / "direct")), master)

    engine.save_checkpoint(tmp_path / "ckpt")
    r = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "cli")])
    assert r.exit_code == 0, r.output
    assert "float32: the model's own dtype" in r.output
    _assert_fp32_kept(tmp_path / "cli", master)

    # dtype= still overrides, both ways in
    assert {t.dtype for t in _tensors(Path(engine.save_pretrained(tmp_path / "b", dtype="bf16"))).values()} == {
        torch.bfloat16
    }
    r = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "cli16"), "--dtype", "bf16"])
    assert r.exit_code == 0 and "bfloat16: as asked" in r.output, r.output
    got = _tensors(tmp_path / "cli16")
    assert _config_dtype(tmp_path / "cli16") == "bfloat16" and torch.all(got[NORM] == 1.0)
    engine.close()


def test_a_bf16_model_exports_bf16_and_dtype_overrides(tmp_path):
    engine = _one_step(tm.llama().to(torch.bfloat16), precision="bf16")
    assert engine.model_dtype == torch.bfloat16
    master = engine.master_state_dict()
    out = Path(engine.save_pretrained(tmp_path / "direct"))
    got = _tensors(out)
    assert _config_dtype(out) == "bfloat16" and {t.dtype for t in got.values()} == {torch.bfloat16}
    assert all(torch.equal(got[k], master[k].to(torch.bfloat16)) for k in got)
    engine.save_checkpoint(tmp_path / "ckpt")
    exported = export_checkpoint(tmp_path / "ckpt", tmp_path / "exported")
    assert _config_dtype(exported) == "bfloat16"
    assert all(torch.equal(a, _tensors(exported)[k]) for k, a in got.items())
    full = _tensors(export_checkpoint(tmp_path / "ckpt", tmp_path / "fp32", dtype="fp32"))
    assert all(torch.equal(full[k], master[k]) for k in full)
    engine.close()


def test_a_model_directory_exports_in_its_config_dtype(tmp_path):
    """The engine builds a directory's model in fp32 on the meta device: its dtype is config.json's."""
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        d = make_model_dir(tmp_path / name, dtype=dtype)
        engine = _engine(str(d))
        assert engine.model_dtype == dtype
        assert _config_dtype(Path(engine.save_pretrained(tmp_path / f"{name}-out"))) == name
        engine.close()
    # no dtype in config.json: the stored weights' dtype
    cfg = json.loads((tmp_path / "bfloat16" / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg.pop("torch_dtype", None)
    (tmp_path / "bfloat16" / "config.json").write_text(json.dumps(cfg))
    engine = _engine(str(tmp_path / "bfloat16"))
    assert engine.model_dtype == torch.bfloat16
    engine.close()


def test_a_checkpoint_without_a_recorded_dtype_exports_its_fp32_shards(tmp_path):
    """Checkpoints written before the model's dtype was recorded: the shards' own fp32 (nothing rounded)."""
    from zerofit.checkpoint.export import checkpoint_dtype

    assert checkpoint_dtype({}) == torch.float32
    assert checkpoint_dtype({"model_dtype": "bfloat16"}) == torch.bfloat16
