"""A DeepSpeed training script on zerofit: DeepSpeed's tutorial loop, one line changed.

    python examples/deepspeed_loop.py [--model DIR] [--steps 10] [--device cpu]

The one changed line is the import: ``import zerofit.deepspeed as deepspeed`` (was ``import deepspeed``).
``deepspeed.initialize`` takes DeepSpeed's arguments and JSON config (a dict here) and returns DeepSpeed's
tuple; ``engine(**batch)``, ``engine.backward(loss)`` and ``engine.step()`` run as written, one process
(docs/migration.md). Without ``--model`` a tiny Llama is built from a config (CPU, seconds).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import zerofit.deepspeed as deepspeed  # the one change: was `import deepspeed`

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
ds_config = {
    "train_micro_batch_size_per_gpu": B,
    "gradient_accumulation_steps": G,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "bf16": {"enabled": args.device != "cpu"},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
}
ids = torch.randint(0, model.config.vocab_size, (args.steps * G * B, T), generator=torch.Generator().manual_seed(0))
dataset = [{"input_ids": x, "labels": x} for x in ids]  # synthetic tokens

engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), training_data=dataset, config=ds_config, device=args.device
)  # device=: a zerofit config field beyond DeepSpeed's vocabulary
for batch in loader:
    loss = engine(**batch).loss
    engine.backward(loss)
    boundary = engine.is_gradient_accumulation_boundary()
    engine.step()
    if boundary:
        print(f"step {engine.global_steps} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e}")
engine.close()
