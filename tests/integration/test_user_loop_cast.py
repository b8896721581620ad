"""[Note: a speculated cast] (engine/update/speculation.py): a bf16 user's loop that clips casts each streamed
block's new weights in the backward its clip call runs, and keeps the cast when the clip leaves the gradients as
they were: bitwise the same loop without speculation, whichever way each step goes (clipped or not, its settings
changed between the clip and ``optimizer.step()``, a second clip)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffload, MixedPrecision

from tests.support import tiny_models as tm
from zerofit.engine.update import split_adamw
from zerofit.fsdp import FullyShardedDataParallel as FSDP

pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # tests/conftest.py
    pytest.mark.skipif(not split_adamw.available(), reason="the two-pass kernel needs a C++ compiler"),
]

LR = 1e-2
FREE = 1e9  # a max_norm no step reaches: the clip leaves the gradients as they were
TIGHT = 1e-3  # one every step passes: clipped


def _wrap(model, speculate: bool, window: str):
    """``window``: "config" (the config's G = 2: each step's blocks backward at its second ``backward()``) or
    "learnt" (from the second step, at the clip call: [Note: the window learns the loop's G])."""
    cfg: dict = {"offload": {"split_updates": True, "speculative_updates": speculate, "prefetch_depth": 1}}
    if window == "config":
        cfg["gradient_accumulation_steps"] = 2
    return FSDP(
        model,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        cpu_offload=CPUOffload(offload_params=True),
        zerofit_config=cfg,
    )


def _loop(model, data, max_norms, lr_at_step=None, twice=()):
    """Per micro-batch ``(loss / G).backward()``; then the clip to that step's ``max_norms[i]`` (a second one at
    the steps in ``twice``), ``optimizer.step()``. ``lr_at_step[i]``: the lr set between the clip and the step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
    out = []
    for i, mbs in enumerate(data):
        total = 0.0
        for mb in mbs:
            loss = model(**mb).loss
            (loss / len(mbs)).backward()
            total += loss.item()
        norm = float(model.clip_grad_norm_(max_norms[i]))
        if i in twice:
            norm = (norm, float(model.clip_grad_norm_(FREE)))
        if lr_at_step and i in lr_at_step:
            for g in opt.param_groups:
                g["lr"] = lr_at_step[i]
        opt.step()
        opt.zero_grad()
        out.append((total, norm))
    return out


def _state(engine):
    engine.wait()
    return {
        u.name: (u.master.clone(), u.exp_avg.clone(), u.exp_avg_sq.clone(), float(u.step))
        for u in engine.units
        if u.master is not None and u.exp_avg is not None
    }


def _run(speculate: bool, data, max_norms, window: str = "config", **kw):
    torch.manual_seed(0)
    model = _wrap(tm.llama(layers=4, tied=False), speculate, window)
    eng = model.zerofit_engine
    parts: list = []
    apply = eng.host_updates.apply

    def recording_apply(unit, grad, ops, part=None):
        parts.append((unit.name, part))
        return apply(unit, grad, ops, part)

    eng.host_updates.apply = recording_apply
    labels: list[str] = []
    submit = eng.worker.submit

    def recording(task, *args, label: str = "", **kwargs):
        labels.append(label)
        return submit(task, *args, label=label, **kwargs)

    eng.worker.submit = recording
    got = _loop(model, data, max_norms, **kw)
    return got, _state(eng), eng, parts, labels


@pytest.mark.parametrize("window", ["config", "learnt"])
def test_a_clipped_bf16_loop_casts_in_its_backward_and_keeps_what_the_clip_left_bitwise(window):
    """Each step whose whole gradient comes down in one blocks' backward (every step with the config's window; from
    the second with the learnt one, in the clip call) casts the host-updated streamed blocks in it, until the
    partial norm passes the clip's (the learnt window's clip call) or the last clip's (the configured window); the
    unclipped steps keep those casts (no second cast pass), the others cast again. Losses, norms, masters, moments
    and step counts are bitwise the loop without speculation; every later forward reads the 16-bit copies."""
    data = tm.batches(6, 2)
    max_norms = [FREE, FREE, TIGHT, FREE, FREE, FREE]
    lr_at_step = {4: LR / 2}  # the lr the casts used is not the step's
    want, ref_state, ref, ref_parts, _ = _run(False, data, max_norms, window, lr_at_step=lr_at_step)
    got, state, eng, parts, labels = _run(True, data, max_norms, window, lr_at_step=lr_at_step)
    assert got == want
    assert state.keys() == ref_state.keys()
    for name, (a, b) in ((n, (state[n], ref_state[n])) for n in state):
        for what, x, y in zip(("master", "exp_avg", "exp_avg_sq", "step"), a, b):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f"{name} {what}"
    assert [n > m for (_, n), m in zip(want, max_norms)] == [False, False, True, False, False, False]

    host = {u.name for u in eng.blocks if u.host16 is not None and not eng.device_updates.assisted(u)}
    assert host
    steps = len(data) if window == "config" else len(data) - 1  # the learnt window: from the second step
    assert eng.speculator.cast_steps == steps
    assert len([lb for lb in labels if lb.startswith("cast[")]) == len(host) * steps
    # cast again at step 3 (clipped: with the learnt window the clip's norm stopped the casts at the first block)
    # and 5 (the lr changed); at 1 (the learnt window: no casts; the configured one: cast before the loop's
    # optimizer was followed, with the config's settings); at 4 with the configured window only (its casts stop at
    # the last clip's norm, step 3's); kept at the others
    again = 4 if window == "config" else 3
    assert sum(1 for name, p in parts if p == "cast" and name in host) == len(host) * again
    assert sum(1 for name, p in ref_parts if p == "cast" and name in host) == len(host) * len(data)
    uploads = [x for x in tm.upload_labels(eng) if x.split("(")[0] in host]
    assert uploads and all(x.endswith("(16)") for x in uploads), uploads
    eng.close()
    ref.close()


def test_a_second_clip_voids_the_casts_and_stays_bitwise():
    """A loop that clips twice in a step (the first clip's multiplies done at the second): the casts made from the
    gradients before it are not kept; bitwise the loop without speculation."""
    data = tm.batches(4, 2)
    max_norms = [FREE, FREE, TIGHT, FREE]  # step 3 clipped, then clipped again to FREE: nothing left to multiply
    want, ref_state, ref, _, _ = _run(False, data, max_norms, twice=(2,))
    got, state, eng, parts, _ = _run(True, data, max_norms, twice=(2,))
    assert got == want
    for name in ref_state:
        for x, y in zip(state[name], ref_state[name]):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, name
    host = {u.name for u in eng.blocks if u.host16 is not None and not eng.device_updates.assisted(u)}
    # cast again at steps 1 (the loop's optimizer not followed yet), 3 (its casts, made under step 2's norm, void)
    # and 4 (its casts stopped at step 3's first norm); kept at 2
    assert sum(1 for name, p in parts if p == "cast" and name in host) == len(host) * 3
    eng.close()
    ref.close()
