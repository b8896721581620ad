"""A Hugging Face Trainer script on zerofit, one import changed.

    python examples/hf_trainer.py [--model DIR] [--steps 10] [--device cpu]

The one changed line is the import: ``from zerofit.hf import Trainer`` (was ``from transformers import
Trainer``). The Trainer keeps its loop, logging, schedules and callbacks; zerofit's engine takes the forward,
backward and AdamW step (docs/hf_trainer.md). Import ``zerofit.hf`` before building ``TrainingArguments``;
zerofit's own settings go in ``Trainer(..., zerofit_config={...})``. Without ``--model`` a tiny Llama is built
from a config (CPU, seconds).
"""

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TrainingArguments

from zerofit.hf import Trainer  # the one change: was `from transformers import Trainer`

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="a Hugging Face model folder (default: a tiny Llama built from a config)")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()

torch.manual_seed(0)
if args.model:
    model = AutoModelForCausalLM.from_pretrained(args.model)
else:
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=256,
        )
    )

B, T, G = 2, 32, 2  # micro-batch size, sequence length, micro-batches per step
ids = torch.randint(0, model.config.vocab_size, (args.steps * G * B, T), generator=torch.Generator().manual_seed(0))
train = [{"input_ids": x, "labels": x} for x in ids]  # synthetic tokens


with tempfile.TemporaryDirectory() as out:
    training_args = TrainingArguments(
        output_dir=out,
        max_steps=args.steps,
        per_device_train_batch_size=B,
        gradient_accumulation_steps=G,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=1,  # the Trainer prints each step's loss
        disable_tqdm=True,
        save_strategy="no",
        report_to=[],
        use_cpu=args.device == "cpu",
        bf16=args.device != "cpu",
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train)
    trainer.train()
