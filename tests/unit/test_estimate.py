"""``zerofit estimate``: the engine's own plan and accounting, without allocating the model; the same refusal
text as ``zerofit.initialize``, with what would fit."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import zerofit
from tests.support import tiny_models as tm
from zerofit.cli import app
from zerofit.engine.plan.search import ModelShape, PlanError
from zerofit.estimate import estimate, meta_model


def _cfg(**kw):
    base = {
        "device": "cpu",
        "precision": "bf16",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "seq_len": 16,
        "optimizer": {"lr": 1e-3},
    }
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "offload,host",
    [({}, None), ({"optimizer_device": "nvme", "disk_blocks": 2}, None), ({"optimizer_device": "nvme"}, "800KiB")],
    ids=["host", "disk-forced", "disk-by-budget"],
)
def test_estimate_is_the_plan_initialize_makes(tmp_path, offload, host):
    if offload:
        offload = offload | {"nvme_path": str(tmp_path)}
    model = tm.llama(layers=4)
    cfg = _cfg(offload=offload) if offload else _cfg()
    if host:
        cfg["max_host_memory"] = host
    with torch.device("meta"):
        meta = tm.llama(layers=4)
    est = estimate(meta, cfg)
    assert all(p.is_meta for p in meta.parameters()), "nothing of the model is allocated"
    engine = zerofit.initialize(model, cfg)
    assert est.plan.device_bytes == engine.plan.device_bytes
    assert est.plan.host_bytes == engine.plan.host_bytes
    assert est.plan.disk_blocks == engine.plan.disk_blocks and est.disk_bytes == engine.plan.disk_bytes
    assert est.host_bytes == engine.plan.host_total + est.host_baseline_bytes
    if host:
        assert len(est.plan.disk_blocks) == 3 and est.plan.host_total <= 800 * 1024
    if offload:
        assert est.disk_bytes == engine.tier.file.nbytes  # the file reserved is the size predicted
        assert est.disk_traffic[0] > 0
    assert est.step.step is None and "GPU" in est.step.note  # the step time is measured on a GPU only
    engine.close()


def test_refusal_is_initializes_and_says_what_would_fit():
    model = tm.llama(layers=4)
    cfg = _cfg(max_host_memory="800KiB")
    with torch.device("meta"):
        meta = tm.llama(layers=4)
    est = estimate(meta, cfg)
    with pytest.raises(PlanError) as info:
        zerofit.initialize(model, cfg)
    assert est.plan is None and est.refusal == str(info.value)
    assert "what would fit" in est.refusal and "max_host_memory) of at least" in est.refusal
    assert "an NVMe tier with at least" in est.refusal


def test_a_refusals_host_need_is_the_host_budget_it_suggests():
    """The 3B shape's LoRA at a 24 GiB cap and a 4 GiB host: the refusal's "host needs N" is the least host memory
    of a placement the device holds, and the host budget it suggests is that figure rounded up (planned with it,
    it fits), not another placement's (the smallest device one needed 8.64 GiB beside a suggested 6.08)."""
    import re

    from zerofit.config import parse_bytes

    args = ["estimate", "--shape", "3b", "--lora", "--max-gpu-memory", "24GiB", "--max-host-memory", "4GiB"]
    r = CliRunner().invoke(app, [*args, "--micro-batch-size", "2", "--grad-accum", "4", "--seq-len", "2048"])
    need = re.search(r"host needs [\d.]+ \w+ > budget [\d.]+ \w+ \((\d+) > \d+ bytes\)", r.output)
    tip = re.search(r"max_host_memory\) of at least ([\d.]+) (\w+)", r.output)
    assert need and tip, r.output
    assert int(need.group(1)) <= parse_bytes(tip.group(1) + tip.group(2)) <= int(need.group(1)) * 1.01 + 1


