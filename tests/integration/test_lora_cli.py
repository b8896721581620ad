"""`zerofit train --model DIR --lora`, `zerofit export` and `zerofit generate --adapter` on the CPU: a bf16 model
directory in; the run trains only the adapters over the frozen base, its checkpoints hold the trainable state and
the base by reference, a resume in a new process continues bitwise, the adapter out is PEFT's (docs/lora.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.support.model_dirs import make_model_dir, write_data
from tests.support.train_cli import train_args
from zerofit.cli import app

pytest.importorskip("peft")
REPO = Path(__file__).resolve().parents[2]
LORA = ("--lora", "--lora-r", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,down_proj")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = make_model_dir(root / "model", "llama", torch.bfloat16)
    other = make_model_dir(root / "other", "llama", torch.bfloat16, seed=1)
    data = write_data(root / "data")
    run = root / "run"
    r = CliRunner().invoke(app, train_args(model, data, run, *LORA, "--steps", "4", "--save-every", "2"))
    assert r.exit_code == 0, r.output
    return root, model, other, data, run, r.output


def _losses(run: Path) -> list[tuple[int, float]]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r]


def _base(model: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)


def test_a_lora_run_trains_the_adapters_and_writes_peft_s_adapter_folder(workspace):
    from peft import PeftModel

    root, model, _, _, run, output = workspace
    assert "trainable" in output and "of" in output and "the base is frozen" in output
    adapter = run / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and sorted(cfg["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    loaded = PeftModel.from_pretrained(_base(model), adapter)
    assert all(float(p.abs().sum()) > 0 for n, p in loaded.named_parameters() if "lora_B" in n)  # trained
    # the checkpoint holds the adapters and their moments only, and the base by reference
    ckpt = run / "checkpoints" / "global_step4"
    names = json.loads((ckpt / "weights.safetensors.index.json").read_text())["weight_map"]
    assert names and all("lora_" in n for n in names)
    from zerofit.checkpoint.commit import CommitRecord

    state = CommitRecord.read(ckpt).state
    assert state["lora_base"]["path"] == str(model)
    # zerofit export of the last checkpoint: the same adapter files
    r = CliRunner().invoke(app, ["export", str(run / "checkpoints"), str(root / "exported")])
    assert r.exit_code == 0 and "PEFT adapter" in r.output, r.output
    for n in ("adapter_config.json", "adapter_model.safetensors"):
        assert (root / "exported" / n).read_bytes() == (adapter / n).read_bytes()


def test_resume_in_a_new_process_is_bitwise(workspace):
    root, model, _, data, run, _ = workspace
    broken = root / "broken"
    shutil.copytree(run, broken)
    shutil.rmtree(broken / "checkpoints" / "global_step4")
    shutil.rmtree(broken / "adapter")
    (broken / "checkpoints" / "latest").write_text("global_step2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = "import sys; from zerofit.cli import app; app(sys.argv[1:], prog_name='zerofit')"
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            *train_args(model, data, broken, *LORA, "--steps", "4", "--save-every", "2", "--resume"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert _losses(broken) == _losses(run)
    for n in ("adapter_config.json", "adapter_model.safetensors"):
        assert (broken / "adapter" / n).read_bytes() == (run / "adapter" / n).read_bytes()


def test_a_checkpoint_for_another_base_is_refused_by_name(workspace, tmp_path):
    root, model, other, data, run, _ = workspace
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run / "checkpoints", elsewhere / "checkpoints")
    r = CliRunner().invoke(app, train_args(other, data, elsewhere, *LORA, "--steps", "6", "--resume"))
    assert r.exit_code == 2, r.output
    assert "trained over another base" in r.output and str(model) in r.output


def test_bad_lora_input_is_one_line_naming_what_to_do(workspace, tmp_path):
    root, model, _, data, _, _ = workspace
    r = CliRunner().invoke(
        app, train_args(model, data, tmp_path / "a", "--lora", "--lora-targets", "nope", "--steps", "1")
    )
    assert r.exit_code == 2 and "--lora-targets nope: matches no module" in r.output and "q_proj" in r.output, r.output
    quantized = tmp_path / "quantized"  # a config saying 4 bits over 16-bit files: inconsistent
    shutil.copytree(model, quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, train_args(quantized, data, tmp_path / "b", "--qlora", "--steps", "1"))
    assert r.exit_code == 2 and "quantization_config says 4 bits, but no weight" in r.output, r.output


def test_a_qlora_run_holds_the_base_in_nf4_and_its_merge_is_into_the_dequantized_base(workspace, tmp_path):
    """zerofit train --qlora: the blocks' linears quantized as they are read (the start-up summary says so, with
    their bytes), the adapters trained, PEFT's adapter folder out; zerofit export --merge of its checkpoint
    merges into the dequantized base, as the live engine's merge does."""
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from zerofit.models.nf4 import round_trip

    root, model, _, data, _, _ = workspace
    run = tmp_path / "qrun"
    r = CliRunner().invoke(
        app,
        train_args(
            model, data, run, "--qlora", "--lora-r", "4", "--lora-alpha", "8", "--steps", "2", "--save-every", "2"
        ),
    )
    assert r.exit_code == 0, r.output
    assert "its linears in NF4" in r.output, r.output
    losses = _losses(run)
    assert len(losses) == 2 and all(loss > 0 for _, loss in losses)
    adapter = run / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    r = CliRunner().invoke(app, ["export", str(run / "checkpoints"), str(tmp_path / "merged"), "--merge"])
    assert r.exit_code == 0, r.output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base = _base(model)
    peft_model = PeftModel.from_pretrained(base, adapter)
    layer = peft_model.base_model.model.model.layers[1].mlp.up_proj
    want = round_trip(layer.base_layer.weight.detach(), torch.float32) + layer.get_delta_weight("default")
    assert torch.equal(merged.model.layers[1].mlp.up_proj.weight.detach(), want)
    # the shell (embeddings, norms, head) as it was: never quantized
    assert torch.equal(merged.model.embed_tokens.weight, base.model.embed_tokens.weight)


