"""Parameter groups ([Note: parameter groups], src/zerofit/engine/model/groups.py) are torch.optim.AdamW's: parity with
``torch.optim.AdamW(groups)`` on the CPU, on every path that runs AdamW or undoes it (CPU updates during the
backward, device-optimized units, speculative updates held and rolled back, deferred updates with the device
updating blocks in chunks that straddle group borders, fp16), the schedule scaling each group's lr, an exact
resume from a checkpoint, and the refusals.

fp32 losses and weights at the tolerances of test_engine_parity.py (torch.testing's fp32 defaults, rtol 1.3e-6,
atol 1e-5).
"""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
from torch import nn

import zerofit
from tests.support import tiny_models as tm
from zerofit.config import ConfigError

G = 2
OWN = {"lr": 3e-3, "weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}  # the third group's own values


def _cfg(**kw):
    base = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": G,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    }
    base.update(kw)
    return base


def _group_names(model: nn.Module) -> list[list[str]]:
    """The Hugging Face Trainer's rule (no decay on biases and norm weights), and the MLP's down projections
    (``down_proj``, or ``down`` in tiny_models.Block) in a group of their own: [decay, no decay, own]."""
    no_decay = {
        f"{mn}.{pn}" if mn else pn
        for mn, m in model.named_modules()
        if "Norm" in type(m).__name__
        for pn, _ in m.named_parameters(recurse=False)
    }
    names = [n for n, _ in model.named_parameters()]
    no_decay |= {n for n in names if "bias" in n}
    own = [n for n in names if ("down_proj." in n or ".down." in n) and n not in no_decay]
    return [[n for n in names if n not in no_decay and n not in own], [n for n in names if n in no_decay], own]


def _groups(model: nn.Module, by_name: bool = False) -> list[dict]:
    """torch-format groups of ``model``'s parameters (or their names): decay 0.1, no decay, own lr/betas/eps."""
    params = dict(model.named_parameters())
    decay, no_decay, own = ([n if by_name else params[n] for n in names] for names in _group_names(model))
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        {"params": own, **OWN},
    ]


def _assert_same_weights(engine, ref: nn.Module, exact: bool = False):
    master = engine.master_state_dict()
    for name, p in ref.named_parameters():
        if exact:
            assert torch.equal(master[name], p.detach()), name
        else:
            torch.testing.assert_close(master[name], p.detach(), msg=lambda m, name=name: f"{name}: {m}")


def _optimizer_threads() -> int:
    return sum(t.name == "zerofit-cpu-optimizer" and t.is_alive() for t in threading.enumerate())


# ---------------------------------------------------------------------------------------------- parity


CASES = {
    # CPU updates during the backward; the shell's optimizer on the device
    "no-clipping": dict(),
    # the shell on the CPU worker too
    "no-clipping-host-shell": dict(offload={"shell_optimizer": "host"}),
    # speculative updates, every one held
    "never-clipped": dict(gradient_clipping=1e3),
    # the first step is rolled back (the first block's norm alone proves clipping: nothing was speculated),
    # then deferred updates: the CPU and the device share them
    "always-clipped": dict(gradient_clipping=0.05),
    # this model's norms lie between 1.11 and 1.26: steps held, steps whose speculated blocks are rolled back
    # (per segment, with each group's values) and redone, deferred steps
    "mixed": dict(gradient_clipping=1.16),
    # deferred updates, every streamed block updated by the device in chunks
    "always-clipped-assisted": dict(
        gradient_clipping=0.05, offload={"speculative_updates": False, "assisted_fraction": 1.0}
    ),
    # the DeepSpeed-shaped API: gradients summed on the host, every update at the accumulation boundary
    "deepspeed-api-clipped": dict(gradient_clipping=0.05),
}