def test_cli_estimate_of_the_13b_shape(tmp_path):
    runner = CliRunner()
    refused = runner.invoke(
        app,
        [
            "estimate",
            "--shape",
            "llama-2-13b",
            "--max-gpu-memory",
            "24GiB",
            "--max-host-memory",
            "100GiB",
            "--no-measure",
        ],
    )
    assert refused.exit_code == 2, refused.output
    assert "host needs" in refused.output and "an NVMe tier with at least" in refused.output
    ok = runner.invoke(
        app,
        [
            "estimate",
            "--shape",
            "llama-2-13b",
            "--max-gpu-memory",
            "24GiB",
            "--max-host-memory",
            "100GiB",
            "--nvme",
            str(tmp_path),
            "--no-measure",
            "--json",
        ],
    )
    assert ok.exit_code == 0, ok.output
    d = json.loads(ok.output)
    assert d["refusal"] is None and d["disk_bytes"] > 0 and d["gpu_bytes"] <= 24 * 2**30
    assert d["gpu_bytes"] < sum(d["device_bytes"].values())
    assert d["host_bytes"] - d["host_baseline_bytes"] <= 100 * 2**30
    assert 12.9e9 < d["parameters"] < 13.1e9
    text = runner.invoke(
        app,
        [
            "estimate",
            "--shape",
            "W1",
            "--max-gpu-memory",
            "24GiB",
            "--max-host-memory",
            "100GiB",
            "--no-measure",
            "--micro-batch-size",
            "2",
            "--grad-accum",
            "4",
        ],
    )
    assert "3.21 B parameters" in text.output and "GPU peak" in text.output, text.output
    assert "batch 2 x 2048 tokens, 4 micro-batches" in text.output


def test_meta_model_needs_one_source():
    with pytest.raises(ValueError):
        meta_model()
    with pytest.raises(ValueError, match="unknown shape"):
        meta_model(shape="gpt-5")


def test_cli_estimate_for_two_gpus():
    """`--gpus 2`: each GPU's bytes (the resident units' optimizer state counted as a shard, so more blocks stay
    resident) and the host's (the shared state once, each rank's host mirrors twice)."""
    runner = CliRunner()
    args = [
        "estimate",
        "--shape",
        "llama-2-13b",
        "--max-gpu-memory",
        "24GiB",
        "--max-host-memory",
        "240GiB",
        "--no-measure",
        "--json",
    ]
    one, two = (json.loads(runner.invoke(app, args + extra).output) for extra in ([], ["--gpus", "2"]))
    assert one["ranks"] == 1 and two["ranks"] == 2
    r1 = int(one["plan"].split(" resident")[0].split()[-1])
    r2 = int(two["plan"].split(" resident")[0].split()[-1])
    assert r2 > r1
    per_param = {d["ranks"]: d["host_plan_bytes"]["host_mirrors"] / d["device_bytes"]["shell"] for d in (one, two)}
    assert two["host_plan_bytes"]["host_mirrors"] > one["host_plan_bytes"]["host_mirrors"]
    assert two["gpu_bytes"] <= 24 * 2**30 and per_param[2] > per_param[1]
    assert "2 ranks" in runner.invoke(app, args[:-1] + ["--gpus", "2"]).output


def test_the_step_is_the_sum_of_its_phases_each_as_long_as_its_busiest_resource():
    """[Note: the step's phases]: the forward takes a quarter of the blocks' compute, the backward the rest; each
    is as long as the busiest of its compute, copies and CPU work; the post pass and a host-optimized shell's
    update add. The W1-at-8-GiB shape of numbers: a CPU-bound backward shows as such."""
    from zerofit.estimate import FORWARD_SHARE, phase_seconds

    p = phase_seconds(
        blocks=1.0, post=0.1, up_fwd=0.2, up_bwd=0.4, down_fwd=0.0, down_bwd=0.3, cpu_fwd=0.0, cpu_bwd=0.5, tail=0.09
    )
    assert p["forward"] == (pytest.approx(FORWARD_SHARE), "compute")
    assert p["backward"] == (pytest.approx(1 - FORWARD_SHARE), "compute")
    assert p["post"] == (0.1, "compute") and p["shell update"][0] == 0.09
    slow_cpu = phase_seconds(
        blocks=1.0, post=0.1, up_fwd=0.2, up_bwd=0.4, down_fwd=0.0, down_bwd=0.3, cpu_fwd=0.0, cpu_bwd=0.9, tail=0.0
    )
    assert slow_cpu["backward"] == (0.9, "cpu optimizer")
    deferred = phase_seconds(
        blocks=1.0, post=0.1, up_fwd=0.6, up_bwd=0.2, down_fwd=0.1, down_bwd=0.2, cpu_fwd=0.55, cpu_bwd=0.0, tail=0.0
    )
    assert deferred["forward"] == (0.6, "upload")
    assert sum(t for t, _ in deferred.values()) == pytest.approx(0.6 + 0.1 + 0.75)


