"""A custom accelerate loop on zerofit ([Note: the user's loop drives the engine], src/zerofit/userloop):
the one change is wrapping the model with ``zerofit.fsdp.FullyShardedDataParallel`` before
``accelerator.prepare`` (docs/fsdp.md, "accelerate"). Against the same loop over the plain model, on the CPU in
fp32, bitwise: ``accumulate`` (gradient accumulation), ``backward``, ``clip_grad_norm_``, an lr scheduler; and
``save_state``/``load_state`` resuming bitwise."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from torch.distributed.fsdp import CPUOffload  # noqa: E402

from tests.support import tiny_models as tm  # noqa: E402
from zerofit.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate's state is per process: each test (and the tests after these) starts from none."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _rows(n=16):
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": (ids := torch.randint(0, tm.VOCAB, (16,), generator=g)), "labels": ids} for _ in range(n)]


def _run(
    wrap: bool,
    rows,
    clip: bool = True,
    save_at=None,
    save_to=None,
    load_from=None,
    skip: int = 0,
    mixed: str = "no",
    engines: list | None = None,
):
    torch.manual_seed(0)
    model = tm.llama(layers=3, tied=False)
    acc = Accelerator(gradient_accumulation_steps=2, cpu=True, mixed_precision=mixed)
    if wrap:  # the one change
        model = FSDP(model, cpu_offload=CPUOffload(offload_params=True))
        if engines is not None:
            engines.append(model.zerofit_engine)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    loader = torch.utils.data.DataLoader(rows, batch_size=2, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    if load_from is not None:
        acc.load_state(load_from)
    out = []
    for i, batch in enumerate(loader):
        if i < skip:
            continue
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if clip and acc.sync_gradients:
                out.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            sched.step()
            opt.zero_grad()
        out.append(loss.item())
        if save_at is not None and i == save_at:
            acc.save_state(str(save_to))
    return out, acc.unwrap_model(model).state_dict()


@pytest.mark.parametrize("mixed", ["no", "bf16"])
def test_the_accelerate_loop_is_the_plain_one_bitwise(mixed):
    """fp32, and accelerate's bf16 (its autocast around the forward; the engine recomputes under it again)."""
    rows = _rows()
    got, mine = _run(True, rows, mixed=mixed)
    want, theirs = _run(False, rows, mixed=mixed)
    assert got == want and len(got) == 8 + 4  # 8 micro-batches' losses, 4 clipped steps' norms
    for n, v in theirs.items():
        assert torch.equal(mine[n], v), n


def test_save_state_and_load_state_resume_bitwise(tmp_path):
    rows = _rows()
    full, _ = _run(True, rows, clip=False, save_at=3, save_to=tmp_path / "state")  # after the second step
    resumed, _ = _run(True, rows, clip=False, load_from=str(tmp_path / "state"), skip=4)
    assert resumed == full[4:]


def test_accelerates_quicktour_with_a_generic_model_is_the_plain_one_bitwise():
    """accelerate's quicktour loop (``zero_grad`` first, ``outputs = model(inputs)``, the user's loss function of
    the outputs) over a model that returns its outputs, not a loss."""
    g = torch.Generator().manual_seed(5)
    rows = [(torch.randn(12, generator=g), torch.randn(4, generator=g)) for _ in range(16)]

    def run(wrap: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)
        )
        if wrap:  # the one change
            model = FSDP(model, cpu_offload=CPUOffload(offload_params=True))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        accelerator = Accelerator(cpu=True)
        loader = torch.utils.data.DataLoader(rows, batch_size=4)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        losses = []
        for inputs, targets in loader:
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = torch.nn.functional.mse_loss(outputs, targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
        return losses, accelerator.unwrap_model(model).state_dict()

    (got, mine), (want, theirs) = run(True), run(False)
    assert got == want and len(got) == 4
    assert all(torch.equal(mine[n], v) for n, v in theirs.items())


def test_an_unclipped_accelerate_loop_updates_its_blocks_in_the_steps_backward():
    """[Note: updates in the backward of the user's loop] through accelerate: from the second step, a step with
    no clip before ``optimizer.step()`` updates each streamed block as its gradient comes down; bitwise the plain
    loop."""
    rows = _rows()
    engines: list = []
    got, mine = _run(True, rows, clip=False, engines=engines)
    want, theirs = _run(False, rows, clip=False)
    assert got == want and len(got) == 8
    for n, v in theirs.items():
        assert torch.equal(mine[n], v), n
    assert engines[0].speculator.known_steps == 4 - 1  # 4 steps of 2 micro-batches; the first learns the window
