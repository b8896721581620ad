"""4-bit model folders as users download them ([Note: a 4-bit folder], src/zerofit/models/quantized.py): a model
loaded with ``BitsAndBytesConfig(load_in_4bit=True)`` and written by transformers' ``save_pretrained`` (nf4 and
fp4, double quantization on and off, the codes stored as uint8 or bf16, one file or sharded). The engine reads
their codes and quant states byte for byte, trains LoRA over them bitwise as PEFT over ``from_pretrained(FOLDER)``
on plain PyTorch (fp32, on the CPU), and the adapter it saves gives that model's logits on a fresh load; bad
folders are refused in one line naming the file."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tests.support import tiny_models as tm
from tests.support.model_dirs import make_model_dir

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from zerofit.cli import app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

G = 2
LR = 1e-2
CFG = {
    "device": "cpu",
    "precision": "fp32",
    "micro_batch_size": 2,
    "gradient_accumulation_steps": G,
    "optimizer": {"lr": LR, "weight_decay": 0.01},
}
LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
FORMS = {  # name: (quant_type, double quantization, quant_storage, max_shard_size)
    "nf4-double-uint8": ("nf4", True, torch.uint8, None),
    "nf4-bf16-storage": ("nf4", False, torch.bfloat16, None),
    "fp4-double-sharded": ("fp4", True, torch.uint8, "60KB"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A 16-bit folder (fp32 weights, the test tokenizer), and each 4-bit form of it, saved by transformers."""
    root = tmp_path_factory.mktemp("q4")
    base = make_model_dir(root / "fp32", "llama", torch.float32, layers=3)
    out = {"fp32": base}
    for name, (kind, double, storage, shard) in FORMS.items():
        q = AutoModelForCausalLM.from_pretrained(
            base, quantization_config=_bnb(kind, double, storage), dtype=torch.float32
        )
        q.save_pretrained(root / name, **({"max_shard_size": shard} if shard else {}))
        for f in base.glob("tok*"):
            (root / name / f.name).write_bytes(f.read_bytes())
        out[name] = root / name
    return out


def _bnb(kind="nf4", double=True, storage=torch.uint8):
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=kind,
        bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=storage,
    )


def _peft_over(folder, seed=1):
    """PEFT over ``from_pretrained(FOLDER)``: the folder's Linear4bit layers as bitsandbytes loads them."""
    q = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cpu")
    torch.manual_seed(seed)
    return get_peft_model(q, LoraConfig(**LORA)).train()  # (no dropout: train mode is the math of eval here)


def _engine_over(folder):
    """What ``zerofit train --model FOLDER --lora`` builds: PEFT over the meta model, the base read from the
    folder's files."""
    from zerofit.config import load_config
    from zerofit.engine.engine import Engine
    from zerofit.lora.model import from_model_dir
    from zerofit.lora.options import LoraOptions

    model, source = from_model_dir(folder, LoraOptions(r=4, alpha=8, targets="all-linear"), seed=0)
    return Engine(model, load_config(CFG).config, source=source)


