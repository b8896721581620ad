"""The user's FSDP-shaped loop saved and resumed the plain PyTorch way, in two processes
(tests/processes/test_checkpoint_resume.py):

    python tests/support/userloop_resume.py save   DIR   # 4 steps straight (want.pt); 2 steps, torch.save of the
                                                         # model's, the optimizer's and the scheduler's state_dict
    python tests/support/userloop_resume.py resume DIR   # a new wrapper, optimizer and scheduler, their
                                                         # load_state_dict, 2 steps (got.pt)
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torch.distributed.fsdp import CPUOffload  # noqa: E402

from tests.support import tiny_models as tm  # noqa: E402
from zerofit.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402

G, STEPS = 2, 4


def build():
    torch.manual_seed(0)
    model = FSDP(tm.llama(layers=3, tied=False), cpu_offload=CPUOffload(offload_params=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def steps(model, opt, sched, data) -> list[float]:
    out = []
    for mbs in data:
        total = 0.0
        for mb in mbs:
            loss = model(**mb).loss
            (loss / G).backward()
            total += loss.item()
        model.clip_grad_norm_(0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append(total / G)
    return out


def main(mode: str, folder: str) -> None:
    torch.set_num_threads(1)
    data = tm.batches(STEPS, G, seed=7)
    model, opt, sched = build()
    if mode == "save":
        losses = steps(model, opt, sched, data)
        torch.save({"losses": losses[2:], "weights": model.state_dict()}, os.path.join(folder, "want.pt"))
        model, opt, sched = build()
        steps(model, opt, sched, data[:2])
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
            os.path.join(folder, "ckpt.pt"),
        )
        return
    ckpt = torch.load(os.path.join(folder, "ckpt.pt"), weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    losses = steps(model, opt, sched, data[2:])
    torch.save({"losses": losses, "weights": model.state_dict()}, os.path.join(folder, "got.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
