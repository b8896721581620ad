"""GPU tier: the engine with real streams, pinned buffers and a memory cap. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.plan.search import PlanError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _gpu_batches(steps, G, B=2, T=32):
    return [[{k: v.cuda() for k, v in mb.items()} for mb in mbs] for mbs in tm.batches(steps, G, B, T)]


@pytest.mark.parametrize(
    "resident,clip,shell", [(0, 0.0, "auto"), (1, 0.0, "auto"), (1, 0.05, "auto"), (0, 0.0, "host")]
)
def test_fp32_parity_on_gpu_with_streaming(resident, clip, shell):
    """Some streamed blocks are updated on the device: during the backward without clipping ([Note: assisted
    updates in the backward]; with the shell's optimizer on the host, the shell too), during the next forward
    with it (clip > 0 defers the updates)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = tm.llama(layers=4)
    ref = copy.deepcopy(model).cuda()
    engine = zerofit.initialize(
        model,
        {
            "precision": "fp32",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"lr": 1e-3},
            # deferred: the split updates' default share (0.25) of 3 blocks is none
            "offload": {
                "resident_blocks": resident,
                "shell_optimizer": shell,
                **({"assisted_fraction": 0.5} if clip else {}),
            },
            "gradient_clipping": clip,
        },
    )
    assert engine.device.type == "cuda"
    assert engine.plan.assisted_updates and engine.plan.assisted_blocks
    calls = []
    inner = engine.device_updates.device_adamw
    engine.device_updates.device_adamw = lambda unit, grad, *a, **kw: (
        calls.append(unit.name),
        inner(unit, grad, *a, **kw),
    )[1]
    data = _gpu_batches(20, 2)
    losses = [engine.train_batch(mbs) for mbs in data]
    ref_losses = tm.reference_train(ref, data, clip=clip)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    master = engine.master_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach().cpu(), msg=lambda m, n=n: f"{n}: {m}")
    tl = engine.timeline()
    assert tl["upload"] > 0 and tl["download"] > 0 and tl["compute"] > 0
    assert {f"model.layers.{i}" for i in engine.plan.assisted_blocks} <= set(calls)
    assert ("shell" in calls) == (shell == "host")
    for u in engine.units:  # the state the device updates moves through pinned memory only
        if u.name in calls:
            assert u.master.is_pinned() and u.exp_avg.is_pinned() and u.exp_avg_sq.is_pinned(), u.name
    engine.close()


@pytest.mark.parametrize(
    "clip,offload",
    [(0.0, {}), (1.16, {}), (0.05, {"speculative_updates": False, "assisted_fraction": 1.0})],
    ids=["no-clipping", "mixed", "always-clipped-assisted"],
)
def test_param_groups_parity_on_gpu(clip, offload):
    """Parameter groups (tests/integration/test_param_groups.py) with real streams: the shell and a resident
    block updated on the device per segment (the factor multiplied into each segment's gradient there), streamed
    blocks on the CPU (speculated and rolled back with clip 1.16), or by the device in chunks straddling group
    borders."""
    from tests.integration.test_param_groups import _groups

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = tm.qwen2()
    ref = copy.deepcopy(model).cuda()
    engine = zerofit.initialize(
        model,
        {
            "precision": "fp32",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"lr": 1e-3},
            "gradient_clipping": clip,
            "offload": {"resident_blocks": 1, **offload},
        },
        param_groups=_groups(model),
    )
    assert engine.device.type == "cuda" and len(engine.blocks[0].segments) == 3
    data = _gpu_batches(10, 2)
    losses = [engine.train_batch(mbs) for mbs in data]
    ref_losses = tm.reference_train(ref, data, clip=clip, param_groups=_groups(ref))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    master = engine.master_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach().cpu(), msg=lambda m, n=n: f"{n}: {m}")
    if offload:
        assert engine.plan.assisted_blocks == {u.index for u in engine.blocks if u.home.name == "STREAMED"}
    engine.close()


