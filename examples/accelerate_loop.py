"""A custom accelerate loop on zerofit, one line added.

    python examples/accelerate_loop.py [--model DIR] [--steps 10] [--device cpu]

The one added line wraps the model before ``accelerator.prepare``: ``model = FSDP(model,
cpu_offload=CPUOffload(offload_params=True))`` with ``from zerofit.fsdp import FullyShardedDataParallel as
FSDP``. The ``Accelerator``, ``accumulate``, ``backward``, ``clip_grad_norm_`` and the optimizer and scheduler
steps are as written; they drive zerofit's engine (docs/fsdp.md, "accelerate"). Without ``--model`` a tiny
Llama is built from a config (CPU, seconds).
"""

import argparse

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import CPUOffload
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from zerofit.fsdp import FullyShardedDataParallel as FSDP

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
loader = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=B)  # synthetic tokens

accelerator = Accelerator(gradient_accumulation_steps=G, cpu=args.device == "cpu")
model = FSDP(model, cpu_offload=CPUOffload(offload_params=True), device_id=accelerator.device)  # the one added line
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)  # over the wrapped model
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))  # a short warm-up
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

step, total = 0, 0.0
for batch in loader:
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)
        total += loss.item() / G
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    if accelerator.sync_gradients:
        step += 1
        print(f"step {step} loss {total:.4f}")  # the mean over the step's micro-batches
        total = 0.0
