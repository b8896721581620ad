"""Reinforcement learning with GRPO on zerofit: TRL's GRPOTrainer, its one zerofit line, a verifiable reward.

    python examples/grpo_arithmetic.py [--model DIR] [--steps 10] [--device cpu] [--lora]

The one zerofit line: ``from zerofit.hf import GRPOTrainer`` instead of ``from trl import GRPOTrainer``. The
completions are generated from the weights being trained (the engine's own, streamed; no second copy), the policy's
log-probabilities come from TRL's fused head inside the engine's forward, and the reference is the same model with
its adapters off (``--lora``) or the initial model streamed from host memory (docs/rl.md). The task: sums of two
numbers; the reward is the share of the sum's digits the completion has in place (1 for the sum). Without
``--model`` a tiny Llama and a character-level tokenizer are built here (CPU, seconds); it learns little in a few
steps, the run shows the loop.
"""

import argparse
import random
import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig

from zerofit.hf import GRPOTrainer  # the one zerofit line (was: from trl import GRPOTrainer)

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="a Hugging Face model folder with its tokenizer (default: a tiny Llama)")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--lora", action="store_true", help="train LoRA adapters (the reference: the adapters off)")
args = parser.parse_args()


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per digit and sign: the sums' own alphabet."""
    chars = list("0123456789+= ")
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


random.seed(0)
pairs = [(random.randint(0, 49), random.randint(0, 49)) for _ in range(64)]
data = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})


def correct(completions, answer, **_):
    """The share of the sum's digits the completion has in place (1.0: the sum): a reward a program checks."""
    return [sum(a == b for a, b in zip(c.replace(" ", ""), want)) / len(want) for c, want in zip(completions, answer)]


model = args.model
if model is None:  # a tiny Llama, saved with its tokenizer: TRL builds a full fine-tuning's reference from a folder
    torch.manual_seed(0)
    tok = char_tokenizer()
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=len(tok),
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
    )  # fmt: skip
    model = tempfile.mkdtemp(prefix="grpo-model-")
    LlamaForCausalLM(config).save_pretrained(model)
    tok.save_pretrained(model)
tokenizer = AutoTokenizer.from_pretrained(model)
trainer = GRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(model) if args.lora else model,
    reward_funcs=correct,
    train_dataset=data,
    processing_class=tokenizer,
    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    if args.lora
    else None,
    args=GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo-run-"),
        max_steps=args.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_generations=8,
        max_completion_length=4,
        temperature=1.0,
        beta=0.04,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=args.device == "cpu",
        bf16=args.device != "cpu",
        seed=0,
    ),
)
trainer.train()
rewards = [round(e["reward"], 3) for e in trainer.state.log_history if "reward" in e]
print(f"mean reward per step: {rewards}")
