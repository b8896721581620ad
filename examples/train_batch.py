"""zerofit's native API: one call wraps the model, one call trains a step.

    python examples/train_batch.py [--model DIR] [--steps 10] [--device cpu]

The line that is zerofit's: ``engine = zerofit.initialize(model, config)`` (a model, or a Hugging Face model
folder read tensor by tensor, never held twice); then ``engine.train_batch(micro_batches)`` takes one optimizer
step over a list of micro-batch dicts. Without ``--model`` a tiny Llama is built from a config (CPU, seconds).
The same micro-batches come every step, so the loss falls as the model memorizes them.
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import zerofit

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="a Hugging Face model folder (default: a tiny Llama built from a config)")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()

B, T, G = 2, 32, 2  # micro-batch size, sequence length, micro-batches per step
config = {
    "device": args.device,
    "precision": "fp32" if args.device == "cpu" else "bf16",
    "micro_batch_size": B,
    "seq_len": T,
    "gradient_accumulation_steps": G,
    "gradient_clipping": 1.0,
    "optimizer": {"lr": 3e-3, "weight_decay": 0.01},
}

if args.model:
    model = args.model  # zerofit builds it on the meta device and reads its weights from the files
else:
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=256,
        )
    )

with zerofit.initialize(model, config) as engine:  # the one zerofit line
    vocab = engine.module.config.vocab_size
    ids = torch.randint(0, vocab, (G, B, T), generator=torch.Generator().manual_seed(0))  # synthetic tokens
    micro_batches = [{"input_ids": x, "labels": x} for x in ids]  # G micro-batches of (B, T), the same every step
    for step in range(1, args.steps + 1):
        loss = engine.train_batch(micro_batches)  # one optimizer step over the G micro-batches
        print(f"step {step} loss {loss:.4f}")
