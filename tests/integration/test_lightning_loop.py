"""A LightningModule on zerofit ([Note: the user's loop drives the engine], src/zerofit/userloop): the one
change is wrapping the model in ``configure_model`` with ``zerofit.fsdp.FullyShardedDataParallel`` (where
Lightning's own FSDP2 recipe calls ``fully_shard``); the Trainer, its ``accumulate_grad_batches``,
``gradient_clip_val``, lr scheduler and checkpoints as written. Against the same module unwrapped, on the CPU in
fp32 and under Lightning's AMP precisions, bitwise; a Trainer checkpoint resumed (``ckpt_path``) bitwise; Fabric."""

from __future__ import annotations

import logging

import pytest
import torch

L = pytest.importorskip("lightning")
from torch.distributed.fsdp import CPUOffload  # noqa: E402

from tests.support import tiny_models as tm  # noqa: E402
from zerofit.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from zerofit.userloop import UserLoopError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
logging.getLogger("lightning").setLevel(logging.ERROR)


def _rows(n=16):
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": (ids := torch.randint(0, tm.VOCAB, (16,), generator=g)), "labels": ids} for _ in range(n)]


class LM(L.LightningModule):
    def __init__(self, wrap: bool):
        super().__init__()
        torch.manual_seed(0)
        self.model = tm.llama(layers=3, tied=False)
        self.wrap = wrap
        self.losses = []

    def configure_model(self):
        if self.wrap and not isinstance(self.model, FSDP):
            self.model = FSDP(self.model, cpu_offload=CPUOffload(offload_params=True))  # the one change

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))}


def _fit(module, rows, tmp_path=None, ckpt_path=None, epochs=1, precision="32", clip=0.5):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        accumulate_grad_batches=2,
        gradient_clip_val=clip,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path) if tmp_path else None,
    )
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=2), ckpt_path=ckpt_path)
    return trainer


def test_a_lightning_module_trains_as_it_does_unwrapped_bitwise():
    rows = _rows()
    a, b = LM(True), LM(False)
    _fit(a, rows)
    _fit(b, rows)
    assert a.losses == b.losses and len(a.losses) == 8
    mine, theirs = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(mine[n], v) for n, v in theirs.items())


def test_a_trainer_checkpoint_resumes_bitwise(tmp_path):
    """Two epochs straight; against one epoch, the Trainer's checkpoint (weights and the optimizer's state: the
    engine's moments in torch's format), and a new Trainer resuming from it (``ckpt_path``) for the second."""
    rows = _rows(8)
    full = LM(True)
    _fit(full, rows, epochs=2)
    first = LM(True)
    trainer = _fit(first, rows, tmp_path, epochs=1)
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    saved = torch.load(tmp_path / "one.ckpt", weights_only=False)
    assert any(k.startswith("model.model.layers.0.") for k in saved["state_dict"])  # the model's own names
    assert saved["optimizer_states"][0]["state"]  # the engine's moments
    resumed = LM(True)
    _fit(resumed, rows, tmp_path, ckpt_path=str(tmp_path / "one.ckpt"), epochs=2)
    assert resumed.losses == full.losses[4:] and len(resumed.losses) == 4
    mine, theirs = resumed.model.state_dict(), full.model.state_dict()
    assert all(torch.equal(mine[n], v) for n, v in theirs.items())


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightnings_autocast_precisions_are_bitwise_the_unwrapped_module(precision):
    """Lightning's AMP precisions (on the CPU both bf16 autocast) over the fp32 wrapper: the forward under the
    autocast, the engine's recompute and backward under the same one again (as torch.utils.checkpoint restores
    it); no clipping (Lightning's AMP plugin refuses it with a fused optimizer, plain or not)."""
    rows = _rows(8)
    a, b = LM(True), LM(False)
    _fit(a, rows, precision=precision, clip=None)
    _fit(b, rows, precision=precision, clip=None)
    assert a.losses == b.losses and len(a.losses) == 4
    mine, theirs = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(mine[n], v) for n, v in theirs.items())


def test_an_autocast_over_a_16_bit_wrapper_of_another_dtype_is_refused_by_name():
    from torch.distributed.fsdp import MixedPrecision

    class Half(LM):
        def configure_model(self):
            if not isinstance(self.model, FSDP):
                self.model = FSDP(self.model, mixed_precision=MixedPrecision(param_dtype=torch.float16))

    with pytest.raises(UserLoopError, match="one of them sets the compute dtype"):
        _fit(Half(True), _rows(4), precision="bf16-mixed", clip=None)