@pytest.mark.parametrize("case", list(CASES))
def test_groups_match_torch_adamw_groups(case, monkeypatch):
    import zerofit.engine.update.unit_adamw as optimizer_module

    kw = CASES[case]
    rollbacks = []
    real = optimizer_module.adamw_rollback
    monkeypatch.setattr(
        optimizer_module, "adamw_rollback", lambda master, *a: (rollbacks.append(master.numel()), real(master, *a))
    )
    steps = 8
    torch.manual_seed(0)
    model = tm.qwen2()  # attention biases, RMSNorm weights: three segments per block
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(**kw), param_groups=_groups(model))
    for u in engine.blocks:
        assert [s.group for s in u.segments] == [0, 1, 2], u.segments
    calls = []
    assisted = engine.device_updates.assisted_update
    monkeypatch.setattr(
        engine.device_updates, "assisted_update", lambda unit, dst: (calls.append(unit.name), assisted(unit, dst))
    )
    data = tm.batches(steps, G)
    step = tm.ds_step if case.startswith("deepspeed") else type(engine).train_batch
    losses = [step(engine, mbs) for mbs in data]
    clip = kw.get("gradient_clipping", 0.0)
    ref_losses = tm.reference_train(ref, data, clip=clip, param_groups=_groups(ref))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    _assert_same_weights(engine, ref)
    stats = engine.speculation_stats
    if case == "never-clipped":
        assert stats == {"held": steps, "rolled_back": 0, "waited": 0}
    elif case == "always-clipped":
        assert stats == {"held": 0, "rolled_back": 1, "waited": steps - 1} and calls and not rollbacks
    elif case == "mixed":
        assert stats["held"] >= 1 and stats["rolled_back"] >= 2 and stats["waited"] >= 1, stats
        sizes = {s.numel for s in engine.blocks[-1].segments}
        assert len(rollbacks) >= 6 and sizes <= set(rollbacks), (sizes, rollbacks)  # per segment, every segment
    elif case == "always-clipped-assisted":
        chunk = engine.device_updates.buffers[0][0].numel()
        streamed = [u for u in engine.blocks if u.home.name == "STREAMED"]
        # a chunk straddles a border between two groups' segments (else that case would go untested)
        assert any(s.offset % chunk for u in streamed for s in u.segments[1:]), (chunk, streamed[0].segments)
        assert sorted(set(calls)) == sorted(u.name for u in streamed) and len(calls) == steps * len(streamed)
    if case == "no-clipping":
        # the groups matter: without them, each group has parameters that end elsewhere (so the comparisons
        # above see a group's hyperparameters applied to the wrong parameters)
        torch.manual_seed(0)
        plain = tm.qwen2()
        tm.reference_train(plain, data, clip=clip)
        for names in _group_names(ref):
            assert any(
                not torch.allclose(ref.get_parameter(n), plain.get_parameter(n), rtol=1.3e-6, atol=1e-5) for n in names
            ), names
    engine.close()


@pytest.mark.parametrize(
    "clip,kw",
    [(0.0, {}), (1e3, {}), (1.16, {}), (0.05, {"speculative_updates": False, "assisted_fraction": 1.0})],
    ids=["no-clipping", "never-clipped", "mixed", "always-clipped-assisted"],
)
def test_groups_with_the_same_values_change_nothing(clip, kw):
    """Groups that all take the config's values split every unit into segments (and reorder its layout), but
    the math is elementwise with one step count per unit ([Note: one step per unit]): the weights and moments
    are bitwise those of no groups. A step counter advanced per segment would change the bias corrections."""
    results = []
    for how in ("none", "groups", "list"):
        torch.manual_seed(0)
        model = tm.qwen2()
        if how == "groups":
            groups = [{"params": g["params"]} for g in _groups(model)]
        else:  # DeepSpeed's model_parameters=model.parameters(): one group
            groups = list(model.parameters()) if how == "list" else None
        engine = zerofit.initialize(model, _cfg(gradient_clipping=clip, offload=kw), param_groups=groups)
        assert len(engine.blocks[0].segments) == (3 if how == "groups" else 1)
        losses = [engine.train_batch(mbs) for mbs in tm.batches(6, G)]
        engine.wait()
        moments = {}
        for u in engine.units:
            for k in ("exp_avg", "exp_avg_sq"):
                for n, v in u.layout.views(getattr(u, k)).items():
                    moments[f"{u.name}/{n}.{k}"] = v.clone()
            moments[f"{u.name}/step"] = u.step.clone()
        results.append((losses, engine.master_state_dict(), moments, engine.speculation_stats))
        engine.close()
    (l0, w0, m0, s0) = results[0]
    for losses, w, m, s in results[1:]:
        assert losses == l0 and s == s0
        for n in w0:
            assert torch.equal(w[n], w0[n]), n
        for n in m0:
            assert torch.equal(m[n], m0[n]), n


