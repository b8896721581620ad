"""``import zerofit.deepspeed as deepspeed``: DeepSpeed's tutorial loop, unchanged, with zerofit's engine.

The loop as users write it (``deepspeed.initialize`` with ``training_data``, ``engine(**batch).loss``,
``engine.backward``, ``engine.step``, ``zero_grad``, ``get_lr`` logging, the accumulation boundary) gives
plain PyTorch's per-micro-batch losses and final weights (torch.optim.AdamW, loss / G accumulated, global-norm
clipping) at fp32 tolerances; the learning rates follow DeepSpeed's own formulas, written out here. Every
DeepSpeed feature zerofit does not provide is refused with an error naming it.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import zerofit.deepspeed as deepspeed
from tests.support import tiny_models as tm
from zerofit.config import load_config
from zerofit.deepspeed import DeepSpeedUnsupported, UnsupportedAttribute
from zerofit.engine.model.adapter import loss_of

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
MICRO, T = 2, 16


# ---------------------------------------------------------------------------------------------- helpers


def _ds_config(G: int, clip: float = 0.0, scheduler=None, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": G,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    }
    if scheduler:
        cfg["scheduler"] = scheduler
    cfg.update(extra)
    return cfg


class _Samples(torch.utils.data.Dataset):
    """Token sequences, one per index (input_ids == labels); the default collate stacks them to (B, T)."""

    def __init__(self, n: int, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, tm.VOCAB, (n, T), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _deepspeed_lr(kind: str, s: int, lr: float, warmup: int, total: int | None = None, min_lr: float = 0.0) -> float:
    """The lr of applied optimizer step ``s`` under DeepSpeed's linear-warm-up WarmupLR / WarmupDecayLR, as
    deepspeed/runtime/lr_schedules.py computes it: the scheduler is built at last_batch_iteration -1 (min_lr)
    and stepped after every applied step."""
    it = s - 1
    if it < 0:
        return min_lr
    w = max(2, warmup)
    if it < w:
        gamma = it / w
    elif kind == "WarmupLR":
        gamma = 1.0
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - w))
    return min_lr + (lr - min_lr) * gamma


def _reference(
    model: nn.Module,
    batches: list[dict],
    G: int,
    lrs: list[float],
    *,
    clip: float = 0.0,
    betas=(0.9, 0.999),
    eps=1e-8,
    groups=None,
) -> list[float]:
    """Plain PyTorch, micro-batch by micro-batch: (loss / G).backward(), global-norm clipping, AdamW with
    ``lrs[s]`` as step s's lr (per group, ``lrs[s]`` a list, when ``groups``). Returns every micro-batch's loss."""
    opt = torch.optim.AdamW(groups or model.parameters(), lr=1.0, betas=betas, eps=eps, weight_decay=0.01)
    losses = []
    for i, mb in enumerate(batches):
        loss = model(**mb).loss
        (loss / G).backward()
        losses.append(loss.item())
        if (i + 1) % G == 0:
            s = i // G
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            step_lrs = lrs[s] if isinstance(lrs[s], list) else [lrs[s]] * len(opt.param_groups)
            for g, lr in zip(opt.param_groups, step_lrs):
                g["lr"] = lr
            opt.step()
            opt.zero_grad()
    return losses


def _assert_same_weights(engine, ref: nn.Module) -> None:
    master = engine.master_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(master[name], p.detach(), msg=lambda m, name=name: f"{name}: {m}")


def _run_tutorial_loop(engine, loader) -> dict:
    """The DeepSpeed tutorial loop, with the calls scripts commonly add around it."""
    seen = {"losses": [], "boundary": [], "lrs": [], "batches": []}
    for _step, batch in enumerate(loader):
        engine.zero_grad()
        outputs = engine(**batch)
        loss = outputs.loss
        engine.backward(loss)
        seen["boundary"].append(engine.is_gradient_accumulation_boundary())
        if engine.is_gradient_accumulation_boundary():
            seen["lrs"].append(engine.get_lr()[0])  # the lr this step() applies
        engine.step()
        seen["losses"].append(loss.item())
        seen["batches"].append(batch)
    return seen


# ---------------------------------------------------------------------------------------------- the tutorial loop

SCHEDULES = {
    "constant": None,
    "WarmupLR": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 3, "warmup_type": "linear"},
    },
    "WarmupDecayLR": {
        "type": "WarmupDecayLR",
        "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 2, "total_num_steps": 5, "warmup_type": "linear"},
    },
}


def _expected_lr(schedule: str, s: int) -> float:
    if schedule == "constant":
        return 1e-3
    if schedule == "WarmupLR":
        return _deepspeed_lr("WarmupLR", s, 2e-3, 3, min_lr=1e-4)
    return _deepspeed_lr("WarmupDecayLR", s, 1e-3, 2, total=5)


@pytest.mark.parametrize(
    "G,clip,schedule",
    [(2, 0.0, "constant"), (3, 0.05, "WarmupLR"), (4, 1.0, "WarmupDecayLR")],
    ids=["G2", "G3-clipped-WarmupLR", "G4-clip1-WarmupDecayLR"],
)
def test_tutorial_loop_matches_plain_pytorch(G, clip, schedule):
    steps = 5
    torch.manual_seed(0)
    model = tm.llama()
    ref = copy.deepcopy(model)
    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        training_data=_Samples(steps * G * MICRO),
        config=_ds_config(G, clip, SCHEDULES[schedule]),
        device="cpu",
    )
    assert engine.train_micro_batch_size_per_gpu() == MICRO and engine.gradient_accumulation_steps() == G
    assert engine.train_batch_size() == MICRO * G and engine.gradient_clipping() == clip
    assert (lr_scheduler is None) == (schedule == "constant")
    assert len(loader) == steps * G

    seen = _run_tutorial_loop(engine, loader)

    want_lrs = [_expected_lr(schedule, s) for s in range(steps)]
    assert seen["lrs"] == pytest.approx(want_lrs, rel=1e-12)
    assert seen["boundary"] == [(i + 1) % G == 0 for i in range(steps * G)]
    ref_losses = _reference(ref, seen["batches"], G, want_lrs, clip=clip)
    torch.testing.assert_close(torch.tensor(seen["losses"]), torch.tensor(ref_losses))
    _assert_same_weights(engine, ref)
    assert engine.global_steps == steps and engine.global_samples == steps * G * MICRO
    assert engine.micro_steps == steps * G
    # the loader read each window ahead and the loop's calls took it ([Note: the loader reads the window ahead])
    assert engine.window_stats == {"announced": steps, "mismatched": 0}
    nxt = _expected_lr(schedule, steps)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(nxt) and engine.get_lr() == pytest.approx([nxt])
    assert engine.optimizer is optimizer and engine.lr_scheduler is lr_scheduler
    if lr_scheduler is not None:
        assert lr_scheduler.get_last_lr() == pytest.approx([nxt])
        assert lr_scheduler.state_dict() == {"last_batch_iteration": steps - 1}
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in engine.module.parameters()}
    engine.close()


def test_loader_read_ahead_is_train_batch_bitwise_and_harmless_when_batches_change():
    """[Note: the loader reads the window ahead]: the tutorial loop over the loader initialize returns gives
    train_batch's losses and weights bitwise (bf16, G = 3, a short last window), every window's forwards made at
    once; a loop that moves each batch to new tensors still matches; one that changes them runs as without it,
    with the same results; the loader yields the same batches in the same order either way."""
    G, steps = 3, 3
    data = _Samples(steps * G * MICRO - MICRO)  # the last window has 2 micro-batches

    def run(change):
        torch.manual_seed(0)
        engine, _, loader, _ = deepspeed.initialize(
            model=tm.llama(), training_data=data, config=_ds_config(G, 0.0) | {"bf16": {"enabled": True}}, device="cpu"
        )
        losses, batches = [], []
        for i, batch in enumerate(loader):
            if i == len(loader) - 1:
                engine.set_gradient_accumulation_boundary(True)
            batches.append(batch)
            call = change(batch)
            out = engine(**call)
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.detach().float())
        return engine, losses, batches

    same, same_losses, batches = run(lambda b: b)
    assert same.window_stats == {"announced": steps, "mismatched": 0}
    # the reference: the same loop over a list (nothing read ahead), for full windows train_batch bitwise
    torch.manual_seed(0)
    ref_engine, _, _, _ = deepspeed.initialize(
        model=tm.llama(), config=_ds_config(G, 0.0) | {"bf16": {"enabled": True}}, device="cpu"
    )
    ref_losses = []
    for i, batch in enumerate(batches):
        if i == len(batches) - 1:
            ref_engine.set_gradient_accumulation_boundary(True)
        out = ref_engine(**batch)
        ref_engine.backward(out.loss)
        ref_engine.step()
        ref_losses.append(out.loss.detach().float())
    assert ref_engine.window_stats == {"announced": 0, "mismatched": 0}
    assert torch.equal(torch.stack(same_losses), torch.stack(ref_losses))
    moved, moved_losses, moved_batches = run(lambda b: {k: v.clone() for k, v in b.items()})
    assert moved.window_stats == {"announced": steps, "mismatched": 0}
    changed, changed_losses, changed_batches = run(
        lambda b: {**b, "labels": b["labels"].clone(), "input_ids": b["input_ids"].flip(-1)}
    )
    assert changed.window_stats == {"announced": 0, "mismatched": 0}
    for b1, b2 in zip(batches, changed_batches):
        assert torch.equal(b1["input_ids"], b2["input_ids"])
    assert torch.equal(torch.stack(moved_losses), torch.stack(same_losses))
    ref_engine.wait(), same.wait(), moved.wait()
    for ua, ub, uc in zip(same.units, ref_engine.units, moved.units):
        assert torch.equal(ua.master, ub.master) and torch.equal(ua.master, uc.master), ua.name
        assert torch.equal(ua.exp_avg, ub.exp_avg), ua.name
    full = len(batches) // G * G  # the full windows: train_batch's losses bitwise
    torch.manual_seed(0)
    tb, _, _, _ = deepspeed.initialize(
        model=tm.llama(), config=_ds_config(G, 0.0) | {"bf16": {"enabled": True}}, device="cpu"
    )
    assert [tb.train_batch(batches[i : i + G]) for i in range(0, full, G)] == [
        torch.stack(same_losses[i : i + G]).mean().item() for i in range(0, full, G)
    ]
    tb.close()
    for e in (same, moved, changed, ref_engine):
        e.close()


def test_client_adamw_settings_become_the_config():
    G, steps = 2, 4
    torch.manual_seed(0)
    model = tm.qwen2()
    ref = copy.deepcopy(model)
    client = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=_ds_config(G), device="cpu")
    assert engine.config.optimizer.lr == 2e-3 and engine.config.optimizer.betas == (0.8, 0.99)
    assert optimizer is not client and optimizer.param_groups[0]["eps"] == 1e-6
    assert engine.get_mom() == [(0.8, 0.99)] and engine.get_lr() == [2e-3]
    batches = [mb for mbs in tm.batches(steps, G) for mb in mbs]
    losses = [loss.item() for loss in tm.ds_losses(engine, batches)]
    ref_losses = _reference(ref, batches, G, [2e-3] * steps, betas=(0.8, 0.99), eps=1e-6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    _assert_same_weights(engine, ref)
    engine.close()


def test_accumulation_boundary_has_deepspeeds_meaning():
    """True from the forward of the last micro-batch of an accumulation until its step(); always with G == 1."""
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=tm.llama(), config=_ds_config(3), device="cpu")
    seen = []
    for mb in tm.batches(2, 3)[0] + tm.batches(2, 3, seed=2)[0]:
        seen.append(engine.is_gradient_accumulation_boundary())
        out = engine(**mb)
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.backward(out.loss)
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.step()
    assert seen == [False] * 6 + [True] * 3 + [False] * 6 + [True] * 3
    assert engine.global_steps == 2 and not engine.is_gradient_accumulation_boundary()
    engine.close()

    one, *_ = deepspeed.initialize(model=tm.llama(), config=_ds_config(1), device="cpu")
    assert one.is_gradient_accumulation_boundary()
    out = one(**tm.batches(1, 1)[0][0])
    one.backward(out.loss)
    assert one.is_gradient_accumulation_boundary()
    one.step()
    assert one.is_gradient_accumulation_boundary() and one.was_step_applied() and one.global_steps == 1
    one.close()


def test_param_groups_become_zerofit_groups():
    """A list of dicts as model_parameters (the Hugging Face weight-decay split): per-group lr and weight decay.
    Needs zerofit.initialize(..., param_groups=...) (merged from the param-groups branch)."""
    G, steps = 2, 4
    torch.manual_seed(0)
    model = tm.llama(tied=False)
    ref = copy.deepcopy(model)

    def split(m):
        decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in m.named_parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 5e-4}]

    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=split(model), config=_ds_config(G), device="cpu"
    )
    groups = optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and [g["lr"] for g in groups] == [1e-3, 5e-4]
    batches = [mb for mbs in tm.batches(steps, G) for mb in mbs]
    losses = [loss.item() for loss in tm.ds_losses(engine, batches)]
    ref_groups = split(ref)
    ref_losses = _reference(ref, batches, G, [[1e-3, 5e-4]] * steps, groups=ref_groups)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    _assert_same_weights(engine, ref)
    engine.close()


# ---------------------------------------------------------------------------------------------- configs


def test_config_from_args_deepspeed_config_json(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_ds_config(2, 1.0, dataloader_drop_last=True)))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    torch.manual_seed(0)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=tm.llama(), training_data=_Samples(11), device="cpu")
    assert engine.config.gradient_clipping == 1.0 and engine.gradient_accumulation_steps() == 2
    assert args.local_rank == 0
    assert len(loader) == 5 and all(b["input_ids"].shape == (MICRO, T) for b in loader)  # drop_last: 11 // 2
    with pytest.raises(ValueError, match="args.deepspeed_config"):
        deepspeed.initialize(args=args, model=tm.llama(), config=_ds_config(2))
    with pytest.raises(ValueError, match="needs a configuration"):
        deepspeed.initialize(model=tm.llama())
    engine.close()


_FIXTURE_FILES = sorted(FIXTURES.glob("*.json")) if FIXTURES.is_dir() else []


@pytest.mark.skipif(not _FIXTURE_FILES, reason=f"no DeepSpeed config fixtures under {FIXTURES}")
@pytest.mark.parametrize("path", _FIXTURE_FILES, ids=[p.stem for p in _FIXTURE_FILES])
def test_shared_fixture_config_runs_the_tutorial_loop(path):
    ds = json.loads(path.read_text())
    resolved = load_config(path).config
    micro, G = resolved.micro_batch_size, resolved.gradient_accumulation_steps
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed_config", str(path)])
    torch.manual_seed(0)
    model = tm.llama()
    engine, optimizer, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=_Samples(2 * micro * G), device="cpu"
    )
    assert (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()) == (micro, G)
    if "train_micro_batch_size_per_gpu" in ds:
        assert micro == ds["train_micro_batch_size_per_gpu"]
    if "gradient_accumulation_steps" in ds:
        assert G == ds["gradient_accumulation_steps"]
    if "train_batch_size" in ds:
        assert engine.train_batch_size() == ds["train_batch_size"]
    assert engine.fp16_enabled() == ds.get("fp16", {}).get("enabled", False)
    assert engine.gradient_clipping() == ds.get("gradient_clipping", 1.0)  # DeepSpeed 0.19.8's default
    lr = ds.get("optimizer", {}).get("params", {}).get("lr")
    if lr is not None:
        assert engine.get_lr() == [lr]
    seen = _run_tutorial_loop(engine, loader)  # two optimizer steps of data
    assert all(math.isfinite(x) for x in seen["losses"]), seen["losses"]
    assert engine.global_steps == 2 and engine.global_samples == 2 * micro * G
    assert engine.global_step + engine.skipped_steps == 2 and engine.global_step >= 1
    if engine.fp16_enabled():
        assert optimizer.loss_scale == engine.scaler.scale
    engine.close()


def test_training_data_loader_has_deepspeeds_order():
    """DeepSpeed's loader: a DistributedSampler over one rank, shuffled with seed 0 and the same order every
    epoch (DeepSpeed never sets its epoch), micro-batches of train_micro_batch_size_per_gpu."""
    data = _Samples(10)
    engine, _, loader, _ = deepspeed.initialize(
        model=tm.llama(), training_data=data, config=_ds_config(2), device="cpu"
    )
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        got = torch.cat([b["input_ids"] for b in loader])
        assert torch.equal(got, data.ids[order])
    assert len(loader) == 5 and loader.batch_size == MICRO
    ordered = engine.deepspeed_io(data, route="eval")
    assert torch.equal(torch.cat([b["input_ids"] for b in ordered]), data.ids)
    engine.close()


# ---------------------------------------------------------------------------------------------- zero.Init, gather


@pytest.mark.parametrize("build", [tm.llama, tm.PlainLM], ids=["llama-tied", "plain-module"])
def test_zero_init_builds_on_meta_and_the_engine_materializes(build):
    torch.manual_seed(0)
    with deepspeed.zero.Init(remote_device="cpu", pin_memory=True, config_dict_or_path=_ds_config(1)):
        model = build()
    assert nn.Module.register_parameter is deepspeed.zero.original_register
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    real = build()
    for (n, b), (_, rb) in zip(model.named_buffers(), real.named_buffers(), strict=True):
        assert torch.equal(b, rb), f"buffer {n} differs from a real model's"
    if build is tm.llama:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "tied weights must stay one parameter"
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=_ds_config(1, optimizer={"type": "AdamW", "params": {"lr": 3e-3}}),
        device="cpu",
    )
    assert not any(p.is_meta for p in engine.module.parameters())
    mb = tm.batches(1, 1)[0][0]
    losses = []
    for _ in range(25):
        loss = loss_of(engine(**mb))  # PlainLM returns the loss itself
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(tm.VOCAB), rel=0.1)  # a freshly initialized model
    assert losses[-1] < losses[0] - 1.0, losses
    engine.close()


def test_zero_init_disabled_or_on_error_leaves_torch_as_it_was():
    with deepspeed.zero.Init(enabled=False):
        model = tm.PlainLM()
    assert not any(p.is_meta for p in model.parameters())
    with pytest.raises(RuntimeError, match="boom"):
        with deepspeed.zero.Init():
            raise RuntimeError("boom")
    assert nn.Module.register_parameter is deepspeed.zero.original_register
    assert not any(p.is_meta for p in tm.PlainLM().parameters())


def test_gathered_parameters_reads_current_weights_and_refuses_writes():
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        model = tm.llama()
    with pytest.raises(DeepSpeedUnsupported, match="meta device"):
        with deepspeed.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
            pass
    engine, *_ = deepspeed.initialize(model=model, config=_ds_config(2), device="cpu")
    for mb in tm.batches(1, 2)[0]:
        engine.backward(engine(**mb).loss)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        read = {n: p.detach().clone() for n, p in model.named_parameters()}
    master = engine.master_state_dict()
    for n in master:
        assert torch.equal(read[n], master[n]), n
    with pytest.raises(DeepSpeedUnsupported, match="modifier_rank=0"):
        with deepspeed.zero.GatheredParameters(model.model.norm.weight, modifier_rank=0):
            pass
    engine.close()


# ---------------------------------------------------------------------------------------------- checkpoints


def test_save_and_load_checkpoint_return_client_state(tmp_path):
    G = 2
    torch.manual_seed(0)
    model = tm.llama()
    fresh_model = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(model=model, config=_ds_config(G), device="cpu")
    data = [mb for mbs in tm.batches(4, G) for mb in mbs]

    def train(e, mbs):
        out = []
        for mb in mbs:
            loss = e(**mb).loss
            e.backward(loss)
            e.step()
            out.append(loss.item())
        return out

    train(engine, data[:4])
    path = engine.save_checkpoint(tmp_path, tag="step2", client_state={"epoch": 3, "pos": 17})
    assert Path(path) == tmp_path / "step2"
    other, *_ = deepspeed.initialize(model=fresh_model, config=_ds_config(G), device="cpu")
    with pytest.raises(DeepSpeedUnsupported, match="load_module_only"):
        other.load_checkpoint(tmp_path, "step2", load_module_only=True)
    load_path, client_state = other.load_checkpoint(tmp_path, "step2")
    assert load_path == path and client_state == {"epoch": 3, "pos": 17}
    assert other.global_steps == 2 and other.global_samples == 2 * G * MICRO
    assert other.load_checkpoint(tmp_path)[1] == {"epoch": 3, "pos": 17}  # latest
    assert train(other, data[4:]) == train(engine, data[4:])
    a, b = engine.master_state_dict(), other.master_state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    engine.close()
    other.close()


# ---------------------------------------------------------------------------------------------- refusals


def _refused(match: str, **kwargs):
    torch.manual_seed(0)
    model = kwargs.pop("model", None) or tm.llama()
    with pytest.raises(DeepSpeedUnsupported, match=match):
        deepspeed.initialize(model=model, config=kwargs.pop("config", _ds_config(2)), device="cpu", **kwargs)


def test_client_optimizers_other_than_adamw_are_refused():
    m = tm.llama()
    _refused(
        r"torch\.optim\.sgd\.SGD.*\"optimizer\": \{\"type\": \"AdamW\"",
        model=m,
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
    )
    m = tm.llama()
    _refused(
        r"Adam with weight_decay=0\.1 .*decoupled",
        model=m,
        optimizer=torch.optim.Adam(m.parameters(), weight_decay=0.1),
    )
    m = tm.llama()
    _refused(
        r"callable returned a SGD|torch\.optim\.sgd\.SGD",
        model=m,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    m = tm.llama()
    _refused("amsgrad", model=m, optimizer=torch.optim.AdamW(m.parameters(), amsgrad=True))
    # an optimizer over some of the parameters leaves the others frozen, as DeepSpeed does
    # (tests/integration/test_frozen.py)
    # Adam with decoupled weight decay is AdamW, and a callable returning AdamW is what DeepSpeed calls with the
    # model parameters: both accepted, with their settings
    m = tm.llama()
    e, opt, _, _ = deepspeed.initialize(
        model=m,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=7e-4, weight_decay=0.02, decoupled_weight_decay=True),
        config=_ds_config(2),
        device="cpu",
    )
    assert (e.config.optimizer.lr, e.config.optimizer.weight_decay) == (7e-4, 0.02)
    e.close()


def test_foreign_scheduler_mpu_and_ranks_are_refused(monkeypatch):
    m = tm.llama()
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW(m.parameters()), lambda s: 1.0)
    # a scheduler object needs the client optimizer it was built over (DeepSpeed refuses it without one too)
    _refused(r"lr_scheduler=LambdaLR without the optimizer it was built over.*optimizer=", model=m, lr_scheduler=sched)
    _refused(r"initialize\(mpu=", mpu=object())
    _refused(r"mesh_param", mesh_param=(2, 1))
    with pytest.raises(DeepSpeedUnsupported, match=r"zero\.Init\(mpu="):
        deepspeed.zero.Init(mpu=object())
    monkeypatch.setenv("WORLD_SIZE", "2")
    _refused(r"WORLD_SIZE=2")
    with pytest.raises(DeepSpeedUnsupported, match="WORLD_SIZE=2"):
        deepspeed.init_distributed()


# model_parameters subsets and requires_grad=False: frozen, as DeepSpeed leaves them (tests/integration/test_frozen.py)


def test_unsupported_engine_optimizer_and_scheduler_calls_name_themselves():
    torch.manual_seed(0)
    sched = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=tm.llama(), config=_ds_config(2, scheduler=sched), device="cpu"
    )
    for name in ("no_sync", "save_16bit_model", "zero_optimization_stage", "allreduce_gradients", "compile"):
        with pytest.raises(UnsupportedAttribute, match=f"DeepSpeed engine has no {name}:"):
            getattr(engine, name)
        assert not hasattr(engine, name)
    # what the engine does not have itself goes on to the model, as DeepSpeed's engine passes it on
    assert sum(p.numel() for p in engine.parameters()) == sum(p.numel() for p in engine.module.parameters())
    assert engine.get_input_embeddings() is engine.module.get_input_embeddings()
    with pytest.raises(AttributeError, match="no attribute '_mistyped'"):
        _ = engine._mistyped
    with pytest.raises(DeepSpeedUnsupported, match=r"optimizer\.step\(\): engine\.step\(\)"):
        optimizer.step()
    with pytest.raises(DeepSpeedUnsupported, match="engine.save_checkpoint"):
        optimizer.state_dict()
    with pytest.raises(DeepSpeedUnsupported, match="param_groups is read-only"):
        optimizer.param_groups[0]["lr"] = 1.0
    with pytest.raises(UnsupportedAttribute, match="optimizer has no state"):
        _ = optimizer.state
    with pytest.raises(DeepSpeedUnsupported, match="load_state_dict"):
        lr_scheduler.load_state_dict({"last_batch_iteration": 5})
    with pytest.raises(UnsupportedAttribute, match="deepspeed has no init_inference"):
        _ = deepspeed.init_inference
    with pytest.raises(UnsupportedAttribute, match="deepspeed.zero has no TiledLinear"):
        _ = deepspeed.zero.TiledLinear
    mb = tm.batches(1, 1)[0][0]
    assert engine(mb["input_ids"]).loss is None  # positional, as the model takes it; dropped by the next
    out = engine(**mb)
    with pytest.raises(DeepSpeedUnsupported, match="retain_graph=True"):
        engine.backward(out.loss, retain_graph=True)
    engine.backward(out.loss)
    with pytest.raises(DeepSpeedUnsupported, match="lr_kwargs"):
        engine.step(lr_kwargs={"x": 1})
    before = lr_scheduler.get_last_lr()
    lr_scheduler.step()  # the engine steps the schedule: this one is a no-op
    optimizer.zero_grad()
    engine.step()
    assert lr_scheduler.get_last_lr() == before and engine.global_steps == 0  # G = 2: not at the boundary
    engine.close()


def test_init_distributed_makes_a_one_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    deepspeed.init_distributed(dist_init_required=False)
    assert not dist.is_initialized()
    deepspeed.init_distributed()
    try:
        assert dist.get_rank() == 0 and dist.get_world_size() == 1
        x = torch.ones(2)
        dist.all_reduce(x)
        assert torch.equal(x, torch.ones(2))
        deepspeed.init_distributed()  # already initialized: nothing to do
    finally:
        dist.destroy_process_group()
