"""A PyTorch FSDP training loop on zerofit, one import changed.

    python examples/fsdp_loop.py [--model DIR] [--steps 10] [--device cpu]

The one changed line is the import: ``from zerofit.fsdp import FullyShardedDataParallel as FSDP`` (was ``from
torch.distributed.fsdp import FullyShardedDataParallel as FSDP``). The loop as FSDP's tutorials write it then
drives zerofit's engine: the forward, ``(loss / G).backward()`` per micro-batch, ``model.clip_grad_norm_``,
``optimizer.step()``, an lr scheduler, ``optimizer.zero_grad()`` (docs/fsdp.md). Without ``--model`` a tiny
Llama is built from a config (CPU, seconds).
"""

import argparse
import functools

import torch
from torch.distributed.fsdp import CPUOffload, MixedPrecision
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from zerofit.fsdp import FullyShardedDataParallel as FSDP  # the one change: was `from torch.distributed.fsdp import`

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

policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
model = FSDP(
    model,
    auto_wrap_policy=policy,
    cpu_offload=CPUOffload(offload_params=True),
    mixed_precision=None if args.device == "cpu" else MixedPrecision(param_dtype=torch.bfloat16),
    device_id=torch.device(args.device),
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)  # over the wrapped model
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))  # a short warm-up

B, T, G = 2, 32, 2  # micro-batch size, sequence length, micro-batches per step
g = torch.Generator().manual_seed(0)
for step in range(1, args.steps + 1):
    total = 0.0
    for ids in torch.randint(0, model.config.vocab_size, (G, B, T), generator=g):  # synthetic tokens
        loss = model(input_ids=ids, labels=ids).loss
        (loss / G).backward()
        total += loss.item() / G
    norm = model.clip_grad_norm_(1.0)  # or torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    print(f"step {step} loss {total:.4f} grad_norm {norm:.3f}")