def _fabric_run(wrap: bool, rows, clip: bool = True, engines: list | None = None):
    """Lightning Fabric: ``fabric.setup(FSDP(model), optimizer)`` (the one change: the wrap), ``no_backward_sync`` on
    the first micro-batch of each step, ``fabric.backward``, ``fabric.clip_gradients`` (with ``clip``),
    ``optimizer.step()``."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    torch.manual_seed(0)
    model = tm.llama(layers=3, tied=False)
    if wrap:
        model = FSDP(model, cpu_offload=CPUOffload(offload_params=True))
        if engines is not None:
            engines.append(model.zerofit_engine)
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
            if clip:
                out.append(float(fabric.clip_gradients(model, opt, max_norm=0.5)))
            opt.step()
            opt.zero_grad()
    return out, model.state_dict()


def test_a_fabric_loop_is_the_plain_one_bitwise():
    rows = _rows(8)
    got, mine = _fabric_run(True, rows)
    want, theirs = _fabric_run(False, rows)
    assert got == want and len(got) == 6  # 4 micro-batches, 2 steps' norms
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], v) for k, v in theirs.items())


def test_unclipped_fabric_and_trainer_loops_update_their_blocks_in_the_steps_backward():
    """[Note: updates in the backward of the user's loop] through Fabric and the Trainer: from the second step, a
    step with no clip before ``optimizer.step()`` updates each streamed block as its gradient comes down; bitwise
    the unwrapped loop."""
    rows = _rows(16)
    engines: list = []
    got, mine = _fabric_run(True, rows, clip=False, engines=engines)
    want, theirs = _fabric_run(False, rows, clip=False)
    assert got == want and len(got) == 8
    assert all(torch.equal(mine[k], v) for k, v in theirs.items())
    assert engines[0].speculator.known_steps == 4 - 1  # 4 steps of 2 micro-batches; the first learns the window
    a, b = LM(True), LM(False)
    _fit(a, rows, clip=None)
    _fit(b, rows, clip=None)
    assert a.losses == b.losses
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    assert a.model.zerofit_engine.speculator.known_steps == 4 - 1


class LitAutoEncoder(L.LightningModule):
    """Lightning's own LitAutoEncoder (its getting-started page, at a smaller size): ``how`` None trains it as
    written; 'one' wraps a module holding the encoder and the decoder in ``configure_model`` and calls it; 'each'
    wraps the two apart."""

    def __init__(self, how=None):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.decoder = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 64))
        self.how, self.losses, self.autoencoder = how, [], None

    def configure_model(self):
        if self.how == "one" and self.autoencoder is None:
            self.autoencoder = FSDP(torch.nn.Sequential(self.encoder, self.decoder))
        elif self.how == "each" and not isinstance(self.encoder, FSDP):
            self.encoder, self.decoder = FSDP(self.encoder), FSDP(self.decoder)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        if self.autoencoder is not None:
            x_hat = self.autoencoder(x)
        else:
            x_hat = self.decoder(self.encoder(x))
        loss = torch.nn.functional.mse_loss(x_hat, x)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _images(n=16):
    g = torch.Generator().manual_seed(0)
    return [(torch.rand(1, 8, 8, generator=g), 0) for _ in range(n)]


def test_lightnings_autoencoder_trains_its_reconstruction_loss_as_unwrapped():
    """Its ``Adam`` as written: the engine's update is torch's fused kernel's arithmetic, which torch's default
    (foreach) Adam rounds apart from by an ulp now and then; the losses are bitwise."""
    a, b = LitAutoEncoder("one"), LitAutoEncoder(None)
    for module in (a, b):
        L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(module, torch.utils.data.DataLoader(_images(), batch_size=4))
    assert a.losses == b.losses and len(a.losses) == 4
    mine = a.autoencoder.state_dict()
    theirs = torch.nn.Sequential(b.encoder, b.decoder).state_dict()
    for n, v in theirs.items():
        torch.testing.assert_close(mine[n], v, rtol=1e-6, atol=1e-7)


def test_two_wrapped_parts_under_one_optimizer_are_refused_by_name():
    """The decoder's input is the encoder's output: the engine would not reach it ([Note: one wrapped model per
    optimizer])."""
    with pytest.raises(UserLoopError, match="wrap one module that holds"):
        L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(LitAutoEncoder("each"), torch.utils.data.DataLoader(_images(4), batch_size=4))