def test_bf16_trains_and_respects_cap():
    torch.manual_seed(0)
    model = tm.llama(layers=6)
    cap = 2 << 30
    engine = zerofit.initialize(
        model,
        {
            "precision": "bf16",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"lr": 3e-3},
            "max_gpu_memory": cap,
            "offload": {"resident_blocks": 2},
        },
    )
    data = _gpu_batches(30, 2)
    losses = [engine.train_batch(data[0]) for _ in range(30)]
    assert losses[-1] < 0.7 * losses[0]
    assert torch.cuda.max_memory_allocated() <= cap
    engine.close()


def test_plan_refused_before_allocation():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = tm.llama(layers=2)
    before = torch.cuda.memory_allocated()
    with pytest.raises(PlanError, match="device needs"):
        zerofit.initialize(model, {"precision": "bf16", "max_gpu_memory": 1 << 20, "seq_len": 32})
    assert torch.cuda.memory_allocated() == before


def test_deepspeed_style_api_on_gpu_matches_train_batch():
    """Both APIs give the same step on the GPU (streams, pinned buffers, host accumulation)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    for style in ("train_batch", "deepspeed"):
        torch.manual_seed(0)
        model = tm.llama(layers=3)
        engine = zerofit.initialize(
            model,
            {
                "precision": "fp32",
                "micro_batch_size": 2,
                "gradient_accumulation_steps": 2,
                "optimizer": {"lr": 1e-3},
                "gradient_clipping": 0.5,
                "offload": {"resident_blocks": 1},
            },
        )
        for mbs in _gpu_batches(4, 2):
            if style == "train_batch":
                engine.train_batch(mbs)
            else:
                for mb in mbs:
                    engine.backward(engine(**mb).loss)
                    engine.step()
        results.append(engine.master_state_dict())
        engine.close()
    for n in results[0]:
        torch.testing.assert_close(results[0][n], results[1][n], msg=lambda m, n=n: f"{n}: {m}")


def test_fp16_with_clipping_on_gpu_tracks_the_reference():
    """fp16 compute, DeepSpeed loss scaling, clipping (deferred and assisted updates) with real streams."""
    from zerofit.optim.loss_scaler import DynamicLossScaler

    steps, lr, window = 14, 3e-3, 4
    torch.manual_seed(0)
    model = tm.llama(layers=4)
    master = copy.deepcopy(model).cuda()
    before = tm.initial_weights(model)
    engine = zerofit.initialize(
        model,
        {
            "precision": "fp16",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"lr": lr, "weight_decay": 0.01},
            "gradient_clipping": 0.5,
            "fp16": {"initial_scale_power": 10, "loss_scale_window": window},
            # the split updates' default share (0.25) of 3 blocks is none
            "offload": {"resident_blocks": 1, "assisted_fraction": 0.5},
        },
    )
    assert engine.plan.assisted_updates
    mbs = _gpu_batches(1, 2)[0]
    losses, scales = [], []
    for _ in range(steps):
        scales.append(engine.scaler.scale)
        losses.append(engine.train_batch(mbs))
    ref_losses, ref_scales = tm.fp16_reference_train(
        master, mbs, steps, lr, DynamicLossScaler(2.0**10, window, 1.0, 2), clip=0.5
    )
    assert scales == ref_scales
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)
    tm.assert_updates_close(engine, before, master, rtol=0.1)
    assert losses[-1] < losses[0] - 0.5
    engine.close()


def test_resume_in_a_new_process_is_bitwise_exact_on_gpu(tmp_path):
    """tests/support/resume_run.py's variants on the GPU (real streams, pinned buffers, CUDA RNG): 2N steps straight
    (saving at N) in one process, the last N steps after a load in another; every loss and the final masters,
    moments, step counts and loss scale bitwise equal (the placement variant: see below)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.support import resume_run

    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "ZEROFIT_RESUME_DEVICE": "cuda",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")]),
    }
    for mode in ("save", "resume"):
        r = subprocess.run(
            [sys.executable, str(root / "tests" / "support" / "resume_run.py"), mode, str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=280,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    straight = torch.load(tmp_path / "save.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resume.pt", weights_only=False)
    for name, a in straight.items():
        b = resumed[name]
        for k in ("unit_steps", "global_step", "skipped", "scale"):
            assert a[k] == b[k], f"{name}: {k} {a[k]} != {b[k]}"
        if name == "placement":
            # resumed with block 0 and the shell updated by the CPU's AdamW instead of the GPU's: the same math
            # in other kernels, so equal to fp32 rounding only (bitwise on the CPU, where both are the CPU's)
            torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-5, atol=0)
            for kind in ("master", "moments"):
                for k in a[kind]:
                    torch.testing.assert_close(
                        b[kind][k],
                        a[kind][k],
                        rtol=1e-4,
                        atol=1e-6,
                        check_device=False,
                        msg=lambda m, kind=kind, k=k: f"{kind} {k}: {m}",
                    )
            continue
        assert a["losses"] == b["losses"], f"{name}: losses differ after the resume"
        for kind in ("master", "moments"):
            diff = [k for k in a[kind] if not torch.equal(a[kind][k], b[kind][k])]
            assert not diff, f"{name}: {kind} differ for {diff[:3]}"
    assert len(straight) == len(resume_run.VARIANTS)


def test_load_a_model_directory_on_gpu(tmp_path):
    """Weights read from bf16 shards into pinned masters and device-resident units: exactly the files'."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = tm.llama(layers=4)
    model.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    engine = zerofit.initialize(
        str(tmp_path), {"precision": "bf16", "micro_batch_size": 2, "offload": {"resident_blocks": 1}}
    )
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    master = engine.master_state_dict()
    for n, p in ref.named_parameters():
        assert torch.equal(master[n], p.detach()), n
    assert engine.train_batch(_gpu_batches(1, 1)[0]) > 0
    engine.close()


# ---------------------------------------------------------------------------------------------- lifecycle


def test_training_scripts_exit_cleanly_on_gpu():
    """RELIABILITY.md "a process ends cleanly" on the GPU: pinned memory, a memory cap, CUDA streams and the CPU
    worker are all live when each script ends (tests/support/lifecycle_script.py says what each mode does)."""
    import signal

    from tests.support import lifecycle_script

    out = lifecycle_script.run_all("cuda", timeout=300)
    for mode, o in out.items():
        assert "terminate called" not in o.stderr and o.returncode not in (134, -signal.SIGABRT), (
            mode,
            o.returncode,
            o.stderr[-3000:],
        )
    assert out["return"].returncode == 0, out["return"].stderr[-3000:]
    assert out["raise"].returncode == 1 and "resume from the last checkpoint" in out["raise"].stderr
    assert out["raise-forward"].returncode == 1 and "was not applied" in out["raise-forward"].stderr
    o = out["sigint"]
    assert "training" in o.stdout and o.returncode != 0 and "KeyboardInterrupt" in o.stderr, o.stderr[-3000:]
    assert o.seconds_after_sigint is not None and o.seconds_after_sigint < 60, o.seconds_after_sigint


def test_close_releases_pinned_memory_the_cap_and_device_buffers():
    torch.manual_seed(0)
    base = torch.cuda.memory_allocated()
    engine = zerofit.initialize(
        tm.llama(layers=4),
        {
            "precision": "bf16",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "max_gpu_memory": 4 << 30,
            "gradient_clipping": 1.0,
            "offload": {"resident_blocks": 1},
        },
    )
    arenas = list(engine.lifecycle.resources.arenas)
    assert arenas and all(a.pinned for a in arenas)
    assert torch.cuda.get_per_process_memory_fraction() < 1.0
    for mbs in _gpu_batches(2, 2):
        engine.train_batch(mbs)
    with engine:
        pass  # the context manager closes
    assert not engine.worker.alive
    assert torch.cuda.get_per_process_memory_fraction() == 1.0
    for a in arenas:  # unregistered: registering the memory again works
        assert not a.pinned
        ptr, nbytes = a.tensor.data_ptr(), a.tensor.numel() * a.tensor.element_size()
        assert int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0
        torch.cuda.cudart().cudaHostUnregister(ptr)
    import gc

    gc.collect()
    assert torch.cuda.memory_allocated() - base < 16 << 20, "close() kept device buffers"
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())


def test_error_in_a_step_on_gpu_leaves_state_and_training_as_before():
    """A failure in the forward with real streams and pending assisted updates (clipping): nothing applied,
    device slots reset; the run then tracks one that never saw the failed batch."""
    from zerofit.engine.lifecycle import EngineState

    class Boom(RuntimeError):
        pass

    def build():
        torch.manual_seed(0)
        return zerofit.initialize(
            tm.llama(layers=4),
            {
                "precision": "fp32",
                "micro_batch_size": 2,
                "gradient_accumulation_steps": 2,
                "optimizer": {"lr": 1e-3},
                "gradient_clipping": 0.5,
                "offload": {"resident_blocks": 1},
            },
        )

    engine, clean = build(), build()
    data = _gpu_batches(3, 2)
    engine.train_batch(data[0])
    before = {n: v.clone() for n, v in engine.master_state_dict().items()}

    def boom(module, args):
        raise Boom("injected in block 2's forward")

    hook = engine.adapter.blocks[2].register_forward_pre_hook(boom)
    with pytest.raises(Boom):
        engine.train_batch(data[1])
    hook.remove()
    assert engine.state is EngineState.OPEN
    for n, v in engine.master_state_dict().items():
        assert torch.equal(v, before[n]), n
    engine.train_batch(data[2])
    for mbs in (data[0], data[2]):
        clean.train_batch(mbs)
    a, b = engine.master_state_dict(), clean.master_state_dict()
    for n in a:
        torch.testing.assert_close(a[n], b[n], msg=lambda m, n=n: f"{n}: {m}")
    engine.close()
    clean.close()


def test_deepspeed_loop_default_share_pins_its_moments_and_tracks_train_batch():
    """[Note: 16-bit copies after the update]: by default the loop's device share is larger than train_batch's
    (copies_fraction); the blocks it adds get their moments moved into pinned memory (a pageable copy is ~7x
    slower), and the run tracks train_batch's at fp32 rounding (the device's AdamW rounds unlike the CPU's)."""
    G3, steps = 3, 3
    cfg = {
        "precision": "bf16",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": G3,
        "optimizer": {"lr": 1e-3},
        "offload": {"resident_blocks": 1, "prefetch_depth": 1},
    }
    data = _gpu_batches(steps, G3)
    torch.manual_seed(0)
    a = zerofit.initialize(tm.llama(layers=9), cfg)
    torch.manual_seed(0)
    b = zerofit.initialize(tm.llama(layers=9), cfg)
    assert a.plan.assisted_updates and a.plan.assisted_blocks == b.plan.assisted_blocks
    for mbs in data:
        losses = tm.ds_losses(a, mbs)
        torch.testing.assert_close(torch.stack(losses).mean().item(), b.train_batch(mbs), rtol=1e-3, atol=0)
    assert len(a.plan.assisted_blocks) > len(b.plan.assisted_blocks)
    for u in a.blocks:
        if u.index in a.plan.assisted_blocks:
            assert u.exp_avg.is_pinned() and u.exp_avg_sq.is_pinned(), u.name
    a.wait(), b.wait()
    for ua, ub in zip(a.units, b.units):
        torch.testing.assert_close(
            ua.master.cpu(), ub.master.cpu(), rtol=1e-3, atol=2e-4, msg=lambda m, ua=ua: f"{ua.name}: {m}"
        )
    a.close(), b.close()


@pytest.mark.parametrize("clip,announce", [(0.0, False), (0.05, False), (0.0, True), (0.05, True)])
def test_deepspeed_style_loop_is_train_batch_bitwise_on_gpu(clip, announce):
    """The DeepSpeed-shaped loop with real streams: the blocks' backward at the boundary, the 16-bit host copies
    (pinned, filled on the download stream while slots are reused, and after each update: [Note: 16-bit copies after the
    update]) and the blocks kept in the gradient buffers' memory through a window's forwards ([Note: a window keeps some
    blocks]) give train_batch's losses and weights bitwise. Only the very first forward uploads every fp32 master;
    without clipping no later one does, with it the updates' bf16 casts ([Note: the master behind its cast]) serve the
    later forwards too, but for a step that speculated. With the window announced (forward_window), the forwards are
    made at once: train_batch's uploads, no copies."""
    G3, steps = 3, 4
    # the share of device updates set: the loop's default is larger than train_batch's ([Note: 16-bit copies after
    # the update]), and the device's AdamW rounds differently from the CPU's: then equal at fp32 rounding only
    cfg = {
        "precision": "bf16",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": G3,
        "optimizer": {"lr": 1e-3},
        "gradient_clipping": clip,
        "offload": {"resident_blocks": 1, "prefetch_depth": 1, "assisted_fraction": 0.375},
    }
    data = _gpu_batches(steps, G3)
    torch.manual_seed(0)
    a = zerofit.initialize(tm.llama(layers=5), cfg)
    torch.manual_seed(0)
    b = zerofit.initialize(tm.llama(layers=5), cfg)
    streamed = sum(1 for u in a.blocks if u.home.name == "STREAMED")
    kept = []
    inner = a.streamer.return_kept
    a.streamer.return_kept = lambda: (kept.append(len(a.streamer.kept)), inner())[1]
    for i, mbs in enumerate(data):
        if announce:
            a.forward_window(mbs)
        losses = tm.ds_losses(a, mbs)
        ups = tm.upload_labels(a)
        assert torch.stack(losses).mean().item() == b.train_batch(mbs)
        full = sum(1 for x in ups if not x.endswith("(16)"))
        if announce:
            assert ups == tm.upload_labels(b), ups
        elif i == 0:
            assert full == streamed, ups
        elif clip:  # the updates' casts serve the forward ([Note: the master behind its cast]), a settled one not
            assert full <= streamed, ups
        else:
            assert full == 0, ups
        if not announce:  # the kept blocks skip the two later forwards' uploads
            assert len(ups) <= streamed * (G3 + 1) - 2 * kept[-1], (ups, kept)
    assert len(kept) == steps and all(k == (0 if announce else 2) for k in kept), kept
    assert a.window_stats == {"announced": steps if announce else 0, "mismatched": 0}
    a.wait(), b.wait()
    for ua, ub in zip(a.units, b.units):
        assert torch.equal(ua.master.cpu(), ub.master.cpu()), ua.name
    a.close(), b.close()


@pytest.mark.parametrize(
    "weights,clip,api",
    [(True, 0.0, "train_batch"), (False, 0.0, "train_batch"), (True, 0.05, "train_batch"), (True, 0.0, "deepspeed")],
    ids=["all", "moments", "clipped", "deepspeed-loop"],
)
def test_disk_tier_on_gpu_is_bitwise_the_in_memory_path(tmp_path, weights, clip, api):
    """The disk tier (engine/disk/tier.py) with real streams and O_DIRECT where the disk allows it: the same losses,
    weights and moments, bitwise, as the same engine with every state in host memory."""
    from tests.integration.test_disk_tier import _assert_bitwise, _state

    torch.manual_seed(0)
    model = tm.llama(layers=4)
    # no assisted updates: the device would update some blocks of the reference that the tier updates on the CPU
    # (never assisted), and the GPU's and the CPU's fused AdamW round differently
    base = {
        "precision": "bf16",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 1e-3},
        "gradient_clipping": clip,
        "offload": {"resident_blocks": 0, "assisted_fraction": 0.0},
    }
    ref = zerofit.initialize(copy.deepcopy(model), base)
    eng = zerofit.initialize(
        model,
        base
        | {
            "offload": {
                "resident_blocks": 0,
                "assisted_fraction": 0.0,
                "optimizer_device": "nvme",
                "nvme_path": str(tmp_path),
                "disk_blocks": 3,
                "disk_weights": weights,
            }
        },
    )
    assert len(eng.plan.disk_blocks) == 3
    data = _gpu_batches(4, 2)
    if api == "deepspeed":
        for mbs in data:
            assert torch.equal(torch.stack(tm.ds_losses(eng, mbs)), torch.stack(tm.ds_losses(ref, mbs)))
    else:
        assert [eng.train_batch(m) for m in data] == [ref.train_batch(m) for m in data]
    _assert_bitwise(_state(eng), _state(ref))
    assert any(t["lane"] == "disk" for t in eng.trace())
    eng.close()
    ref.close()
    assert not list(tmp_path.glob("zerofit-swap-*.bin"))


