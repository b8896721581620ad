"""A real fine-tuning job on the GPU machine, through the CLI: model directory and text in, checkpoints and a model out.

    python3 bench/finetune.py prepare --workload W2 --dir /tmp/ft      # model directory (bf16, 5 GB shards) + text
    zerofit train --model /tmp/ft/model --data /tmp/ft/data --config /tmp/ft/config.json ...   # the runs
    python3 bench/finetune.py compare --straight /tmp/ft/A --resumed /tmp/ft/B --model /tmp/ft/model --json OUT

``prepare`` builds the workload's Llama on the GPU in bf16 from a random init and saves it with
``save_pretrained`` (sharded, with its index) beside the test tokenizer (tests/support/tiny_tokenizer.py: no download;
its ids are a subset of the model's vocabulary), then writes the standard library's ``*.py`` files as ``.txt``
documents. ``compare`` checks what a resumed run must show: the losses of the steps after the resume equal
the straight run's bitwise, and the exported weights are equal; and that the exported model loads with
``AutoModelForCausalLM.from_pretrained`` and scores a training window better than the initial model.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "src"))

import common  # noqa: E402


def prepare(args) -> None:
    import torch
    from tests.tiny_tokenizer import build_tokenizer

    root = Path(args.dir)
    model_dir, data_dir = root / "model", root / "data"
    t = time.perf_counter()
    w = common.WORKLOADS[args.workload]
    model = common.build_model(w, args.device, dtype=torch.bfloat16)
    tok = build_tokenizer(model_dir)
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(model_dir, max_shard_size="5GB")
    del model
    torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    data_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    for src in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total >= args.data_bytes:
            break
        text = src.read_text(errors="replace")
        (data_dir / (src.stem + ".txt")).write_text(text)
        total += len(text)
    (root / "config.json").write_text(
        json.dumps(
            {
                "precision": "bf16",
                "micro_batch_size": w.micro_batch,
                "gradient_accumulation_steps": w.grad_accum,
                "optimizer": {"lr": 1e-5, "weight_decay": 0.0},
                "scheduler": {"type": "constant"},
                "gradient_clipping": 1.0,
            },
            indent=1,
        )
    )
    print(
        json.dumps(
            {
                "model_dir": str(model_dir),
                "weights_bytes": size,
                "shards": len(list(model_dir.glob("*.safetensors"))),
                "data_bytes": total,
                "seconds": round(time.perf_counter() - t, 1),
            }
        )
    )


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def compare(args) -> int:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    straight, resumed = Path(args.straight), Path(args.resumed)
    a = {r["step"]: r["loss"] for r in _records(straight) if "loss" in r}
    b = {r["step"]: r["loss"] for r in _records(resumed) if "loss" in r}
    same_losses = all(a.get(s) == v for s, v in b.items()) and set(a) == set(b)
    wa, wb = {}, {}
    for f in sorted((straight / "model").glob("*.safetensors")):
        wa.update(load_file(str(f)))
    for f in sorted((resumed / "model").glob("*.safetensors")):
        wb.update(load_file(str(f)))
    same_weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    del wa, wb
    # round trip: the export loads with transformers and has learned the training windows
    from zerofit.data import build_datasets, load_tokenizer

    tok = load_tokenizer(args.model)
    data = build_datasets([Path(args.data)], tok, 2048, eval_size=0.0, seed=0)
    batch = data.train.batch(range(2))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids, labels = batch["input_ids"].to(dev), batch["labels"].to(dev)
    losses = {}
    for name, path in (("initial", args.model), ("exported", straight / "model")):
        t = time.perf_counter()
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev)
        with torch.no_grad():
            losses[name] = float(m(input_ids=ids, labels=labels).loss)
        losses[name + "_load_s"] = round(time.perf_counter() - t, 1)
        del m
        torch.cuda.empty_cache()
    out = {
        "losses_straight": a,
        "losses_resumed": b,
        "same_losses": same_losses,
        "same_exported_weights": same_weights,
        "from_pretrained": losses,
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if same_losses and same_weights else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("prepare")
    q.add_argument("--workload", default="W2")
    q.add_argument("--dir", required=True)
    q.add_argument("--data-bytes", type=int, default=8 << 20)
    q.add_argument("--device", default="cuda")
    c = sub.add_parser("compare")
    c.add_argument("--straight", required=True)
    c.add_argument("--resumed", required=True)
    c.add_argument("--model", required=True)
    c.add_argument("--data", required=True)
    c.add_argument("--json", default=None)
    args = p.parse_args()
    if args.cmd == "prepare":
        prepare(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