def test_schedule_scales_every_group_lr_as_lambda_lr():
    """A warm-up + cosine schedule: each group's lr times lr_at(step) / optimizer.lr, as LambdaLR(make_lambda);
    groups given by parameter names, on a model with tied embeddings (one parameter, two names)."""
    from zerofit.config.schema import SchedulerConfig
    from zerofit.optim.schedules import make_lambda

    torch.manual_seed(0)
    model = tm.llama(tied=True)
    ref = copy.deepcopy(model)
    sched = {"type": "cosine", "warmup_steps": 3, "total_steps": 10, "min_lr_ratio": 0.1}
    groups = _groups(model, by_name=True)
    groups[0]["params"].append("lm_head.weight")  # the tied head, already listed as the embedding
    engine = zerofit.initialize(model, _cfg(scheduler=sched), param_groups=groups)
    data = tm.batches(10, G)
    losses = [engine.train_batch(mbs) for mbs in data]
    lam = make_lambda(1e-3, SchedulerConfig(**sched))
    ref_losses = tm.reference_train(ref, data, sched=lam, param_groups=_groups(ref))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    _assert_same_weights(engine, ref)
    engine.close()


def test_fp16_groups_match_the_fp32_master_reference():
    """fp16 compute, dynamic loss scale, clipping: deferred updates (part of them on the device) per group."""
    from zerofit.optim.loss_scaler import DynamicLossScaler

    steps, lr, clip = 10, 3e-3, 1.0
    torch.manual_seed(0)
    model = tm.llama(tied=False)
    master = copy.deepcopy(model)
    before = tm.initial_weights(model)
    cfg = _cfg(
        precision="fp16",
        gradient_clipping=clip,
        optimizer={"lr": lr, "weight_decay": 0.01},
        fp16={"initial_scale_power": 10, "loss_scale_window": 4, "hysteresis": 2, "min_loss_scale": 1},
    )
    engine = zerofit.initialize(model, cfg, param_groups=_groups(model))
    assert engine.plan.assisted_updates
    mbs = tm.batches(1, G)[0]
    losses, scales = [], []
    for _ in range(steps):
        scales.append(engine.scaler.scale)
        losses.append(engine.train_batch(mbs))
    ref_losses, ref_scales = tm.fp16_reference_train(
        master, mbs, steps, lr, DynamicLossScaler(2.0**10, 4, 1.0, 2), clip=clip, param_groups=_groups(master)
    )
    assert scales == ref_scales
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)
    tm.assert_updates_close(engine, before, master, rtol=0.1)
    engine.close()


def test_groups_survive_the_generic_fallback():
    """A model whose blocks are not chained is rebuilt as one generic unit after its first forward
    ([Note: generic fallback]); the groups, resolved to names, carry over: one unit of three segments."""
    torch.manual_seed(0)
    model = tm.LoopedLM()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(), param_groups=_groups(model))
    assert engine.adapter.streaming
    data = tm.batches(4, G)
    losses = [engine.train_batch(mbs) for mbs in data]
    assert not engine.adapter.streaming and len(engine.units) == 1
    assert [s.group for s in engine.units[0].segments] == [0, 1, 2]
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(tm.reference_train(ref, data, param_groups=_groups(ref)))
    )
    _assert_same_weights(engine, ref)
    engine.close()