def _assert_same_adapters(model, ref) -> None:
    """Every trained parameter of ``ref`` (plain PyTorch's run) bitwise the same in ``model``."""
    got = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    want = {n: p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    assert want and got.keys() == want.keys()
    for n, w in want.items():
        assert torch.equal(got[n], w), n


def _quant_states(model) -> dict:
    return {n + ".weight": m.weight for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"}


@pytest.mark.parametrize("form", FORMS)
def test_a_4bit_folder_is_read_byte_for_byte(folders, form):
    """Every linear of the blocks: its codes and every piece of its quant state are the ones bitsandbytes' own
    loading of the folder holds, taken as they are (nothing dequantized and quantized again)."""
    engine = _engine_over(folders[form])
    want = _quant_states(_peft_over(folders[form]))
    seen = 0
    for u in engine.blocks:
        prefix = engine.adapter.block_prefix(u.index) + "."
        assert u.nf4 is not None and len(u.nf4.names) == 7  # q k v o gate up down
        for i, n in enumerate(u.nf4.names):
            got, w = u.nf4.packed(i), want[prefix + n]
            qs = w.quant_state
            assert torch.equal(got.data, w.data.reshape(-1).view(torch.uint8)), n
            assert got.quant_type == qs.quant_type == FORMS[form][0]
            assert got.nested == qs.nested and got.blocksize == qs.blocksize
            assert torch.equal(got.absmax, qs.absmax.reshape(-1)), n
            if qs.nested:
                assert got.offset == float(qs.offset)
                assert torch.equal(got.absmax2, qs.state2.absmax.reshape(-1))
                assert torch.equal(got.code2, qs.state2.code.reshape(-1))
            seen += 1
    assert seen == 21 and engine.shell.nf4 is None
    engine.close()


def test_lora_over_a_4bit_folder_trains_as_peft_over_from_pretrained_and_its_adapter_reloads(folders, tmp_path):
    """The CLI's path (the base read from the folder) and PEFT over ``from_pretrained(FOLDER)`` through
    ``zerofit.initialize``, each against PEFT on plain PyTorch from the same adapters: losses and adapters bitwise;
    the adapter the engine saves, over a fresh ``from_pretrained(FOLDER)``, gives the trained model's logits."""
    import zerofit

    folder = folders["nf4-double-uint8"]
    data = tm.batches(3, G, seed=4)
    ref = _peft_over(folder)
    start = {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.01, fused=True)
    want = []
    for mbs in data:
        opt.zero_grad()
        losses = []
        for mb in mbs:
            loss = ref(**mb).loss
            (loss / G).backward()
            losses.append(loss.detach())
        opt.step()
        want.append(torch.stack(losses).mean().item())
    for build in ("files", "from_pretrained"):
        if build == "files":
            engine = _engine_over(folder)
        else:
            engine = zerofit.initialize(_peft_over(folder), CFG)
        with torch.no_grad():
            for n, p in engine.module.named_parameters():
                if p.requires_grad:
                    p.copy_(start[n])
        engine.weights_loaded()
        assert [engine.train_batch(mbs) for mbs in data] == want, build
        _assert_same_adapters(engine.module, ref)
        engine.save_pretrained(tmp_path / build)
        engine.close()
        # (in train mode, without dropout: in eval bitsandbytes' CPU backend repacks the weights for its own
        # inference kernel, in bf16, on both models alike)
        fresh = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tmp_path / build
        ).train()
        ids = data[0][0]["input_ids"]
        with torch.no_grad():
            assert torch.equal(fresh(input_ids=ids).logits, ref(input_ids=ids).logits), build


def test_zerofit_train_lora_over_a_4bit_folder_and_the_merge_says_it_is_dequantized(folders, tmp_path):
    """``--lora`` alone (the folder is 4-bit already): trains, writes the adapter; ``export --merge`` writes a
    16-bit model whose base is the dequantized one, and says so."""
    book = tmp_path / "book.txt"
    book.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    run = tmp_path / "run"
    r = CliRunner().invoke(
        app,
        [
            "train",
            "--model",
            str(folders["fp4-double-sharded"]),
            "--data",
            str(book),
            "--output",
            str(run),
            "--lora",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--micro-batch-size",
            "1",
            "--grad-accum",
            "1",
            "--seq-len",
            "32",
            "--precision",
            "fp32",
            "--no-progress",
        ],
    )
    assert r.exit_code == 0, r.output
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    merged = tmp_path / "merged"
    r = CliRunner().invoke(app, ["export", str(run / "checkpoints"), str(merged), "--merge"])
    assert r.exit_code == 0, r.output
    assert "dequantized" in r.output, r.output
    cfg = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in cfg
    AutoModelForCausalLM.from_pretrained(merged)  # a plain 16-bit model


def _rewrite(folder, dst, change):
    """A copy of ``folder`` with its one weight file's tensors passed through ``change(dict)``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    change(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


def _refused(folder, *fragments):
    (folder.parent / "book.txt").write_text("words and more words. " * 50)
    r = CliRunner().invoke(
        app,
        [
            "train",
            "--model",
            str(folder),
            "--data",
            str(folder.parent / "book.txt"),
            "--output",
            str(folder / "run"),
            "--lora",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--seq-len",
            "16",
            "--no-progress",
        ],
    )
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if fragments[0] in line]
    assert "Traceback" not in r.output and lines, r.output
    for f in fragments:
        assert f in r.output, (f, r.output)


def test_bad_4bit_folders_are_refused_in_one_line_naming_the_file(folders, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    folder = folders["nf4-double-uint8"]

    def wrong_shape(t):
        state = json.loads(bytes(t[name + ".quant_state.bitsandbytes__nf4"].tolist()))
        state["shape"] = [state["shape"][1], state["shape"][0] * 2]
        t[name + ".quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)

    _refused(_rewrite(folder, tmp_path / "shape", wrong_shape), "model.safetensors", name, "quant state's shape")
    _refused(
        _rewrite(folder, tmp_path / "absmax", lambda t: t.pop(name + ".absmax")),
        name + ".absmax",
        "is not in the folder",
    )
    sharded = folders["fp4-double-sharded"]
    import shutil

    cut = shutil.copytree(sharded, tmp_path / "truncated")
    shard = sorted(cut.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    _refused(cut, shard.name, "truncated")
    gone = shutil.copytree(sharded, tmp_path / "missing")
    sorted(gone.glob("model-*.safetensors"))[0].unlink()
    _refused(gone, "missing shard")
    for method, extra, said in (
        ("bitsandbytes", {"load_in_8bit": True}, "8 bits"),
        ("gptq", {"bits": 4}, "'gptq'"),
        ("awq", {"bits": 4}, "'awq'"),
        ("fp8", {}, "'fp8'"),
        ("compressed-tensors", {}, "'compressed-tensors'"),
    ):
        other = shutil.copytree(folders["fp32"], tmp_path / f"q-{method}-{said.strip(' ')}")
        cfg = json.loads((other / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": method, **extra}
        (other / "config.json").write_text(json.dumps(cfg))
        _refused(other, "config.json", said, "give the 16-bit model")


def test_a_4bit_folders_weights_do_not_train_without_lora(folders):
    import zerofit
    from zerofit.models.nf4 import QuantError

    with pytest.raises(QuantError, match="a 4-bit weight does not train"):
        zerofit.initialize(str(folders["nf4-double-uint8"]), CFG)


def test_the_deepspeed_door_and_the_hf_trainer_take_peft_over_a_4bit_folder(folders, tmp_path):
    """PEFT over ``from_pretrained(FOLDER)`` (its quant states as bitsandbytes loads them from the files) through
    zerofit.deepspeed.initialize, against the same model on plain PyTorch; and zerofit.hf.Trainer against
    transformers' own Trainer, every adapter bitwise."""
    from transformers import Trainer as PlainTrainer
    from transformers import TrainingArguments, default_data_collator

    import zerofit.deepspeed as deepspeed
    import zerofit.hf

    folder = folders["nf4-bf16-storage"]
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": G,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    ref, mine = _peft_over(folder), _peft_over(folder)
    engine, *_ = deepspeed.initialize(
        model=mine, config=ds, device="cpu", model_parameters=[p for p in mine.parameters() if p.requires_grad]
    )
    data = tm.batches(2, G)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.01, fused=True)
    for mbs in data:
        got = tm.ds_step(engine, mbs)
        losses = []
        for mb in mbs:
            loss = ref(**mb).loss
            (loss / G).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        assert abs(got - sum(losses) / G) <= 1e-6
    _assert_same_adapters(engine.module, ref)
    engine.close()

    g = torch.Generator().manual_seed(3)
    train = [{"input_ids": (ids := torch.randint(0, tm.VOCAB, (16,), generator=g)), "labels": ids} for _ in range(8)]

    def args(out):
        return TrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=2e-3,
            max_grad_norm=0.0,
            num_train_epochs=1,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            seed=7,
        )

    plain = PlainTrainer(
        model=_peft_over(folder),
        args=args(tmp_path / "plain"),
        train_dataset=train,
        data_collator=default_data_collator,
    )
    plain.train()
    zf = zerofit.hf.Trainer(
        model=_peft_over(folder), args=args(tmp_path / "zf"), train_dataset=train, data_collator=default_data_collator
    )
    zf.train()
    _assert_same_adapters(zf.zerofit_engine.module, plain.model)