def test_smaller_floor_on_gpu_keeps_the_math():
    """Chunked loss and checkpoints in pinned host memory with real streams: fp32 losses and weights as the
    plain engine's. (On the CPU the checkpoints alone are bitwise, tests/gpu/test_small_gpu_floor.py; two GPU runs
    are not: the embedding's backward sums with atomics, so the master weights can differ in their last bits where
    the losses are equal bitwise: hence the fp32 tolerance.)"""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = tm.llama(layers=6)
    base = {
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 1e-3},
        "offload": {"resident_blocks": 0},
    }
    ref = zerofit.initialize(copy.deepcopy(model), base)
    eng = zerofit.initialize(
        copy.deepcopy(model), base | {"offload": {"resident_blocks": 0, "loss_chunks": 4, "offload_checkpoints": True}}
    )
    ck = zerofit.initialize(
        model, base | {"offload": {"resident_blocks": 0, "loss_chunks": 1, "offload_checkpoints": True}}
    )
    assert eng.plan.loss_chunks == 4 and eng.plan.offload_checkpoints and eng.planning.chunk_loss_ok
    data = _gpu_batches(4, 2)
    a = [ref.train_batch(m) for m in data]
    b = [eng.train_batch(m) for m in data]
    c = [ck.train_batch(m) for m in data]
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.tensor(c), torch.tensor(a), rtol=1e-6, atol=1e-6)
    ma, mb, mc = ref.master_state_dict(), eng.master_state_dict(), ck.master_state_dict()
    for n in ma:  # RELIABILITY.md's fp32 tolerances (rtol 1.3e-6, atol 1e-5): Adam scales a gradient's last-bit
        # differences by 1/sqrt(v); at atol 1e-6 one weight of 512 differed by 1.6e-6 on a GPU
        torch.testing.assert_close(mb[n], ma[n], rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(mc[n], ma[n], rtol=1.3e-6, atol=1e-5)
    assert any((t["label"] or "").startswith("ckpt[") for t in eng.trace())
    for e in (ref, eng, ck):
        e.close()


def test_checkpoints_every_k_blocks_on_gpu_keep_the_math():
    """[Note: checkpoints every k blocks] with real streams: every third block's checkpoints, offloaded to pinned
    host memory, the others recomputed in the backward (their weights uploaded again): fp32 losses and weights as
    the engine with every block's, at the fp32 tolerances of the test above. On the CPU the same comparison is
    bitwise (tests/gpu/test_small_gpu_floor.py)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = tm.llama(layers=8)
    base = {
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 1e-3},
        "offload": {"resident_blocks": 0, "loss_chunks": 1, "offload_checkpoints": True},
    }
    sparse = base | {"offload": base["offload"] | {"checkpoint_every": 3}}
    ref = zerofit.initialize(copy.deepcopy(model), base)
    eng = zerofit.initialize(copy.deepcopy(model), sparse)
    ds = zerofit.initialize(model, sparse)  # the DeepSpeed-shaped loop, its forwards one at a time
    assert eng.plan.checkpoint_every == 3 and eng.plan.offload_checkpoints
    data = _gpu_batches(4, 2)
    a = [ref.train_batch(m) for m in data]
    b = [eng.train_batch(m) for m in data]
    c = [tm.ds_step(ds, m) for m in data]
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.tensor(c), torch.tensor(a), rtol=1e-6, atol=1e-6)
    ma, mb, mc = ref.master_state_dict(), eng.master_state_dict(), ds.master_state_dict()
    for n in ma:
        torch.testing.assert_close(mb[n], ma[n], rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(mc[n], ma[n], rtol=1.3e-6, atol=1e-5)
    for e in (eng, ds):
        labels = {t["label"] or "" for t in e.trace()}
        assert {f"{e.blocks[i].name}(inputs)" for i in (0, 1, 3, 4, 6)} <= labels and "ckpt[3]" in labels
    for e in (ref, eng, ds):
        e.close()


def test_estimate_times_the_engines_post_pass_and_the_contended_speeds():
    """``zerofit estimate`` on a GPU: the post pass is timed through the engine's own code (in the plan's
    loss chunks), its remainder of the shell is the pre pass, and the speeds it predicts from include both
    ways of copies at once and the CPU's AdamW while they run."""
    from zerofit.config import load_config
    from zerofit.estimate import block_seconds, estimate, meta_model

    cfg = {"micro_batch_size": 1, "gradient_accumulation_steps": 2, "max_gpu_memory": "8GiB", "seq_len": 256}
    est = estimate(meta_model(shape="W1"), cfg)
    s = est.step
    assert s.step and s.speeds["post_seconds"] > 0 and s.speeds["pre_seconds"] >= 0
    assert 0 < s.speeds["both_ways_gb_per_s_each"] and s.speeds["cpu_adamw_params_per_s"] > 0
    assert s.phases["post"][0] == pytest.approx(2 * s.speeds["post_seconds"])
    run = load_config(cfg).config
    one, four = (block_seconds(meta_model(shape="W1"), est.batch, run, chunks=c, seconds=0.5) for c in (1, 4))
    # (the shell is a difference of two timings, 0 when noise covers it in a model this small)
    assert one.post > 0 and four.post > 0 and one.per_block > 0 and four.shell >= 0