# ---------------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_with_groups_resumes_bitwise(tmp_path, caplog):
    """Save after 3 steps, train 3 more; a new engine with the same groups loads and trains the same 3 steps:
    the same losses and weights, bitwise. Tensors are stored by name: the checkpoint loads into an engine
    without groups too (its layout differs), with a warning that the groups changed."""
    data = tm.batches(6, G)
    cfg = _cfg(gradient_clipping=0.05)  # rollback, deferred and assisted updates on the way

    def fresh(groups=True):
        torch.manual_seed(0)
        model = tm.qwen2()
        return zerofit.initialize(model, cfg, param_groups=_groups(model, by_name=True) if groups else None)

    engine = fresh()
    for mbs in data[:3]:
        engine.train_batch(mbs)
    engine.save_checkpoint(tmp_path, "mid")
    saved = engine.master_state_dict()
    straight = [engine.train_batch(mbs) for mbs in data[3:]]
    final = engine.master_state_dict()
    engine.close()

    caplog.set_level(logging.WARNING, logger="zerofit")
    resumed = fresh()
    resumed.load_checkpoint(tmp_path, "mid")
    assert "param_groups" not in caplog.text
    assert [resumed.train_batch(mbs) for mbs in data[3:]] == straight
    w = resumed.master_state_dict()
    for n in final:
        assert torch.equal(w[n], final[n]), n
    resumed.close()

    plain = fresh(groups=False)
    assert len(plain.blocks[0].segments) == 1
    plain.load_checkpoint(tmp_path, "mid")
    assert "saved with a different param_groups" in caplog.text
    w = plain.master_state_dict()
    for n in saved:
        assert torch.equal(w[n], saved[n]), n
    plain.close()


# ---------------------------------------------------------------------------------------------- refusals


def _refused(model, groups, *fragments):
    threads = _optimizer_threads()
    with pytest.raises(ConfigError) as err:
        zerofit.initialize(model, _cfg(), param_groups=groups)
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))
    assert _optimizer_threads() == threads, "refused after the engine started allocating"
    return str(err.value)


def test_refusals_name_the_key_or_the_parameters():
    torch.manual_seed(0)
    model = tm.llama(tied=True)
    params = dict(model.named_parameters())
    groups = _groups(model)

    _refused(model, [{**groups[0], "amsgrad": True}, *groups[1:]], "param_groups[0].amsgrad", "amsgrad=True")
    _refused(model, [*groups[:2], {**groups[2], "foreach": False}], "param_groups[2].foreach")
    _refused(model, [*groups[:2], {**groups[2], "betas": (0.9, 1.5)}], "param_groups[2].betas", "[0, 1)")
    _refused(model, [{**groups[0], "lr": -1.0}, *groups[1:]], "param_groups[0].lr")

    twice = "model.layers.1.mlp.up_proj.weight"
    msg = _refused(
        model,
        [groups[0], {**groups[1], "params": groups[1]["params"] + [params[twice]]}, groups[2]],
        twice,
        "groups 0, 1",
        "exactly one group",
    )
    assert msg.count("model.layers") == 1
    # the tied head, by its other name in another group: one parameter in two groups
    _refused(
        model,
        [groups[0], {**groups[1], "params": groups[1]["params"] + ["lm_head.weight"]}, groups[2]],
        "model.embed_tokens.weight (groups 0, 1)",
    )

    # parameters in no group are not trained, as torch.optim leaves them ([Note: frozen parameters]): a warning
    # names them; a model with nothing left to train is refused
    _refused(model, [{"params": [], "lr": 1e-3}], "param_groups", "at least one parameter", "every group is empty")

    _refused(
        model,
        [*groups, {"params": [nn.Parameter(torch.zeros(3, 4))]}],
        "param_groups[3].params",
        "shape [3, 4]",
        "not one of them",
    )
    _refused(
        model,
        [*groups[:2], {"params": ["model.layers.0.mlp.down_proj.weigth"]}],
        "param_groups[2].params",
        "did you mean 'model.layers.0.mlp.down_proj.weight'",
    )
    _refused(model, [*groups[:2], {"lr": 1e-3}], "param_groups[2].params")
    _refused(model, {"params": list(model.parameters())}, "param_groups", "a dict")
