"""python3 bench/engine_unsloth.py --workload W6a --cap none --result /tmp/unsloth.json
python3 bench/engine_unsloth.py --workload W6a --make-folder /tmp/unsloth_W6a      # the weights folder alone
python3 bench/run.py --workload W6a --engines unsloth,plain,plain-liger,zerofit-fast --steps 4 --cap 24GiB --out $OUT

Unsloth (``unsloth.FastLanguageModel``), the peer users pick for LoRA and QLoRA on one card, in the GPU with no cap.

Unsloth loads a model from a folder, so the workload's model is first written as one: its ``LlamaConfig``
(common.llama_config), random weights in bf16 initialised on the GPU as the in-GPU peer's are
(common.build_model), safetensors shards, and a word-level tokenizer of the workload's vocabulary (nothing is
downloaded; ``HF_HUB_OFFLINE=1``). That happens in a process of its own (``--make-folder``), so neither its time
nor its GPU memory counts as Unsloth's; ``--folder`` reuses one (default ``/tmp/zerofit_unsloth/<shape>``, 26 GB for
the 13B shape: mind the GPU machine's 64 GiB disk).

Then ``FastLanguageModel.from_pretrained(folder, max_seq_length=<the workload's sequence>, dtype=bfloat16,
load_in_4bit=<QLoRA>)`` and ``FastLanguageModel.get_peft_model`` with W6's adapters (common.LORA: r 16, alpha 32,
dropout 0 on the seven linears) and Unsloth's own defaults for the rest: its gradient checkpointing
(``use_gradient_checkpointing="unsloth"``, activations offloaded to the host), no bias, its LoRA kernels and fused
loss. QLoRA (``--qlora``, W6c, W6c8): the bf16 folder quantized by Unsloth as it loads (bitsandbytes NF4 with
double quantization, its default). Each optimizer step: the workload's micro-batches, ``model(input_ids,
labels=input_ids).loss / G`` backward under bf16 autocast (what Hugging Face's Trainer with ``bf16=True`` does),
then fused AdamW (lr 2e-4, weight decay 0.01) over the adapters. Model TFLOP/s count 6·P·T as for the other
LoRA engines.

Unsloth is imported before anything else imports transformers: it patches transformers' classes when imported.
It imports without xformers (PyTorch's attention instead). The GPU machine lacks its packages: bench/README.md
names the wheels (bench/gpu/unsloth_job.sh installs them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def folder_for(w) -> str:
    """The default weights folder of a workload's shape (the sequence's length only through max_positions)."""
    return f"/tmp/zerofit_unsloth/{w.name}_{w.layers}l_{w.max_positions}"


def make_folder(w, path: str, device: str = "cuda") -> float:
    """Writes the workload's model as a bf16 folder (random weights, seeded) with a word-level tokenizer; seconds."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = time.time()
    torch.manual_seed(0)
    model = common.build_model(w, device, dtype=torch.bfloat16, init_in_dtype=True)
    model.save_pretrained(path, safe_serialization=True)
    del model
    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(w.vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="t0", pad_token="t0", eos_token="t1", bos_token="t2"
    ).save_pretrained(path)
    with open(os.path.join(path, "zerofit_made"), "w") as f:  # written last: the folder is whole
        f.write(f"{w}\n")
    return time.time() - t


class Unsloth:
    def __init__(self, args, w, res):
        import torch
        from unsloth import FastLanguageModel

        self.torch, self.device = torch, args.device
        folder = args.folder or folder_for(w)
        if not os.path.exists(os.path.join(folder, "zerofit_made")):  # in a process of its own: no GPU peak here
            t = time.time()
            subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--workload", args.workload, "--make-folder", folder]
                + (["--seq", str(args.seq)] if args.seq else []),
                check=True,
            )
            res.extra["folder_s"] = round(time.time() - t, 1)
        qlora = common.qlora_wanted(args, w)
        t = time.time()
        model, _ = FastLanguageModel.from_pretrained(
            folder, max_seq_length=w.seq, dtype=torch.bfloat16, load_in_4bit=qlora
        )
        L = common.LORA
        self.model = FastLanguageModel.get_peft_model(
            model,
            r=L.r,
            lora_alpha=L.alpha,
            lora_dropout=L.dropout,
            bias="none",
            target_modules=list(L.targets),
            use_gradient_checkpointing="unsloth",
            random_state=args.seed,
        )
        self.model.train()
        res.extra["load_s"] = round(time.time() - t, 1)
        res.extra["folder"] = folder
        common.lora_record(res, self.model, qlora=qlora)
        params = [p for p in self.model.parameters() if p.requires_grad]
        res.extra["adapter_dtypes"] = sorted({str(p.dtype) for p in params})
        self.opt = torch.optim.AdamW(params, lr=L.lr, weight_decay=0.01, fused=True)
        res.extra["optimizer"] = (
            "torch.optim.AdamW(fused=True) over the adapters; "
            + ("NF4 base (Unsloth's load_in_4bit)" if qlora else "bf16 base")
            + "; use_gradient_checkpointing='unsloth'"
        )

    def step(self, micro_batches):
        torch = self.torch
        g = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for ids in micro_batches:
            ids = ids.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = self.model(input_ids=ids, labels=ids).loss
            (loss / g).backward()
            total += loss.detach() / g
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total.item()


def main() -> int:
    parser = common.engine_args(__doc__)
    parser.add_argument("--folder", default=None, help="the model's weights folder (made if absent)")
    parser.add_argument("--make-folder", default=None, metavar="DIR", help="only write the workload's folder to DIR")
    args = parser.parse_args()
    w = common.with_seq(common.WORKLOADS[args.workload], args.seq)
    if args.make_folder:
        print(
            f"[unsloth] wrote {args.make_folder} in {make_folder(w, args.make_folder, args.device):.1f} s", flush=True
        )
        return 0
    try:  # before transformers: Unsloth patches its classes on import
        import unsloth  # noqa: F401
    except BaseException as e:  # noqa: BLE001 - the result says why
        traceback.print_exc()
        res = common.Result(engine="unsloth", workload=w.name, status="error", error=common.last_line(e))
        res.save(args.result)
        return 1
    return common.run_engine("unsloth", args, Unsloth, Unsloth.step, uses_cap=True, version_modules=("unsloth", "peft"))


if __name__ == "__main__":
    common.exit_now(main())
