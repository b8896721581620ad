"""A Lightning Fabric loop on zerofit, one wrap added.

    python examples/lightning_fabric.py [--model DIR] [--steps 10] [--device cpu]

The one change wraps the model before ``fabric.setup``: ``fabric.setup(FSDP(model, ...), optimizer)`` with
``from zerofit.fsdp import FullyShardedDataParallel as FSDP``. ``fabric.backward``, ``fabric.no_backward_sync``,
``fabric.clip_gradients`` and ``optimizer.step()`` are as written; they drive zerofit's engine (docs/fsdp.md,
"Lightning"; the Lightning Trainer's change is the same wrap, in ``configure_model``). Without ``--model`` a tiny
Llama is built from a config (CPU, seconds).
"""

import argparse

import torch
from lightning.fabric import Fabric
from torch.distributed.fsdp import CPUOffload
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from zerofit.fsdp import FullyShardedDataParallel as FSDP

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="a Hugging Face model folder (default: a tiny Llama built from a config)")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()

fabric = Fabric(accelerator=args.device, devices=1, precision="32-true" if args.device == "cpu" else "bf16-mixed")
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

model = FSDP(model, cpu_offload=CPUOffload(offload_params=True), device_id=fabric.device)  # the one change
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)  # over the wrapped model
model, optimizer = fabric.setup(model, optimizer)

B, T, G = 2, 32, 2  # micro-batch size, sequence length, micro-batches per step
ids = torch.randint(0, model.config.vocab_size, (args.steps * G * B, T), generator=torch.Generator().manual_seed(0))
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], B))

total = 0.0
for i, batch in enumerate(loader):
    last = (i + 1) % G == 0
    with fabric.no_backward_sync(model, enabled=not last):  # accumulate G micro-batches per step
        loss = model(**batch).loss
        fabric.backward(loss / G)
    total += loss.item() / G
    if last:
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {(i + 1) // G} loss {total:.4f}")  # the mean over the step's micro-batches
        total = 0.0