def test_export_merge_writes_a_hugging_face_model_with_the_trained_logits(workspace):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, model, _, _, run, _ = workspace
    r = CliRunner().invoke(app, ["export", str(run / "checkpoints"), str(root / "merged"), "--merge"])
    assert r.exit_code == 0, r.output
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(_base(model), run / "adapter")
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-5, atol=1e-5)


def test_generate_with_the_base_and_the_adapter_equals_peft_s_generate(workspace, tmp_path):
    from peft import PeftModel
    from transformers import AutoTokenizer

    root, model, other, _, run, _ = workspace
    prompt = "The quick brown fox"
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(model),
            "--adapter",
            str(run / "adapter"),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "8",
            "--greedy",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--output",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    got = json.loads(out.read_text())["text"]
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = PeftModel.from_pretrained(_base(model), run / "adapter").eval()
    want = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert got == tok.decode(want[0, ids.shape[1] :], skip_special_tokens=True)
    # the same adapter in a chat: the answer is PEFT's generate of the chat template's prompt
    r = CliRunner().invoke(
        app,
        [
            "chat",
            "--model",
            str(model),
            "--adapter",
            str(run / "adapter"),
            "--max-new-tokens",
            "8",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
        ],
        input=prompt + "\n",
    )
    assert r.exit_code == 0, r.output
    chat_ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    want = ref.generate(input_ids=chat_ids, attention_mask=torch.ones_like(chat_ids), max_new_tokens=8, do_sample=False)
    assert "model> " + tok.decode(want[0, chat_ids.shape[1] :], skip_special_tokens=True) in r.output, r.output
    # an adapter for another base: refused from the files' headers, in one line
    gpt2 = make_model_dir(tmp_path / "gpt2", "gpt2", torch.bfloat16)
    r = CliRunner().invoke(
        app, ["generate", "--model", str(gpt2), "--adapter", str(run / "adapter"), "--prompt", "x", "--device", "cpu"]
    )
    assert r.exit_code == 2 and "trained over another base" in r.output, r.output


def test_chat_with_an_adapter_holds_a_conversation_of_three_turns(workspace):
    """Each answer is PEFT's generate on the conversation so far (the earlier answers in it): the inference engine
    over BASE + ADAPTER answers any number of times."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    root, model, _, _, run, _ = workspace
    said = ["The quick brown fox", "Hello there", "What is 2 plus 2?"]
    args = ["chat", "--model", str(model), "--adapter", str(run / "adapter"), "--max-new-tokens", "6"]
    r = CliRunner().invoke(app, [*args, "--device", "cpu", "--dtype", "fp32"], input="\n".join(said) + "\n")
    assert r.exit_code == 0, r.output
    assert r.output.count("model> ") == 3
    tok = AutoTokenizer.from_pretrained(model)
    ref = PeftModel.from_pretrained(_base(model), run / "adapter").eval()
    messages: list[dict] = []
    rest = r.output
    for text in said:
        messages.append({"role": "user", "content": text})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
        out = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        at = rest.index("model> " + answer)  # in order: each turn after the one before
        rest = rest[at + len(answer) :]
        messages.append({"role": "assistant", "content": answer})


def test_generate_bitwise_logits_and_tokens_through_the_inference_engine(workspace):
    """The inference engine over BASE + ADAPTER: PEFT's generate on plain PyTorch, tokens and logits bitwise."""
    from peft import PeftModel

    from zerofit.infer.engine import InferenceEngine

    root, model, _, _, run, _ = workspace
    ids = torch.arange(5, 17).view(2, 6)
    ref = PeftModel.from_pretrained(_base(model), run / "adapter").eval()
    eng = InferenceEngine.from_pretrained(model, adapter=run / "adapter", device="cpu", dtype="fp32")
    mask = torch.ones_like(ids)
    for new in (6, 9, 4):  # answers any number of times, each call's cache sized for it
        assert torch.equal(
            eng.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False),
            ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False),
        )
    with torch.no_grad():
        assert torch.equal(eng(input_ids=ids).logits, ref(input_ids=ids).logits)
    eng.close()


def test_merge_into_a_base_whose_config_and_files_disagree_is_refused_before_it_is_read(workspace, tmp_path):
    root, model, _, _, run, _ = workspace
    quantized = tmp_path / "quantized"
    shutil.copytree(model, quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (quantized / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(
        app, ["export", str(run / "checkpoints"), str(tmp_path / "m"), "--merge", "--base", str(quantized)]
    )
    assert r.exit_code == 2 and "quantization_config says 4 bits, but no weight" in r.output, r.output
    assert not (tmp_path / "m").exists()
