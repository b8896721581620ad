"""A Hugging Face model out: engine.save_pretrained, export of a checkpoint (Python and CLI), and the
tutorial's engine.module.save_pretrained; each loaded back with AutoModelForCausalLM.from_pretrained."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import zerofit
from tests.support import tiny_models as tm
from zerofit.checkpoint import MissingFileError, export_checkpoint
from zerofit.cli import app

G = 2
BUILDS = {"llama-tied": tm.llama, "llama": lambda: tm.llama(tied=False), "gpt2": tm.gpt2}


def _trained(build, precision="fp32"):
    torch.manual_seed(0)
    engine = zerofit.initialize(
        build(),
        {
            "device": "cpu",
            "precision": precision,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": G,
            "optimizer": {"lr": 1e-2},
        },
    )
    for mbs in tm.batches(3, G):
        engine.train_batch(mbs)
    return engine


def _ids():
    return tm.batches(1, 1, B=2, T=12, seed=11)[0][0]["input_ids"]


def _keys(out: Path) -> dict[str, torch.Tensor]:
    files = sorted(out.glob("model*.safetensors"))
    got = {}
    for f in files:
        with safe_open(f, "pt") as st:
            got.update({k: st.get_tensor(k) for k in st.keys()})
    return got


@pytest.mark.parametrize("name", list(BUILDS))
def test_save_pretrained_round_trip_fp32_and_bf16(tmp_path, name):
    engine = _trained(BUILDS[name])
    module = engine.module.eval()
    with torch.no_grad():
        want = module(_ids()).logits
    out = Path(engine.save_pretrained(tmp_path / "fp32", dtype="fp32", max_shard_size="40KB"))
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    canonical = {n for n, _ in module.named_parameters()}
    assert set(index["weight_map"]) == canonical  # tied weights once, by their first name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "float32" and cfg["architectures"] == [type(module).__name__]
    assert (out / "generation_config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, want)
    if module.config.tie_word_embeddings:
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight

    out16 = Path(engine.save_pretrained(tmp_path / "bf16", dtype="bf16"))  # one file
    assert (out16 / "model.safetensors").is_file() and not (out16 / "model.safetensors.index.json").exists()
    master = engine.master_state_dict()
    assert all(torch.equal(t, master[k].to(torch.bfloat16)) for k, t in _keys(out16).items())  # one rounding
    loaded16 = AutoModelForCausalLM.from_pretrained(out16, dtype=torch.bfloat16).eval()
    ref16 = copy.deepcopy(module).to(torch.bfloat16)
    with torch.no_grad():
        got, ref = loaded16(_ids()).logits, ref16(_ids()).logits
    torch.testing.assert_close(got, ref, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)
    engine.close()


def test_export_of_a_checkpoint_equals_save_pretrained_and_carries_tokenizer_files(tmp_path):
    engine = _trained(tm.llama, precision="bf16")
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel"}}')
    (src / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    engine.source_dir = src
    engine.save_checkpoint(tmp_path / "ckpt")
    direct = Path(engine.save_pretrained(tmp_path / "direct", dtype="bf16"))
    exported = export_checkpoint(tmp_path / "ckpt", tmp_path / "exported", dtype="bf16")
    a, b = _keys(direct), _keys(exported)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert (exported / f).read_bytes() == (direct / f).read_bytes(), f
    assert (exported / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    # stand-alone: from the tag folder too, without the engine; fp32 export is the master itself
    tag_dir = tmp_path / "ckpt" / "global_step3"
    r = CliRunner().invoke(app, ["export", str(tag_dir), str(tmp_path / "cli"), "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    master = engine.master_state_dict()
    got = _keys(tmp_path / "cli")
    assert got.keys() == a.keys() and all(torch.equal(got[k], master[k]) for k in got)
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["dtype"] == "float32"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "cli").eval()
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, engine.module.eval()(_ids()).logits)


def test_export_refusals(tmp_path):
    r = CliRunner().invoke(app, ["export", str(tmp_path), str(tmp_path / "out")])
    assert r.exit_code == 2 and "with a 'latest' file" in " ".join(r.output.split()), r.output
    torch.manual_seed(0)
    plain = zerofit.initialize(tm.PlainLM(), {"device": "cpu", "precision": "fp32", "micro_batch_size": 2})
    plain.save_checkpoint(tmp_path / "plain")
    with pytest.raises(MissingFileError, match="config.json: this checkpoint has no Hugging Face config.json"):
        export_checkpoint(tmp_path / "plain", tmp_path / "out")
    with pytest.raises(ValueError, match="expected one of bf16, fp16, fp32"):
        export_checkpoint(tmp_path / "plain", tmp_path / "out", dtype="int8")


def test_tutorial_module_save_pretrained_saves_the_trained_weights(tmp_path):
    engine = _trained(BUILDS["llama"], precision="bf16")
    engine.module.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    master = engine.master_state_dict()
    torch.manual_seed(0)
    init = BUILDS["llama"]()  # the weights training started from
    assert not torch.equal(
        master["model.layers.0.mlp.up_proj.weight"], dict(init.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    )
    for n, p in loaded.named_parameters():
        assert torch.equal(p.detach(), master[n]), n