def test_predict_step_adds_up_a_plans_phases_from_the_measured_speeds(monkeypatch):
    """predict_step, which only a GPU machine reaches, run here with the speeds stubbed (55 GB/s each way, 2.5 G
    params/s of CPU AdamW, 8 ms per block and 20 ms of shell per micro-batch): for a plan with assisted updates
    in the backward and the shell's optimizer on the host (the W1-at-8-GiB kind), each phase from its bytes, the
    shell's update on the device, and the step their sum."""
    import zerofit.cli.doctor as doctor
    import zerofit.estimate.predict as E
    from zerofit.engine.plan.search import BatchShape, ModelShape, make_plan

    n, L, s = 10_000_000, 8, 30_000_000
    shape = ModelShape(shell_numel=s, block_numels=(n,) * L, hidden=512, intermediate=1376, vocab=32000)
    batch = BatchShape(1, 256, 4)
    plan = make_plan(
        shape,
        batch,
        compute_dtype=torch.bfloat16,
        on_cuda=True,
        device_budget=None,
        host_budget=None,
        deferred_updates=False,
        checkpointing=True,
        stream_params=True,
        resident_blocks=0,
        prefetch_depth=None,
        shell_on_device=False,
    )
    assert plan.assisted_updates and not plan.shell_optimizer_on_device
    a = len(plan.assisted_blocks) * n
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(E, "block_seconds", lambda *args, **kw: E.ComputeProbe(0.008, 0.020, 0.017, 0.003))
    monkeypatch.setattr(E, "engine_block_seconds", lambda *args, **kw: None)
    monkeypatch.setattr(
        doctor,
        "copy_bandwidth",
        lambda *args: (
            [doctor.CopyBandwidth(d, "pinned", 1, 1, 55.0) for d in ("host->gpu", "gpu->host")]
            + [doctor.CopyBandwidth("both", "pinned", 1, 1, 45.0)]
        ),
    )
    speeds = []
    monkeypatch.setattr(
        doctor,
        "optimizer_speed",
        lambda *args, **kw: (
            speeds.append(kw) or doctor.OptimizerSpeed("fused", 1, 1, 1, 2.5e9, kw.get("while_copying", False))
        ),
    )
    from zerofit.config import load_config

    cfg = load_config(_cfg()).config
    pred = E.predict_step(None, cfg, plan, shape, batch, on_cuda=True)
    blocks = 4 * L * 0.008
    ph = {k: t for k, (t, _) in pred.phases.items()}
    assert speeds == [{"while_copying": True}]  # the CPU's rate with the copies running, as in a step
    assert ph["forward"] == pytest.approx(max(blocks / 4 + 4 * 0.003, L * n * 4 / 55e9))
    assert ph["post"] == pytest.approx(4 * 0.017)  # the engine's post pass, not the plain model's whole shell
    host = L * n - a
    up, down = L * n * 4 + a * 12, host * 4 + a * 12  # while both ways carry bytes, each goes at 45 GB/s
    both = min(up, down)
    assert ph["backward"] == pytest.approx(
        max(blocks * 3 / 4, both / 45e9 + (up - both) / 55e9, both / 45e9 + (down - both) / 55e9, host / 2.5e9)
    )
    assert ph["shell update"] == pytest.approx(s * 12 / 45e9)  # on the device: its state up and down at once
    assert pred.step == pytest.approx(sum(ph.values())) and pred.disk is None
    assert pred.cpu_optimizer == pytest.approx(host / 2.5e9)
    assert pred.upload == pytest.approx(L * n * 4 / 55e9 + both / 45e9 + (up - both) / 55e9 + s * 12 / 55e9)
    assert "phases" in pred.binds and json.dumps(E.asdict(pred))


def test_the_engines_own_block_compute_is_read_off_its_trace():
    """engine_block_seconds runs the engine on a 2-block model of the shape (here on the CPU, a tiny one) and
    reads each block's forward, its recompute + backward and its update off its steps' traces."""
    from transformers import LlamaForCausalLM

    from tests.support import tiny_models as tm
    from zerofit.config import load_config
    from zerofit.engine.plan.search import BatchShape
    from zerofit.estimate import engine_block_seconds

    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(tm.llama(layers=6).config, dtype=torch.float32)
    cfg = load_config({"precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": 2}).config
    probe = engine_block_seconds(model, BatchShape(2, 32, 2), cfg, device="cpu")
    # a block's parts of a few ms each: their shares move with whatever else runs on the machine (0.04 to 0.79 were
    # seen beside another test process), so only that each part was read is checked here
    assert probe.per_block > 0 and 0 < probe.forward_share < 1
    assert 0 < probe.pre < probe.per_block  # the embeddings' lookup and its backward: less than a block
    block = sum(p.numel() for p in tm.llama(layers=6).model.layers[0].parameters())
    assert 0 < probe.update * block < probe.per_block  # a block's AdamW: less than its compute of a micro-batch


