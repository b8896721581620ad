"""The code blocks of README.md and docs/*.md, and a scene to run the Python ones in on the CPU.

A block runs as written, in a folder where the paths the docs name exist (``path/to/model``, ``runs/mine/model``:
a tiny Llama folder with its tokenizer; ``notes/``, ``chat.jsonl``, ``ds_config.json``), with the names the
surrounding text defines already there (``model``, ``engine``, ``config``, ``loader``, ``micro_batches``, ...), and
``range`` at most 2 (a doc's 1,000 steps run 2). ``python -m tests.support.doc_blocks OUT`` runs every block but
:data:`NOT_ON_A_CPU` in one process, each in a fresh scene (a block that starts with ``import
zerofit.deepspeed.alias`` in a process of its own, as a script's first line), and writes {block id: "ok" or the
traceback} to OUT."""

from __future__ import annotations

import builtins
import json
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# blocks that cannot run on a CPU, by the file and their first line: why
NOT_ON_A_CPU = {
    (
        "docs/hf_trainer.md",
        "from transformers import AutoModelForCausalLM, Trainer, TrainingArguments",
    ): "the script before the change: Transformers' own DeepSpeed integration (real DeepSpeed's compiled ops)",
}


def blocks(root: Path = ROOT) -> list[dict]:
    """Every fenced block: {id, file, lang, first, body}; id = file:index (the index among the file's blocks)."""
    out = []
    for f in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        rel = str(f.relative_to(root))
        for i, m in enumerate(re.finditer(r"^```(\w*)\n(.*?)^```", f.read_text(), re.S | re.M)):
            body = m.group(2)
            first = next((line for line in body.splitlines() if line.strip()), "")
            out.append({"id": f"{rel}:{i}", "file": rel, "lang": m.group(1), "first": first, "body": body})
    return out


def python_blocks(root: Path = ROOT) -> list[dict]:
    return [b for b in blocks(root) if b["lang"] == "python" and (b["file"], b["first"]) not in NOT_ON_A_CPU]


def _capped_range(*args):
    r = builtins.range(*args)
    return r[:2]


def _folders(where: Path) -> None:
    """The paths the docs name, made under ``where`` once."""
    import torch

    from tests.support.model_dirs import make_model_dir, write_data

    model = make_model_dir(where / "tiny-llama", "llama", torch.float32)
    for name in ("path/to/model", "path/to/model_dir", "path/to/model_or_checkpoint", "runs/mine/model"):
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).symlink_to(model, target_is_directory=True)
    write_data(where / "notes")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": f"Answer {i}, at some length. " * 4},
            ]
        }
        for i in range(12)
    ]
    (where / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (where / "ds_config.json").write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "cpu"},
                    "offload_optimizer": {"device": "cpu"},
                },
            }
        )
    )


def scene() -> dict:
    """The names a block may use without defining them (the docs' surrounding text defines them), fresh."""
    import functools

    import torch
    from torch.distributed.fsdp import CPUOffload, MixedPrecision
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM, TrainingArguments
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import zerofit
    from zerofit.fsdp import FullyShardedDataParallel as FSDP
    from zerofit.hf import Trainer

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(3, 90, (16,), generator=g)), "labels": ids} for _ in range(8)]
    config = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 1e-3},
    }
    model = AutoModelForCausalLM.from_pretrained("path/to/model")
    names = [n for n, _ in model.named_parameters()]

    def build_model():
        cfg = LlamaConfig.from_pretrained("path/to/model")
        return LlamaForCausalLM(cfg)

    def split(batch, n):
        return [{k: v[i::n] for k, v in batch.items()} for i in range(n)]

    def windows(loader, n):
        batches = list(loader)
        return [batches[i : i + n] for i in range(0, len(batches) - n + 1, n)]

    ns = {
        "zerofit": zerofit,
        "torch": torch,
        "functools": functools,
        "FSDP": FSDP,
        "CPUOffload": CPUOffload,
        "MixedPrecision": MixedPrecision,
        "LlamaDecoderLayer": LlamaDecoderLayer,
        "Trainer": Trainer,
        "AutoModelForCausalLM": AutoModelForCausalLM,
        "BitsAndBytesConfig": BitsAndBytesConfig,
        "range": _capped_range,
        "path": "path/to/model",
        "model": model,
        "config": config,
        "G": 2,
        "n": 2,
        "warmup": lambda step: 1.0,
        "split": split,
        "windows": windows,
        "build_model": build_model,
        "dataset": rows,
        "train": rows,
        "held_out": rows[:2],
        "collate": None,
        "loader": torch.utils.data.DataLoader(rows, batch_size=4),
        "micro_batches": [dict(r, input_ids=r["input_ids"][None], labels=r["labels"][None]) for r in rows[:2]],
        "input_ids": torch.tensor([[5, 6, 7, 8]]),
        "mask": torch.ones(1, 4, dtype=torch.long),
        "save_dir": "ckpts",
        "load_dir": "ckpts",
        "out_dir": "out",
        "checkpoint": "ckpts",
        "decay": [n for n in names if n.endswith("proj.weight")],
        "no_decay": [n for n in names if not n.endswith("proj.weight") and n != "lm_head.weight"],
        "args": TrainingArguments(
            output_dir="runs/sft",
            per_device_train_batch_size=2,
            max_steps=2,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
        ),
    }
    try:
        import lightning
        from accelerate import Accelerator
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        ns.update(
            L=lightning,
            Accelerator=Accelerator,
            LoraConfig=LoraConfig,
            get_peft_model=get_peft_model,
            prepare_model_for_kbit_training=prepare_model_for_kbit_training,
        )
    except ImportError:
        pass
    ns["engine"] = zerofit.initialize(AutoModelForCausalLM.from_pretrained("path/to/model"), config)
    return ns


def run(block: dict) -> str:
    """``block`` run in a fresh scene (in its own empty folder beside the docs' paths): "ok" or the traceback."""
    here = Path.cwd()
    work = Path(tempfile.mkdtemp(dir=here))
    for name in os.listdir(here):
        if not (work / name).exists() and name != work.name:
            (work / name).symlink_to(here / name)
    os.chdir(work)
    if "import zerofit.deepspeed.alias" in block["body"]:  # a script's first line: a process of its own
        import subprocess

        try:
            r = subprocess.run(
                [sys.executable, "-c", block["body"]],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
            return "ok" if r.returncode == 0 else r.stderr
        finally:
            os.chdir(here)
    argv = sys.argv
    sys.argv = ["train.py", "--deepspeed", "--deepspeed_config", "ds_config.json"]  # a script's command line
    try:
        ns = scene()
        exec(compile(block["body"], block["id"], "exec"), ns)
        return "ok"
    except BaseException:  # noqa: BLE001 - the block's failure is the result
        return traceback.format_exc()
    finally:
        sys.argv = argv
        os.chdir(here)


def main(out: str) -> None:
    import logging

    logging.disable(logging.WARNING)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        os.chdir(d)
        _folders(Path(d))
        for b in python_blocks():
            results[b["id"]] = run(b)
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
