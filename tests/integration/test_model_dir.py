"""Loading a Hugging Face model directory: built on the meta device, weights streamed tensor by tensor.

``zerofit.initialize(path, config)`` must give exactly the weights in the files (bf16, fp16, fp32;
sharded with an index; tied embeddings), train like the same model loaded by transformers, never hold
the model twice on the host, and refuse a bad directory with an error naming the file and the tensor.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import zerofit
from tests.support import tiny_models as tm
from zerofit.models import ModelDirError, WeightFileError

REPO = Path(__file__).resolve().parents[2]


def _save(model, path: Path, dtype=torch.bfloat16, shard="20KB") -> Path:
    copy.deepcopy(model).to(dtype).save_pretrained(path, max_shard_size=shard)
    return path


def _cfg(**kw):
    return {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 1e-3},
        **kw,
    }


@pytest.mark.parametrize(
    "build,dtype",
    [
        (tm.llama, torch.bfloat16),
        (lambda: tm.llama(tied=False), torch.float16),
        (tm.qwen2, torch.float32),
        (tm.gpt2, torch.bfloat16),
    ],
    ids=["llama-tied-bf16", "llama-fp16", "qwen2-fp32", "gpt2-bf16"],
)
def test_directory_loads_exactly_and_trains_like_transformers(tmp_path, build, dtype):
    torch.manual_seed(0)
    d = _save(build(), tmp_path / "m", dtype)
    assert (d / "model.safetensors.index.json").is_file(), "the fixture must be sharded"
    engine = zerofit.initialize(str(d), _cfg())
    assert engine.source_dir == d
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    master = engine.master_state_dict()
    for n, p in ref.named_parameters():  # tied: ref names the shared weight once, as the engine does
        assert torch.equal(master[n], p.detach()), n
    data = tm.batches(3, 2)
    losses = [engine.train_batch(mbs) for mbs in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(tm.reference_train(ref, data)))
    engine.close()


def test_model_built_by_the_caller_still_works():
    torch.manual_seed(0)
    model = tm.llama()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg())
    data = tm.batches(2, 2)
    assert [engine.train_batch(b) for b in data] == pytest.approx(tm.reference_train(ref, data), rel=1e-6)
    engine.close()


# ---------------------------------------------------------------------------------------------- errors


def _error(path, match):
    with pytest.raises((ModelDirError, WeightFileError), match=match):
        zerofit.initialize(str(path), _cfg())


def test_missing_path_and_missing_config(tmp_path):
    _error(tmp_path / "nope", r"nope: does not exist")
    (tmp_path / "empty").mkdir()
    _error(tmp_path / "empty", r"empty/config\.json: no such file")


def test_missing_shard_names_the_file_and_a_tensor(tmp_path):
    d = _save(tm.llama(), tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    _error(d, rf"{shard.name}: missing shard .*holds tensor 'model\.")


def test_truncated_shard_is_refused(tmp_path):
    d = _save(tm.llama(), tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    _error(d, rf"{shard.name}: truncated: tensor '.*' ends at byte")


def test_shape_mismatch_names_file_and_tensor(tmp_path):
    d = _save(tm.llama(), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    _error(
        d,
        r"model-\d+-of-\d+\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape \[\d+, \d+\], "
        r"the model built from config\.json expects",
    )


def test_missing_tensor_is_named(tmp_path):
    torch.manual_seed(0)
    model = tm.llama(tied=False)
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    d = tmp_path / "m"
    d.mkdir()
    model.config.save_pretrained(d)
    from safetensors.torch import save_file

    save_file(sd, str(d / "model.safetensors"))
    _error(d, r"tensor 'lm_head\.weight' is not in any weight file \(model\.safetensors\)")


def test_unknown_architecture_names_config(tmp_path):
    d = _save(tm.llama(), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["TotallyNewForCausalLM"]
    cfg["model_type"] = "totally_new"
    (d / "config.json").write_text(json.dumps(cfg))
    _error(d, r"config\.json: ")


def test_pickle_weights_only_are_refused_with_advice(tmp_path):
    d = tmp_path / "m"
    model = tm.llama()
    model.config.save_pretrained(d)
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    _error(d, r"no model\.safetensors.*found pytorch_model\.bin: convert them to safetensors")


# ---------------------------------------------------------------------------------------------- memory

_RSS_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {repo!r})
    torch.set_num_threads(1)
    import zerofit
    from zerofit.models import ModelDir
    ModelDir.open({path!r}).build_meta()      # warm the imports of the model's code before the baseline

    def status(key):                          # bytes of a VmRSS/VmHWM line of /proc/self/status
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                          # reset the peak (VmHWM) to the current RSS: import peaks do not count
    base = status("VmRSS:")
    engine = zerofit.initialize({path!r}, {{"device": "cpu", "precision": "fp32", "micro_batch_size": 1,
                                            "seq_len": 16}})
    peak = status("VmHWM:")
    keep = ("shell", "resident_blocks", "weight_slots", "grad_slots", "upload_staging", "assist_buffers")
    planned = sum(v for k, v in engine.plan.host_bytes.items() if not k.startswith("device:")) + sum(
        engine.plan.host_bytes.get("device:" + k, 0) for k in keep)
    print(json.dumps({{"base": base, "peak": peak, "planned": planned}}))
""")


def test_loading_peak_rss_is_plan_plus_one_tensor(tmp_path):
    """In a fresh process: RSS growth while loading <= the plan's host state + the largest tensor + slack.
    Holding the model twice (a state dict, then the engine's copy) would exceed it by the model's size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8000,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    d = _save(model, tmp_path / "m", torch.bfloat16, shard="40MB")
    fp32_bytes = sum(p.numel() for p in model.parameters()) * 4
    largest = max(p.numel() for p in model.parameters()) * 4
    del model
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT.format(repo=str(REPO), path=str(d))],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grown = r["peak"] - r["base"]
    slack = 64 << 20  # allocator arenas, the rotary tables, the plan's small buffers
    assert grown <= r["planned"] + largest + slack, (grown, r, largest)  # the docstring's bound
    # tighter, so that the test can fail: the state actually touched on the CPU is master + two moments
    # (12 B/param); a second copy of the model (4 B/param more) would not fit in the slack
    assert grown <= 3 * fp32_bytes + largest + slack, (grown, fp32_bytes)
    assert grown >= 3 * fp32_bytes - slack  # and the measurement saw that state being built