_RSS_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {repo!r})
torch.set_num_threads(1)
import zerofit, bitsandbytes.functional, peft
from zerofit.config import load_config
from zerofit.engine.engine import Engine
from zerofit.lora.model import LoraOptions, from_model_dir
from zerofit.models import ModelDir
ModelDir.open({path!r}).build_meta()      # the imports of the model's code before the baseline

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                          # the peak (VmHWM) from the current RSS: the imports' peaks do not count
base = status("VmRSS:")
model, source = from_model_dir({path!r}, LoraOptions(r=4, alpha=8, targets="all-linear", qlora={qlora}))
cfg = {{"device": "cpu", "precision": "fp32", "micro_batch_size": 1, "seq_len": 16,
        "quantize_base": "nf4" if {qlora} else "none"}}
engine = Engine(model, load_config(cfg).config, source=source)
peak = status("VmHWM:")
planned = sum(v for k, v in engine.plan.host_bytes.items() if not k.startswith("device:")) + sum(
    v for k, v in engine.plan.host_bytes.items() if k.startswith("device:"))
nf4 = sum(u.nf4.nbytes for u in engine.units if u.nf4 is not None)
print(json.dumps({{"base": base, "peak": peak, "planned": planned, "nf4": nf4}}))
"""


@pytest.mark.parametrize("source", ["4-bit folder", "16-bit folder quantized as read"])
def test_loading_a_4bit_base_holds_the_plan_plus_one_tensor(tmp_path, source):
    """In a fresh process, RSS growth while the engine loads <= the plan's host bytes + the largest tensor (read
    in the compute dtype before it is quantized) + slack; a 16-bit copy of the base would not fit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

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
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "sixteen", max_shard_size="40MB")
    path = tmp_path / "sixteen"
    if source == "4-bit folder":
        q = AutoModelForCausalLM.from_pretrained(path, quantization_config=_bnb(), dtype=torch.bfloat16)
        q.save_pretrained(tmp_path / "four", max_shard_size="40MB")
        del q
        path = tmp_path / "four"
    block_linears = 8 * (4 * 512 * 512 // 2 + 3 * 512 * 1408)  # (grouped k/v: half of q's)
    largest = 8000 * 512 * 4
    repo = Path(__file__).resolve().parents[2] / "src"
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT.format(repo=str(repo), path=str(path), qlora=source != "4-bit folder")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grown, slack = r["peak"] - r["base"], 48 << 20
    assert grown <= r["planned"] + largest + slack, (grown, r)
    assert r["nf4"] < block_linears and grown < r["planned"] + 2 * block_linears, (grown, r)  # no 16-bit base held