def test_qlora_streamed_blocks_dequantize_on_the_gpu_as_resident_ones_do():
    """[Note: an NF4 base]: the blocks' linears quantized on the GPU (bitsandbytes' kernel), held packed in host
    memory; a streamed block's packed bytes go up through the NF4 stage and are dequantized into its slot at
    each upload, a resident block's once: the same weights either way, so the same losses bitwise."""
    pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    base = tm.llama(layers=3, tied=False)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    )
    twin = copy.deepcopy(model)
    cfg = {
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 1e-2},
        "quantize_base": "nf4",
    }
    streamed = zerofit.initialize(model, {**cfg, "offload": {"resident_blocks": 0}})
    resident = zerofit.initialize(twin, {**cfg, "offload": {"resident_blocks": 3}})
    assert streamed.streamer.nf4_stage is not None and all(u.nf4 is not None for u in streamed.blocks)
    for a, b in zip(streamed.blocks, resident.blocks):  # the same codes, quantized on the GPU
        assert torch.equal(a.nf4.host, b.nf4.host)
    data = _gpu_batches(3, 2)
    assert [streamed.train_batch(m) for m in data] == [resident.train_batch(m) for m in data]
    assert any(lab.endswith("(nf4)") for lab in tm.upload_labels(streamed))
    streamed.close()
    resident.close()


def test_fresh_pinned_memory_is_page_locked_at_its_size_and_zero():
    """[Note: page-locking fresh memory]: the arena is zeros, registered with the driver (an asynchronous copy from
    it is a DMA), and an NF4 unit's buffer is exactly its bytes (no power-of-two rounding)."""
    from zerofit.engine.device import fresh_pinned
    from zerofit.engine.memory.store import HostArena
    from zerofit.engine.model.nf4 import UnitNF4

    t = fresh_pinned((5 << 20) + 3, torch.float32)
    assert t.is_pinned() and t.numel() == (5 << 20) + 3 and not t.any()
    t.fill_(2.0)
    d = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), t)
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    arena = HostArena(1000, torch.bfloat16, pinned=True)
    assert arena.tensor.is_pinned() and arena.tensor.numel() == 1000
    arena.close()
    u = UnitNF4(["w"], [(64, 128)], [0], [True], [64], pinned=True)
    assert u.host.is_pinned() and u.host.numel() == u.nbytes
