"""PEFT LoRA on zerofit: PEFT's own LoRA model, trained by zerofit's engine.

    python examples/peft_lora.py [--model DIR] [--steps 10] [--device cpu] [--out ADAPTER_DIR]

The one zerofit line: ``engine = zerofit.initialize(peft_model, config)``; the model is PEFT's
``get_peft_model(model, LoraConfig(...))`` as written, its base frozen (held once, no optimizer state) and its
adapters trained (docs/lora.md). ``engine.save_pretrained(dir)`` writes PEFT's adapter folder, which
``PeftModel.from_pretrained(base, dir)`` loads. The same PEFT model goes through ``zerofit.deepspeed`` and
``zerofit.hf.Trainer`` too. Without ``--model`` a tiny Llama is built from a config (CPU, seconds).
"""

import argparse

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import zerofit

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="a Hugging Face model folder (default: a tiny Llama built from a config)")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--out", help="write the trained adapter (PEFT's folder) here")
args = parser.parse_args()

torch.manual_seed(0)
if args.model:
    base = AutoModelForCausalLM.from_pretrained(args.model)
else:
    base = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=256,
        )
    )
lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
model = get_peft_model(base, lora)
model.print_trainable_parameters()

B, T, G = 2, 32, 2  # micro-batch size, sequence length, micro-batches per step
config = {
    "device": args.device,
    "precision": "fp32" if args.device == "cpu" else "bf16",
    "micro_batch_size": B,
    "seq_len": T,
    "gradient_accumulation_steps": G,
    "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
}
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, base.config.vocab_size, (G, B, T), generator=g)
micro_batches = [{"input_ids": x, "labels": x} for x in ids]  # synthetic tokens, the same every step

with zerofit.initialize(model, config) as engine:  # the one zerofit line
    for step in range(1, args.steps + 1):
        loss = engine.train_batch(micro_batches)
        print(f"step {step} loss {loss:.4f}")
    if args.out:
        engine.save_pretrained(args.out)  # adapter_config.json, adapter_model.safetensors
        print(f"adapter written to {args.out}")
