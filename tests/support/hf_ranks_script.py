"""One rank of tests/integration/test_hf_trainer.py's torchrun test: the plain transformers Trainer (DDP over gloo) and
zerofit.hf.Trainer on the same arguments, data and initial weights, in the same ranks; writes rank 0's and
rank 1's logged losses and gradient norms and the final weights of both to ``sys.argv[1].<rank>``."""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transformers import Trainer as PlainTrainer  # noqa: E402
from transformers import TrainingArguments, default_data_collator  # noqa: E402

import zerofit.hf  # noqa: E402
from tests.integration.test_hf_trainer import TRAIN  # noqa: E402
from tests.support import tiny_models as tm  # noqa: E402


def args(out: str) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=2e-3,
        max_grad_norm=0.5,
        num_train_epochs=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=7,
        ddp_backend="gloo",
        lr_scheduler_type="cosine",
        warmup_steps=1,
    )


def main() -> None:
    out, rank = sys.argv[1], int(os.environ["RANK"])
    torch.manual_seed(0)
    model = tm.llama()
    plain = PlainTrainer(
        model=copy.deepcopy(model), args=args(out + "-plain"), train_dataset=TRAIN, data_collator=default_data_collator
    )
    plain.train()
    zf = zerofit.hf.Trainer(
        model=model, args=args(out + "-zf"), train_dataset=TRAIN, data_collator=default_data_collator
    )
    zf.train()
    logs = {
        name: [(e["step"], e.get("loss"), e.get("grad_norm")) for e in t.state.log_history if "loss" in e]
        for name, t in (("plain", plain), ("zerofit", zf))
    }
    weights = {
        "plain": {n: p.detach().clone() for n, p in plain.model.named_parameters()},
        "zerofit": {n: p.detach().clone() for n, p in zf.zerofit_engine.module.named_parameters()},
    }
    torch.save(
        {
            "logs": logs,
            "weights": weights,
            "world": zf.zerofit_engine.ranks.world,
            "windows": dict(zf.zerofit_engine.window_stats),
        },
        f"{out}.{rank}",
    )


if __name__ == "__main__":
    main()