def test_the_probes_of_a_qlora_plan_run_its_adapters_over_an_nf4_base():
    """``zerofit estimate --qlora``'s model is PEFT's: the probes build their small models of its base's class with
    the same adapters (PEFT's class has no constructor from a config), and the engine's probe quantizes the base
    as the run would."""
    from transformers import LlamaForCausalLM

    from tests.support import tiny_models as tm
    from zerofit.config import load_config
    from zerofit.engine.plan.search import BatchShape
    from zerofit.estimate import engine_block_seconds, with_lora
    from zerofit.estimate.probes import small_twin

    with torch.device("meta"):
        model = with_lora(LlamaForCausalLM._from_config(tm.llama(layers=6).config, dtype=torch.float32), r=4)
    twin = small_twin(model, 2, torch.float32)
    assert type(twin) is type(model) and len(twin.get_base_model().model.layers) == 2
    assert twin.peft_config["default"].r == 4
    assert (
        sum(p.numel() for p in twin.parameters() if p.requires_grad)
        == sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and ".layers.0." in n) * 2
    )
    cfg = load_config(
        {"precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": 2, "quantize_base": "nf4"}
    ).config
    probe = engine_block_seconds(model, BatchShape(2, 32, 2), cfg, device="cpu")
    assert probe is not None and probe.per_block > 0 and 0.05 < probe.forward_share < 0.6


EIGHT_BLOCKS = ModelShape(
    shell_numel=1_000_000, block_numels=(10_000_000,) * 8, hidden=512, intermediate=1376, vocab=32000
)


def _stub_measurements(monkeypatch) -> None:
    """predict_step's measurements, which only a GPU machine makes, stubbed: 8 ms per block and micro-batch, 20 ms
    of shell (17 of them the post pass, 3 the pre pass), 55 GB/s each way and both ways at once, 2.5 G params/s of
    CPU AdamW."""
    from zerofit.cli import doctor
    from zerofit.estimate import predict as E

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(E, "block_seconds", lambda *args, **kw: E.ComputeProbe(0.008, 0.020, 0.017, 0.003))
    monkeypatch.setattr(E, "engine_block_seconds", lambda *args, **kw: None)
    monkeypatch.setattr(
        doctor,
        "copy_bandwidth",
        lambda *args: [doctor.CopyBandwidth(d, "pinned", 1, 1, 55.0) for d in ("host->gpu", "gpu->host", "both")],
    )
    monkeypatch.setattr(
        doctor, "optimizer_speed", lambda *args, **kw: doctor.OptimizerSpeed("fused", 1, 1, 1, 2.5e9, True)
    )


def _disk_plan(shape, batch, disk_blocks: int):
    """A GPU plan with no block resident and ``disk_blocks`` of them on the disk tier, immediate updates."""
    from zerofit.engine.plan.search import make_plan

    return make_plan(
        shape,
        batch,
        compute_dtype=torch.bfloat16,
        on_cuda=True,
        device_budget=None,
        host_budget=10**12,
        deferred_updates=False,
        checkpointing=True,
        stream_params=True,
        resident_blocks=0,
        prefetch_depth=None,
        disk=True,
        disk_budget=10**12,
        disk_blocks=disk_blocks,
        assisted_fraction=0.0,
    )


@pytest.mark.parametrize("on_disk", ["last blocks", "every block"])
def test_a_disk_bound_step_counts_the_forward_when_the_disk_idles_through_it(monkeypatch, on_disk):
    """[Note: when the disk works]: with immediate updates and the disk the binding resource, the disk's work
    starts with the backward. Where the backward's last host update is in host memory (the last blocks on the
    disk) the step is the forward and post pass plus the disk's time; where it is on the disk (every block) the
    updates run on into the next forward and the step is the disk's time alone."""
    from zerofit.config import load_config
    from zerofit.engine.disk import tier as D
    from zerofit.engine.plan.search import BatchShape
    from zerofit.estimate import predict as E

    L, shape, batch = 8, EIGHT_BLOCKS, BatchShape(1, 256, 4)
    k = 3 if on_disk == "last blocks" else L
    plan = _disk_plan(shape, batch, k)
    assert len(plan.disk_blocks) == k and not plan.assisted_blocks
    _stub_measurements(monkeypatch)
    monkeypatch.setattr(D, "measure_folder", lambda *args, **kw: (0.01, 0.01))  # 10 MB/s: the disk binds
    cfg = load_config(_cfg(device="cuda", offload={"optimizer_device": "nvme", "nvme_path": "/nonexistent"})).config
    pred = E.predict_step(None, cfg, plan, shape, batch, on_cuda=True)
    read, written = plan.disk_traffic(shape)
    assert pred.disk == pytest.approx(read / 1e7 + written / 1e7)
    ph = {name: t for name, (t, _) in pred.phases.items()}
    assert pred.binds == "disk" and pred.disk > sum(ph.values())
    idle = ph["forward"] + ph["post"] if on_disk == "last blocks" else 0.0
    assert pred.step == pytest.approx(pred.disk + idle)


