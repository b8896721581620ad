"""TRL's GRPOTrainer on zerofit (``zerofit.hf.GRPOTrainer``, [Note: GRPO on the engine], zerofit/hf/rl.py) against
the same trainer run stock, on the CPU in fp32: full fine-tuning (its reference a second model), LoRA (its reference
the adapters switched off) and QLoRA over a 4-bit model. Both runs are fed the same completions (TRL's generation is
replaced by one that draws them from the prompt's tokens), so the rewards, advantages, KL and loss are computed on
equal inputs; the logged losses and KL and every trained weight then agree to fp32 rounding. Generation itself is
tested on its own: with TRL's sampling settings, the completions the engine generates are those of the stock run."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import zerofit.hf  # noqa: E402
from tests.integration.test_trl import LORA, TOK, _model  # noqa: E402  # TRL's tests' tiny Llama and tokenizer
from zerofit.engine.step.hooked import Hooked  # noqa: E402
from zerofit.hf.trainer import EngineModel  # noqa: E402
from zerofit.infer.engine import InferenceEngine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

COMMON = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    num_generations=4,
    max_completion_length=6,
    learning_rate=2e-3,
    max_grad_norm=0.0,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    disable_tqdm=True,
    use_cpu=True,
    seed=7,
    bf16=False,
    num_train_epochs=1,
)
PROMPTS = Dataset.from_dict({"prompt": ["The quick brown fox", "A stitch in time", "One two", "Hello there"] * 2})


def _length(completions, **_):
    return [len(c) / 10 for c in completions]


def _vowels(completions, **_):
    return [sum(ch in "aeiou" for ch in c) / 4 for c in completions]


def _fixed_completions(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """TRL's generation replaced: each prompt's completions drawn from a generator seeded by the prompt's tokens and
    its place among the repeats, so both runs (and each iteration) get the same ones; some end early at EOS."""
    out, seen = [], {}
    for ids in prompt_ids:
        k = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1
        g = torch.Generator().manual_seed(sum(ids) * 31 + k + 1000 * self.state.global_step)
        n = int(torch.randint(2, COMMON["max_completion_length"] + 1, (1,), generator=g))
        toks = torch.randint(5, len(TOK), (n,), generator=g).tolist()
        if n < COMMON["max_completion_length"]:
            toks[-1] = TOK.eos_token_id
        out.append(toks)
    return out, None


def _run(cls, tmp_path, name, make_model, *, fixed=True, peft=False, **kw):
    if fixed:
        cls = type(cls.__name__, (cls,), {"_generate_single_turn": _fixed_completions})
    t = cls(
        model=make_model(),
        args=trl.GRPOConfig(output_dir=str(tmp_path / name), **{**COMMON, **kw}),
        train_dataset=PROMPTS,
        processing_class=TOK,
        reward_funcs=[_length, _vowels],
        peft_config=LoraConfig(**LORA) if peft else None,
    )
    t.train()
    return t


def _logged(t, key):
    return [e[key] for e in t.state.log_history if key in e]


def _compare(stock, zf, keys=("loss", "kl")):
    for key in keys:
        a, b = _logged(stock, key), _logged(zf, key)
        assert len(a) == len(b) >= 2, key
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-7, msg=key)
    want = {n: p for n, p in stock.model.named_parameters() if p.requires_grad}
    got = {n: p for n, p in zf.zerofit_engine.module.named_parameters() if p.requires_grad}
    assert want and want.keys() == got.keys()
    for n, p in want.items():
        torch.testing.assert_close(got[n].detach(), p.detach(), rtol=1e-5, atol=1e-6, msg=n)
    return got


def _spy(monkeypatch, cls, name):
    calls = []
    original = getattr(cls, name)

    def spy(self, *a, **k):
        calls.append(torch.is_grad_enabled())
        return original(self, *a, **k)

    monkeypatch.setattr(cls, name, spy)
    return calls


def _folder(tmp_path):
    """TRL builds a full fine-tuning's reference from the policy's folder: the tiny model saved with its tokenizer."""
    path = tmp_path / "base"
    _model().save_pretrained(path)
    TOK.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo"])
def test_full_fine_tuning_with_a_reference_model(tmp_path, monkeypatch, loss_type):
    folder = _folder(tmp_path)
    kw = dict(beta=0.1, loss_type=loss_type, scale_rewards="group" if loss_type != "dr_grpo" else "none")
    stock = _run(trl.GRPOTrainer, tmp_path, "stock", lambda: folder, **kw)
    ref_calls = _spy(monkeypatch, InferenceEngine, "__call__")
    zf = _run(zerofit.hf.GRPOTrainer, tmp_path, "zf", lambda: folder, **kw)
    got = _compare(stock, zf)
    # the reference's forwards ran streamed from host memory, never as TRL's model moved to the device
    assert isinstance(zf._zerofit_ref, InferenceEngine) and ref_calls
    initial = LlamaForCausalLM.from_pretrained(folder)
    assert any(not torch.equal(got[n].detach(), p) for n, p in initial.named_parameters())  # it trained


def test_lora_with_its_adapters_off_as_the_reference_and_two_iterations(tmp_path, monkeypatch):
    kw = dict(beta=0.05, num_iterations=2)
    stock = _run(trl.GRPOTrainer, tmp_path, "stock", _model, peft=True, **kw)
    evaluations = _spy(monkeypatch, EngineModel, "forward")
    zf = _run(zerofit.hf.GRPOTrainer, tmp_path, "zf", _model, peft=True, **kw)
    got = _compare(stock, zf)
    assert not evaluations[0] and True in evaluations  # no_grad forwards (old policy, reference) and training ones
    assert zf._zerofit_ref is None  # no second model: the reference is the base with the adapters off
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in got.items() if "lora_B" in n)


def test_qlora_over_a_4bit_model(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    _model().save_pretrained(tmp_path / "base")

    def make():
        cfg = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
        return AutoModelForCausalLM.from_pretrained(
            tmp_path / "base", quantization_config=cfg, device_map="cpu", dtype=torch.float32
        )

    stock_cls = type("GRPOTrainer", (trl.GRPOTrainer,), {})
    original = stock_cls.__init__

    def fp32_adapters(self, *a, **k):  # TRL casts a 4-bit model's adapters to bf16; zerofit trains fp32 masters
        original(self, *a, **k)
        for p in self.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()

    stock_cls.__init__ = fp32_adapters
    stock = _run(stock_cls, tmp_path, "stock", make, peft=True, beta=0.05)
    zf = _run(zerofit.hf.GRPOTrainer, tmp_path, "zf", make, peft=True, beta=0.05)
    _compare(stock, zf)
    assert all(u.nf4 is not None for u in zf.zerofit_engine.blocks)


def test_completions_are_generated_from_the_engines_current_weights(tmp_path, monkeypatch):
    """TRL's own generation (sampling at its temperature, top_p, top_k, under its seed) on both: the engine's
    streamed generate gives the stock run's completions at every step, each from that step's weights, so the
    rewards logged agree too."""
    kw = dict(beta=0.0, temperature=0.9, top_p=0.95, top_k=20)
    stock = _run(trl.GRPOTrainer, tmp_path, "stock", _model, fixed=False, **kw)
    generated = _spy(monkeypatch, Hooked, "generate")
    zf = _run(zerofit.hf.GRPOTrainer, tmp_path, "zf", _model, fixed=False, **kw)
    _compare(stock, zf, keys=("loss", "reward", "completions/mean_length"))
    assert generated  # the engine's generate streamed the blocks ([Note: generation over the engine's weights])


def test_a_reward_function_that_raises_stops_the_run_as_in_trl(tmp_path):
    def broken(completions, **_):
        raise ValueError("the grader is down")

    for cls in (trl.GRPOTrainer, zerofit.hf.GRPOTrainer):
        t = cls(
            model=_model(),
            args=trl.GRPOConfig(output_dir=str(tmp_path / cls.__module__), **{**COMMON, "beta": 0.0}),
            train_dataset=PROMPTS,
            processing_class=TOK,
            reward_funcs=[broken],
        )
        with pytest.raises(ValueError, match="the grader is down"):
            t.train()


def test_the_fed_completions_are_what_both_runs_scored(tmp_path):
    """The replacement generation is in effect (the tests above compare equal inputs, not one generation twice):
    its completions end early at EOS, which the tiny model's own sampling over 6 tokens does not."""
    t = _run(trl.GRPOTrainer, tmp_path, "stock", _model, beta=0.0)
    assert min(_logged(t, "completions/mean_length")) < COMMON["max_completion_length"]


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_rloo_trainer_the_same_way(tmp_path, peft):
    """TRL's RLOOTrainer makes GRPOTrainer's calls (generation, scoring, the fused head's loss): with_zerofit puts
    it on the engine the same way, with the stock run's KL and weights on the same completions."""

    def fixed(self, prompt_ids, images, multimodal_fields):  # RLOO's generation returns the ids alone
        return _fixed_completions(self, prompt_ids, images, multimodal_fields, COMMON["num_generations"])[0]

    folder = _folder(tmp_path)
    out = []
    for name, cls in (("stock", trl.RLOOTrainer), ("zf", zerofit.hf.with_zerofit(trl.RLOOTrainer))):
        t = type(cls.__name__, (cls,), {"_generate_single_turn": fixed})(
            model=_model() if peft else folder,
            args=trl.RLOOConfig(output_dir=str(tmp_path / name), **{**COMMON, "beta": 0.05}),
            train_dataset=PROMPTS,
            processing_class=TOK,
            reward_funcs=[_length, _vowels],
            peft_config=LoraConfig(**LORA) if peft else None,
        )
        t.train()
        out.append(t)
    stock, zf = out
    assert zf.zerofit_engine is not None and any(abs(x) > 1e-4 for x in _logged(zf, "kl"))  # a KL that can differ
    _compare(stock, zf)
    assert (zf._zerofit_ref is None) == peft  # full fine-tuning: its reference streamed by an InferenceEngine
