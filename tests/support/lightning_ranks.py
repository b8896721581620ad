"""One rank of a LightningModule trained with ``Trainer(strategy="ddp", devices=2)`` on the CPU, launched by
torchrun (tests/processes/test_ranks.py): the module's model wrapped in ``configure_model`` with
``zerofit.fsdp.FullyShardedDataParallel`` (``wrap``), or left as it is (``plain``: Lightning's own DDP).

Arguments: ``wrap|plain|fabric-wrap|fabric-plain OUT`` (``fabric-``: the same with Lightning Fabric's DDP strategy).
Each rank writes ``OUT.<rank>``: its losses, and (rank 0) the final weights."""

from __future__ import annotations

import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
from torch.distributed.fsdp import CPUOffload  # noqa: E402

from tests.support import tiny_models as tm  # noqa: E402
from zerofit.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402

logging.getLogger("lightning").setLevel(logging.ERROR)


class LM(L.LightningModule):
    def __init__(self, wrap: bool):
        super().__init__()
        torch.manual_seed(0)
        self.model = tm.llama(layers=3, tied=False)
        self.wrap = wrap
        self.losses = []
        self.wrapped_as = None

    def configure_model(self):
        if self.wrap and not isinstance(self.model, FSDP):
            self.model = FSDP(self.model, cpu_offload=CPUOffload(offload_params=True))  # the one change

    def training_step(self, batch, batch_idx):
        self.wrapped_as = type(self.trainer.strategy.model).__name__  # what the strategy trains
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))}


def fabric_run(wrap: bool, rows: list) -> tuple[list, dict, str]:
    """Lightning Fabric with its DDP strategy on the ranks: setup, no_backward_sync on the first micro-batch of
    each step, backward, clip_gradients, step."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", precision="32-true")
    fabric.launch()
    torch.manual_seed(0)
    model = tm.llama(layers=3, tied=False)
    if wrap:
        model = FSDP(model, cpu_offload=CPUOffload(offload_params=True))  # the one change
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(rows, batch_size=2))
    out = []
    for i, batch in enumerate(loader):
        first = i % 2 == 0
        with fabric.no_backward_sync(model, enabled=first):
            loss = model(**batch).loss
            fabric.backward(loss / 2)
        out.append(loss.item())
        if not first:
            fabric.clip_gradients(model, opt, max_norm=0.5)
            opt.step()
            opt.zero_grad()
    inner = type(model._forward_module).__name__
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}, inner, fabric.global_rank


def main(mode: str, out: str) -> None:
    g = torch.Generator().manual_seed(3)
    rows = [{"input_ids": (ids := torch.randint(0, tm.VOCAB, (16,), generator=g)), "labels": ids} for _ in range(16)]
    if mode.startswith("fabric-"):
        losses, weights, inner, rank = fabric_run(mode == "fabric-wrap", rows)
        record = {"losses": losses, "wrapped": inner}
        if rank == 0:
            record["weights"] = weights
        torch.save(record, f"{out}.{rank}")
        return
    module = LM(mode == "wrap")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=2))
    rank = trainer.global_rank
    record = {"losses": module.losses, "wrapped": module.wrapped_as}
    weights = {k: v.detach().clone() for k, v in module.model.state_dict().items()}  # a collective, as FSDP's
    if rank == 0:
        record["weights"] = weights
    torch.save(record, f"{out}.{rank}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # as PyTorch asks of every distributed script: the group torn down before the interpreter's own teardown, where
    # gloo's threads were seen to abort the process ("terminate called without an active exception") now and then,
    # with Lightning's own DDP as with the wrapped model
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