def test_a_disk_bound_step_takes_the_median_disk_test_and_shows_the_range(monkeypatch):
    """[Note: the disk's speed moves]: the disk is tested DISK_TESTS times; the prediction is the median test's,
    and the estimate shows the disk-bound step at the fastest and the slowest test."""
    from zerofit.config import load_config
    from zerofit.engine.disk import tier as D
    from zerofit.engine.plan.search import BatchShape
    from zerofit.estimate import predict as E

    shape, batch = EIGHT_BLOCKS, BatchShape(1, 256, 4)
    plan = _disk_plan(shape, batch, 8)
    _stub_measurements(monkeypatch)
    tested = [(0.2, 0.15), (0.1, 0.075), (0.4, 0.3)]  # (write, read) GB/s: middle, slowest, fastest
    speeds = iter(tested)
    monkeypatch.setattr(D, "measure_folder", lambda *args, **kw: next(speeds))
    cfg = load_config(_cfg(device="cuda", offload={"optimizer_device": "nvme", "nvme_path": "/nonexistent"})).config
    pred = E.predict_step(None, cfg, plan, shape, batch, on_cuda=True)
    assert E.DISK_TESTS == 3
    read, written = plan.disk_traffic(shape)
    at = {w: read / (r * 1e9) + written / (w * 1e9) for w, r in tested}
    assert pred.disk == pytest.approx(at[0.2])
    assert pred.disk_range == pytest.approx((at[0.4], at[0.1]))
    assert pred.binds == "disk" and pred.step == pytest.approx(pred.disk)  # every block on the disk: no idle
    assert pred.step_range == pytest.approx((at[0.4], at[0.1]))
    est = E.Estimate(plan, shape, batch, 1, step=pred)
    text = est.render()
    assert "disk tests   3: read 0.30, 0.15, 0.07 GB/s, write 0.40, 0.20, 0.10 GB/s" in text, text
    assert f"the step {at[0.4]:.2f}-{at[0.1]:.2f} s at the fastest and slowest" in text, text


def test_the_estimate_counts_the_backwards_forwards_with_checkpoints_every_k_blocks(monkeypatch):
    """[Note: checkpoints every k blocks]: the backward reruns the forward of every block but each segment's last,
    and uploads those blocks again: the predicted compute and the backward's upload grow by exactly that."""
    from zerofit.config import load_config
    from zerofit.engine.plan.search import BatchShape, make_plan
    from zerofit.estimate import predict as E

    n, shape, batch = 10_000_000, EIGHT_BLOCKS, BatchShape(1, 256, 4)
    _stub_measurements(monkeypatch)
    cfg = load_config(_cfg(device="cuda")).config
    kw = dict(
        compute_dtype=torch.bfloat16,
        on_cuda=True,
        device_budget=None,
        host_budget=None,
        deferred_updates=False,
        checkpointing=True,
        stream_params=True,
        resident_blocks=0,
        prefetch_depth=None,
        assisted_fraction=0.0,
    )
    every = make_plan(shape, batch, **kw, floor=(False, True, False, 1))
    sparse = make_plan(shape, batch, **kw, floor=(False, True, False, 4))
    assert (every.checkpoint_every, sparse.checkpoint_every) == (1, 4)
    a, b = (E.predict_step(None, cfg, p, shape, batch, on_cuda=True) for p in (every, sparse))
    again = 6  # blocks 0-2 and 4-6: every block but 3 and 7
    assert b.compute - a.compute == pytest.approx(4 * again * 0.008 * E.FORWARD_SHARE)
    assert b.upload - a.upload == pytest.approx(again * n * 4 / 55e9)
    assert sparse.host_bytes["checkpoint_copies"] < every.host_bytes["checkpoint_copies"]


