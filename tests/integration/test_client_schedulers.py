"""Client optimizers and schedulers, and DeepSpeed's OneCycle and LRRangeTest, as DeepSpeed runs them.

``zerofit.deepspeed.initialize(optimizer=..., lr_scheduler=...)`` with a torch scheduler, a callable, transformers'
``get_scheduler``, or a config's OneCycle / LRRangeTest: the per-micro-batch losses and final weights of the
DeepSpeed loop equal a plain torch loop (``torch.optim.AdamW(fused=True)``, the same scheduler stepped after each
``optimizer.step()``) bitwise, in fp32 on the CPU, with gradient_accumulation_steps 1 and 2; the lr reported
(``engine.get_lr()``, ``optimizer.param_groups``, the scheduler's ``get_last_lr()``) is the one applied; a run
resumed from a checkpoint in the middle of the schedule continues bitwise. DeepSpeed's own OneCycle, LRRangeTest
and WarmupLR classes (real DeepSpeed 0.19.8) are the reference for the config schedules.

The model is ``tiny_models.PlainLM``, whose streamed blocks' gradients accumulate in the reference's order (so
G = 2 is bitwise too).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import zerofit.deepspeed as deepspeed
from tests.support import tiny_models as tm
from zerofit.deepspeed import DeepSpeedUnsupported
from zerofit.engine.model.adapter import loss_of

STEPS = 6
LR, WD = 1e-3, 0.01


def _ds_lr_schedules():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")
    return pytest.importorskip("deepspeed.runtime.lr_schedules")


def _config(G: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": G,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        **extra,
    }


def _adamw(params, fused=False):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=fused or None)


def _warmup_decay(s):
    return min(1.0, s / 2) * 0.8**s  # 0 at the first step: the client optimizer's lr is zeroed at once


# name -> (lr_scheduler argument for initialize (given the client optimizer, None for the config's), whether a
# client optimizer is passed, the config's scheduler block, the reference scheduler over a torch optimizer)
def _cases():
    def transformers_cosine(opt):
        from transformers import get_scheduler

        return get_scheduler("cosine", optimizer=opt, num_warmup_steps=2, num_training_steps=STEPS)

    def torch_one_cycle(opt):  # cycles AdamW's betas too (cycle_momentum, torch's default)
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS)

    def step_lr(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    one_cycle = {
        "cycle_min_lr": 1e-4,
        "cycle_max_lr": 1e-2,
        "cycle_first_step_size": 2,
        "cycle_second_step_size": 3,
        "decay_step_size": 1,
        "decay_lr_rate": 0.5,
        "decay_mom_rate": 0.01,
    }
    lr_range = {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 3.0}

    def ds(name, **params):
        return lambda opt: getattr(_ds_lr_schedules(), name)(opt, **params)

    return {
        "LambdaLR": (
            lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup_decay),
            True,
            None,
            lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup_decay),
        ),
        "callable": (step_lr, False, None, step_lr),
        "transformers-cosine": (transformers_cosine, True, None, transformers_cosine),
        "torch-OneCycleLR": (torch_one_cycle, True, None, torch_one_cycle),
        "OneCycle": (None, False, {"type": "OneCycle", "params": one_cycle}, ds("OneCycle", **one_cycle)),
        "LRRangeTest": (None, False, {"type": "LRRangeTest", "params": lr_range}, ds("LRRangeTest", **lr_range)),
    }


CASES = _cases()


def _zerofit(model, G, case, batches, *, resume_at=None, tmp_path=None):
    """The DeepSpeed loop over ``batches``: (losses, per applied step the lr and betas each reader reports, the
    engine). With ``resume_at``: a checkpoint after that many micro-batches, loaded into a fresh engine (a fresh
    copy of the initial model, optimizer and scheduler) that runs the rest."""
    make_sched, client_opt, config_sched, _ = CASES[case]
    initial = copy.deepcopy(model)

    def build(m):
        opt = _adamw(m.parameters()) if client_opt else None
        if make_sched is None:
            sched = None
        elif client_opt:
            sched = make_sched(opt)  # a scheduler object over the client optimizer
        else:
            sched = make_sched  # a callable: DeepSpeed calls it with its optimizer
        config = _config(G, **({"scheduler": config_sched} if config_sched else {}))
        if not client_opt:
            config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}
        return deepspeed.initialize(model=m, optimizer=opt, lr_scheduler=sched, config=config, device="cpu")

    engine, optimizer, _, lr_scheduler = build(model)
    losses, seen = [], []
    for i, mb in enumerate(batches):
        if resume_at is not None and i == resume_at:
            engine.save_checkpoint(tmp_path, tag="mid")
            engine.close()
            engine, optimizer, _, lr_scheduler = build(copy.deepcopy(initial))
            engine.load_checkpoint(tmp_path, tag="mid")
        loss = loss_of(engine(**mb))
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():
            seen.append(
                {
                    "get_lr": engine.get_lr(),
                    "param_groups": [g["lr"] for g in optimizer.param_groups],
                    "scheduler": list(lr_scheduler.get_last_lr()) if lr_scheduler is not None else None,
                    "betas": [tuple(b) for b in engine.get_mom()],
                }
            )
        engine.step()
        losses.append(loss.item())
    return losses, seen, engine


def _plain(model, G, case, batches):
    """Plain torch: loss / G accumulated, AdamW (fused, zerofit's kernel), the scheduler stepped after each
    optimizer step. Returns (losses, per step the lr and betas each group used)."""
    *_, reference = CASES[case]
    opt = _adamw(model.parameters(), fused=True)
    sched = reference(opt)
    losses, used = [], []
    for i, mb in enumerate(batches):
        loss = loss_of(model(**mb))
        (loss / G).backward()
        losses.append(loss.item())
        if (i + 1) % G == 0:
            used.append(
                {"lr": [g["lr"] for g in opt.param_groups], "betas": [tuple(g["betas"]) for g in opt.param_groups]}
            )
            opt.step()
            opt.zero_grad()
            sched.step()
    return losses, used


def _assert_same_weights(engine, ref):
    master = engine.master_state_dict()
    for n, p in ref.named_parameters():
        assert torch.equal(master[n], p.detach()), n


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_schedule_matches_plain_torch_bitwise(case, G):
    torch.manual_seed(0)
    model = tm.PlainLM()
    ref = copy.deepcopy(model)
    batches = [mb for mbs in tm.batches(STEPS, G) for mb in mbs]
    losses, seen, engine = _zerofit(model, G, case, batches)
    want, used = _plain(ref, G, case, batches)
    assert losses == want
    _assert_same_weights(engine, ref)
    assert len(seen) == len(used) == STEPS
    for s, (got, applied) in enumerate(zip(seen, used)):
        assert got["get_lr"] == got["param_groups"] == applied["lr"], (s, got, applied)
        if got["scheduler"] is not None:
            assert got["scheduler"] == applied["lr"], (s, got, applied)
        assert got["betas"] == applied["betas"], (s, got, applied)
    if case in ("OneCycle", "torch-OneCycleLR"):  # momentum cycles: the betas moved
        assert len({b for step in used for b in step["betas"]}) > 2
    assert len({step["lr"][0] for step in used}) > 2, "the schedule must move the lr"
    engine.close()


@pytest.mark.parametrize("case", ["LambdaLR", "transformers-cosine", "OneCycle"])
def test_resume_mid_schedule_continues_bitwise(case, tmp_path):
    G = 2
    torch.manual_seed(0)
    model = tm.PlainLM()
    other = copy.deepcopy(model)
    batches = [mb for mbs in tm.batches(STEPS, G) for mb in mbs]
    full, full_seen, e1 = _zerofit(model, G, case, batches)
    resumed, resumed_seen, e2 = _zerofit(other, G, case, batches, resume_at=3 * G, tmp_path=tmp_path)
    assert resumed == full and resumed_seen == full_seen
    a, b = e1.master_state_dict(), e2.master_state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert e2.lr_scheduler.state_dict() == e1.lr_scheduler.state_dict()
    # a client scheduler's state is a side file of the checkpoint; the config's OneCycle is the step count's
    assert (tmp_path / "mid" / "lr_scheduler.pt").is_file() == (case != "OneCycle")
    e1.close()
    e2.close()


def test_groups_take_their_own_scheduled_lr():
    """Two groups with their own lr and their own lambda (LambdaLR's list form): each group's lr per step."""
    G = 2
    torch.manual_seed(0)
    model = tm.PlainLM()
    ref = copy.deepcopy(model)

    def groups(m):
        return [
            {"params": [p for p in m.parameters() if p.dim() >= 2]},
            {"params": [p for p in m.parameters() if p.dim() < 2], "lr": 3e-3, "weight_decay": 0.0},
        ]

    lambdas = [_warmup_decay, lambda s: 0.5**s]
    opt = _adamw(groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=_config(G), device="cpu"
    )
    assert lr_scheduler is sched and engine.config.optimizer.lr == LR  # initial_lr, not the zeroed lr
    ref_opt = _adamw(groups(ref), fused=True)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambdas)
    batches = [mb for mbs in tm.batches(STEPS, G) for mb in mbs]
    for i, mb in enumerate(batches):
        loss = loss_of(engine(**mb))
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():
            assert engine.get_lr() == [g["lr"] for g in ref_opt.param_groups] == sched.get_last_lr()
        engine.step()
        ref_loss = loss_of(ref(**mb))
        (ref_loss / G).backward()
        assert loss.item() == ref_loss.item(), i
        if (i + 1) % G == 0:
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
    _assert_same_weights(engine, ref)
    engine.close()


def test_a_client_optimizer_alone_applies_its_param_groups_as_deepspeed():
    """Without lr_scheduler and without a config schedule, DeepSpeed's optimizer is the client's: a change to its
    param_groups (by hand, or by a scheduler the script steps itself) applies from the next step; the optimizer
    initialize returns shows them, writable."""
    torch.manual_seed(0)
    model = tm.PlainLM()
    ref = copy.deepcopy(model)
    opt = _adamw(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # stepped by the script
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, optimizer=opt, config=_config(1), device="cpu"
    )
    assert lr_scheduler is None and optimizer.param_groups is opt.param_groups
    ref_opt = _adamw(ref.parameters(), fused=True)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for s, mb in enumerate(tm.batches(STEPS, 1)):
        loss = loss_of(engine(**mb[0]))
        engine.backward(loss)
        engine.step()
        sched.step()
        if s == 3:
            optimizer.param_groups[0]["lr"] = 2e-3  # a script that sets the lr itself
        ref_loss = loss_of(ref(**mb[0]))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        if s == 3:
            ref_opt.param_groups[0]["lr"] = 2e-3
        assert loss.item() == ref_loss.item() and engine.get_lr() == [ref_opt.param_groups[0]["lr"]], s
    _assert_same_weights(engine, ref)
    engine.close()


@pytest.mark.parametrize(
    "name, params",
    [
        ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 3, "warmup_type": "linear"}),
        ("WarmupCosineLR", {"total_num_steps": STEPS, "warmup_num_steps": 2, "warmup_min_ratio": 0.1}),
    ],
)
def test_deepspeed_warmups_over_groups_of_their_own_lr(name, params):
    """DeepSpeed's WarmupLR with warmup_max_lr gives every group the schedule's lr; its WarmupCosineLR scales each
    group's own: the lr of every group at every step is DeepSpeed's class's, over the same groups."""
    schedules = _ds_lr_schedules()
    torch.manual_seed(0)
    model = tm.PlainLM()

    def groups(m):
        return [
            {"params": [p for p in m.parameters() if p.dim() >= 2]},
            {"params": [p for p in m.parameters() if p.dim() < 2], "lr": 5e-4},
        ]

    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model,
        model_parameters=groups(model),
        device="cpu",
        config=_config(
            1, optimizer={"type": "AdamW", "params": {"lr": LR}}, scheduler={"type": name, "params": params}
        ),
    )
    ref_opt = torch.optim.AdamW(groups(copy.deepcopy(model)), lr=LR)
    ref = getattr(schedules, name)(ref_opt, **params)
    for mb in tm.batches(STEPS, 1):
        assert engine.get_lr() == [g["lr"] for g in ref_opt.param_groups] == lr_scheduler.get_last_lr()
        engine.backward(loss_of(engine(**mb[0])))
        engine.step()
        ref.step()
    if name == "WarmupLR":
        assert len(set(engine.get_lr())) == 1
    engine.close()


def test_unmanaged_gradient_accumulation_steps_at_every_step_call():
    """managed_gradient_accumulation false (DeepSpeed 0.19.8): every engine.step() after a backward() is the
    boundary; the gradient is still that of loss / gradient_accumulation_steps, as DeepSpeed scales it."""
    G = 2
    torch.manual_seed(0)
    model = tm.PlainLM()
    ref = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(
        model=model,
        device="cpu",
        config=_config(
            G,
            managed_gradient_accumulation=False,
            optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        ),
    )
    ref_opt = _adamw(ref.parameters(), fused=True)
    windows = [1, 2, 1]  # micro-batches the caller gives each step
    batches = iter([mb for mbs in tm.batches(4, G) for mb in mbs])
    for n in windows:
        for _ in range(n):
            mb = next(batches)
            loss = loss_of(engine(**mb))
            engine.backward(loss)
            assert not engine.is_gradient_accumulation_boundary()  # true only inside step()
            (loss_of(ref(**mb)) / G).backward()
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad()
        assert engine.was_step_applied()
    assert engine.global_steps == len(windows) and engine.global_samples == sum(windows) * 2
    _assert_same_weights(engine, ref)
    with pytest.raises(DeepSpeedUnsupported, match="managed_gradient_accumulation false"):
        engine.set_gradient_accumulation_boundary(True)
    for _ in range(G):
        engine.backward(loss_of(engine(**next(batches))))
    with pytest.raises(DeepSpeedUnsupported, match=r"micro-batch 3 before engine\.step\(\) with managed"):
        engine(**tm.batches(1, 1)[0][0])
    engine.step()  # the engine goes on: the refused call changed nothing
    assert engine.global_steps == len(windows) + 1
    engine.close()


def test_client_schedulers_zerofit_cannot_follow_are_refused():
    m = tm.PlainLM()
    opt = _adamw(m.parameters())
    other = torch.optim.lr_scheduler.LambdaLR(_adamw(tm.PlainLM().parameters()), _warmup_decay)
    with pytest.raises(ValueError, match="not over the optimizer zerofit reads its learning rates from"):
        deepspeed.initialize(model=m, optimizer=opt, lr_scheduler=other, config=_config(1), device="cpu")
    with pytest.raises(ValueError, match="returned a int, not a scheduler"):
        deepspeed.initialize(model=tm.PlainLM(), lr_scheduler=lambda o: 3, config=_config(1), device="cpu")
    with pytest.raises(DeepSpeedUnsupported, match="expected a scheduler with step"):
        deepspeed.initialize(model=tm.PlainLM(), lr_scheduler=object(), config=_config(1), device="cpu")
    m = tm.PlainLM()
    opt = _adamw(m.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_decay)
    engine, *_ = deepspeed.initialize(model=m, optimizer=opt, lr_scheduler=sched, config=_config(1), device="cpu")
    assert engine.config.optimizer.lr == LR and engine.get_lr() == [0.0]  # the base lr is initial_lr
    assert engine.config.scheduler.type == "constant"  # the client's scheduler replaces the config's block
    opt.param_groups[0]["betas"] = (0.9, 1.5)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['betas'\] is \(0\.9, 1\.5\)"):
        engine.get_mom()
    engine.close()


def test_a_skipped_fp16_step_does_not_step_the_scheduler():
    """DeepSpeed steps the scheduler only after an applied step: an fp16 step skipped for overflow (the first
    ones, at a loss scale of 2**18) leaves it where it is, and the applied steps take its lrs in order."""
    torch.manual_seed(0)
    model = tm.PlainLM()
    opt = _adamw(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_decay)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=sched,
        device="cpu",
        config=_config(1, fp16={"enabled": True, "initial_scale_power": 18, "hysteresis": 1}),
    )
    applied = []
    for mb in tm.batches(8, 1):
        lr = engine.get_lr()[0]
        engine.backward(loss_of(engine(**mb[0])))
        engine.step()
        if engine.was_step_applied():
            applied.append(lr)
        assert sched.last_epoch == engine.global_step
    assert engine.skipped_steps > 0 and engine.global_step > 2
    assert applied == [LR * _warmup_decay(s) for s in range(engine.global_step)]
    engine.close()