def test_the_devices_own_updates_count_in_the_step(monkeypatch):
    """The engine's probe times the device's AdamW per parameter (its resident blocks' "optimizer[...]" intervals);
    predict_step counts it for the resident blocks and the shell after the backward (a phase of its own) and for
    the assisted blocks beside the backward's compute."""
    import zerofit.estimate.predict as E
    from zerofit.config import load_config
    from zerofit.engine.plan.search import BatchShape, make_plan

    n, L, s = 10_000_000, 8, 30_000_000
    shape = ModelShape(shell_numel=s, block_numels=(n,) * L, hidden=512, intermediate=1376, vocab=32000)
    batch = BatchShape(1, 256, 4)
    plan = make_plan(
        shape,
        batch,
        compute_dtype=torch.bfloat16,
        on_cuda=True,
        device_budget=None,
        host_budget=None,
        deferred_updates=False,
        checkpointing=True,
        stream_params=True,
        resident_blocks=2,
        prefetch_depth=None,
    )
    assert plan.shell_optimizer_on_device and plan.assisted_blocks
    a = len(plan.assisted_blocks) * n
    _stub_measurements(monkeypatch)
    cfg = load_config(_cfg()).config
    base = E.predict_step(None, cfg, plan, shape, batch, on_cuda=True)
    update = 1e-9  # seconds per parameter: large enough that the backward stays bound by its compute
    monkeypatch.setattr(E, "engine_block_seconds", lambda *args, **kw: E.EngineProbe(0.008, 0.25, 0.003, update))
    pred = E.predict_step(None, cfg, plan, shape, batch, on_cuda=True)
    assert pred.phases["device updates"] == (pytest.approx((2 * n + s) * update), "compute")
    assert pred.phases["backward"] == (pytest.approx(base.phases["backward"][0] + a * update), "compute")
    assert pred.compute == pytest.approx(base.compute + (2 * n + s + a) * update)
    assert pred.step == pytest.approx(base.step + (2 * n + s + a) * update)
    assert pred.speeds["device_adamw_seconds_per_param"] == update


@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_the_bytes_that_cross_the_nodes(nodes):
    """[Note: what crosses the nodes] (estimate/nodes.py): each node plans as one host. Hybrid (chosen where the state
    fits): every trained gradient element all-reduced across the nodes (a ring's 2 (n-1)/n x 4 bytes per element and
    node); full, beside it: each streamed block's bf16 weights gathered at its two uses, (n-1)/n x 2 B each, the
    host-optimized gradients reduce-scattered, (n-1)/n x 4 B, the shell's weights gathered after its update (here the
    shell is replicated: its gradient all-reduced); each node's master and moments 1/n. With a bandwidth, their seconds;
    the estimate says so."""
    with torch.device("meta"):
        meta = tm.llama(layers=4)
    one = estimate(meta, _cfg(), measure=False)
    est = estimate(meta, _cfg(), measure=False, nnodes=nodes, inter_node_gb_per_s=10.0)
    assert est.plan.host_bytes == one.plan.host_bytes and est.plan.device_bytes == one.plan.device_bytes
    trained = sum(p.numel() for p in meta.parameters())
    f = (nodes - 1) / nodes
    assert est.inter_node_bytes == int(2 * f * 4 * trained)
    text = est.render()
    assert est.to_dict()["inter_node_bytes"] == est.inter_node_bytes
    if nodes == 1:
        assert est.inter_node_seconds is None and "nodes " not in text and not est.layouts
        return
    assert est.layout == "hybrid" and set(est.layouts) == {"hybrid", "full"}
    assert est.inter_node_seconds == pytest.approx(est.inter_node_bytes / 1e10)
    full = est.layouts["full"]
    blocks = sum(p.numel() for p in meta.model.layers.parameters())
    shell = trained - blocks
    assert full.plan.shell_optimizer_on_device  # the CPU's plan: the shell replicated, its gradient all-reduced
    assert full.traffic.gather_fwd == full.traffic.gather_bwd == int(f * blocks * 2)
    assert full.traffic.grads == int(f * 4 * blocks + 2 * f * 4 * shell)
    whole = est.layouts["hybrid"].plan.host_bytes["master_and_moments"]
    assert whole == blocks * 12  # the streamed blocks' (the shell's on the device)
    assert full.plan.host_bytes["master_and_moments"] == pytest.approx(whole / nodes, abs=1)
    assert f"nodes        {nodes} x 1 rank: the hybrid layout (nodes_layout auto)" in text
    assert f"each node holds 1/{nodes} of the host state" in text and "at 10 GB/s" in text
    assert "which is faster: the steps are predicted on the training machine's GPU" in text
    assert est.to_dict()["layouts"]["full"]["inter_node"]["grads"] == full.traffic.grads


def test_the_planner_takes_the_full_layout_when_the_whole_state_does_not_fit_a_node():
    """[Note: the nodes' layout]: auto is hybrid where the whole state fits the host budget; where only a node's
    1/n share fits, the full layout; nodes_layout names either; where neither fits, the hybrid's refusal."""
    with torch.device("meta"):
        meta = tm.llama(layers=4)
    need = estimate(meta, _cfg(), measure=False).plan.host_total
    share = estimate(meta, _cfg(nodes_layout="full"), measure=False, nnodes=2).plan.host_total
    assert share < need
    budget = (share + need) // 2
    est = estimate(meta, _cfg(max_host_memory=budget), measure=False, nnodes=2)
    assert est.layout == "full" and est.refusal is None
    assert est.layouts["hybrid"].refusal is not None and "host needs" in est.layouts["hybrid"].refusal
    assert "hybrid  does not fit" in est.render()
    assert estimate(meta, _cfg(nodes_layout="full"), measure=False, nnodes=2).layout == "full"
    assert (
        estimate(meta, _cfg(max_host_memory=budget, nodes_layout="hybrid"), measure=False, nnodes=2).refusal is not None
    )
    assert estimate(meta, _cfg(max_host_memory=share // 2), measure=False, nnodes=2).refusal is not None
    one = estimate(meta, _cfg(max_host_memory=budget), measure=False)  # one node: nothing to share it with
    assert one.refusal is not None


def test_the_step_of_each_layout_and_which_is_faster(monkeypatch):
    """With the measurements stubbed (55 GB/s each way, 2.5 G params/s of CPU AdamW): the full layout's CPU
    optimizer and uploads are 1/n of the hybrid's per node; the bytes across the nodes go into the phases where
    they run: the hybrid's all-reduce and the full layout's reduce-scatter into the backward's compute, the full
    layout's gathers after the uploads of the forward and the backward. In bf16 the full layout's gathers (2 B per
    parameter per use) hide under the compute stream's reduce-scatter, half the hybrid's all-reduce, so by this
    model the full layout is the faster at 1000 GB/s and at 1 GB/s alike, and the estimate says so."""
    from zerofit.config import load_config
    from zerofit.engine.plan.search import BatchShape, make_plan
    from zerofit.estimate import nodes as N
    from zerofit.estimate import predict as E

    shape, batch = EIGHT_BLOCKS, BatchShape(1, 256, 4)
    kw = dict(
        compute_dtype=torch.bfloat16,
        on_cuda=True,
        device_budget=None,
        host_budget=10**12,
        deferred_updates=False,
        checkpointing=True,
        stream_params=True,
        resident_blocks=0,
        prefetch_depth=None,
        assisted_fraction=0.0,
        assisted_updates=False,
    )
    _stub_measurements(monkeypatch)
    cfg = load_config({"precision": "bf16", "micro_batch_size": 1, "gradient_accumulation_steps": 4}).config
    plans = {"hybrid": make_plan(shape, batch, **kw), "full": make_plan(shape, batch, host_share=0.5, **kw)}
    assert plans["full"].host_bytes["master_and_moments"] * 2 == plans["hybrid"].host_bytes["master_and_moments"]
    one = E.predict_step(None, cfg, plans["hybrid"], shape, batch, on_cuda=True)
    pred = {
        (name, bw): E.predict_step(
            None, cfg, plans[name], shape, batch, on_cuda=True, nodes=2, layout=name, gb_per_s=bw
        )
        for name in plans
        for bw in (1.0, 1000.0)
    }
    hybrid, full = pred["hybrid", 1000.0], pred["full", 1000.0]
    assert hybrid.cpu_optimizer == pytest.approx(one.cpu_optimizer)
    assert full.cpu_optimizer == pytest.approx(one.cpu_optimizer / 2)
    assert full.upload == pytest.approx(one.upload / 2)
    for bw in (1.0, 1000.0):
        t = {k: N.traffic(k, shape, plans[k], 2, 2).seconds(bw) for k in plans}
        h, f = pred["hybrid", bw], pred["full", bw]
        assert h.inter_node == pytest.approx(t["hybrid"].total) and f.inter_node == pytest.approx(t["full"].total)
        assert h.phases["backward"] == (
            pytest.approx(one.phases["backward"][0] + t["hybrid"].grads),
            "compute and inter node",
        )
        assert h.phases["forward"] == one.phases["forward"]
        bwd_compute = one.phases["backward"][0] + t["full"].grads  # the blocks' compute-bound backward, and the RS
        assert f.phases["backward"][0] == pytest.approx(bwd_compute)
        assert f.phases["forward"][0] == pytest.approx(
            max(one.phases["forward"][0], one.upload / 4 + t["full"].gather_fwd), rel=0.05
        )
        assert t["full"].grads == pytest.approx(t["hybrid"].grads / 2, rel=0.02)
        assert f.step < h.step
        layouts = {
            k: N.LayoutEstimate(k, plans[k], 0, N.traffic(k, shape, plans[k], 2, 2), step=pred[k, bw].step)
            for k in plans
        }
        assert N.faster(layouts) == "full"
        assert "  faster: full (" in "\n".join(N.render(2, 1, "hybrid", "auto", layouts, bw))
    layouts["full"].refusal = "does not fit"
    assert N.faster(layouts) is None


def test_a_zero3_config_without_offload_param_is_told_to_offload_the_parameters_first(tmp_path):
    """DeepSpeed's ZeRO-3 with offload_optimizer alone keeps every block on the GPU with its optimizer state: the
    first fix named is offload_param, with the device bytes it plans at; then the others."""
    config = {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(config))
    out = CliRunner().invoke(
        app,
        [
            "estimate",
            "--shape",
            "llama-2-7b",
            "--config",
            str(cfg),
            "--max-gpu-memory",
            "24GiB",
            "--max-host-memory",
            "200GiB",
            "--no-measure",
        ],
    )
    assert out.exit_code == 2, out.output
    tips = out.output.split("what would fit:")[1].strip().splitlines()
    assert tips[0].startswith("- the parameters offloaded too") and "offload_param" in tips[0], tips
    device = float(tips[0].split("streamed from host memory, ")[1].split(" GiB")[0])
    assert device <= 24 and "GPU cap" in tips[1]


@pytest.mark.parametrize(
    "name,billions",
    [("llama-3.1-8b", 8.03), ("qwen3-8b", 8.19), ("qwen3-32b", 32.76), ("qwen2.5-72b", 72.71), ("llama-3-70b", 70.55)],
)
def test_the_named_shapes_are_the_models_own_sizes(name, billions):
    """The models people ask about, by their config.json's sizes: their parameter counts."""
    meta = meta_model(shape=name)
    assert abs(sum(p.numel() for p in meta.parameters()) / 1e9 - billions) < 0.01


def test_a_folder_with_config_json_alone_is_estimated_a_4bit_one_from_its_quantization_config(tmp_path):
    """No weight file: a 16-bit folder plans as the model; a 4-bit one (its config's quantization_config) plans
    its blocks' linears in 4 bits, with the bytes the engine holds for the same folder; without --lora its 4-bit
    weights cannot train, and it says so."""
    cfg = json.loads(json.dumps(tm.llama(layers=4).config.to_dict()))
    sixteen, four = tmp_path / "sixteen", tmp_path / "four"
    for d, extra in (
        (sixteen, {}),
        (
            four,
            {
                "quantization_config": {
                    "quant_method": "bitsandbytes",
                    "load_in_4bit": True,
                    "bnb_4bit_quant_type": "nf4",
                    "bnb_4bit_use_double_quant": True,
                }
            },
        ),
    ):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, **extra}))
    runner = CliRunner()
    out = runner.invoke(app, ["estimate", "--model", str(sixteen), "--cpu", "--no-measure", "--json"])
    assert out.exit_code == 0, out.output
    plain = json.loads(out.output)
    out = runner.invoke(app, ["estimate", "--model", str(four), "--cpu", "--no-measure", "--lora", "--json"])
    assert out.exit_code == 0, out.output
    q = json.loads(out.output)
    qlora = estimate(
        str(sixteen), {"device": "cpu", "quantize_base": "nf4"}, measure=False, gpu=False, lora=True
    ).to_dict()  # the 16-bit folder quantized as it is read: the same 4-bit bytes

    def planned(d):
        return d["host_bytes"] - d["host_baseline_bytes"]

    assert q["parameters"] == qlora["parameters"] > plain["parameters"] and planned(q) == planned(qlora)
    lora16 = json.loads(
        runner.invoke(app, ["estimate", "--model", str(sixteen), "--cpu", "--no-measure", "--lora", "--json"]).output
    )
    assert planned(q) < planned(lora16)
    out = runner.invoke(app, ["estimate", "--model", str(four), "--cpu", "--no-measure"])
    assert out.exit_code == 2 and "a 4-bit weight does not train" in out.output
