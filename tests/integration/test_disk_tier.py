"""The disk (NVMe) tier: the same updates, bitwise, as when the state is in host memory; checkpoints of the
same format; I/O errors that fail the engine cleanly; preflight refusals; swap files that never leak.

The tier (src/zerofit/engine/disk/tier.py) keeps the moments, or the master weights and moments, of the last
blocks in a swap file under ``offload.nvme_path`` and streams them through aligned buffers around each CPU
update. On this machine it runs on the CPU engine path with O_DIRECT where the file system allows it.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import gc
import os

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.disk import swapfile as swapfile_mod
from zerofit.engine.disk import tier as disk_mod
from zerofit.engine.lifecycle import EngineFailedError
from zerofit.engine.plan.search import BatchShape, ModelShape, PlanError, make_plan

G = 2


def _cfg(nvme=None, precision="bf16", clip=0.0, **offload):
    base = {
        "device": "cpu",
        "precision": precision,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": G,
        "gradient_clipping": clip,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    }
    if nvme is not None:
        base["offload"] = {"optimizer_device": "nvme", "nvme_path": str(nvme), **offload}
    return base


def _state(engine) -> dict[str, torch.Tensor]:
    """Master weights, moments and step counts by name (host copies)."""
    from zerofit.checkpoint.state import optimizer_entries, weight_entries

    engine.wait()
    out = {e.name: e.base[e.offset : e.offset + e.numel].clone() for e in weight_entries(engine)}
    out.update({e.name: e.base[e.offset : e.offset + e.numel].clone() for e in optimizer_entries(engine)})
    out.update({f"{u.name}.step": u.step.clone() for u in engine.units})
    return out


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, f"differ: {bad[:5]}"


def _pair(tmp_path, *, layers=4, precision="bf16", clip=0.0, **offload):
    torch.manual_seed(0)
    model = tm.llama(layers=layers)
    ref = zerofit.initialize(copy.deepcopy(model), _cfg(precision=precision, clip=clip))
    eng = zerofit.initialize(model, _cfg(tmp_path / "nvme", precision=precision, clip=clip, **offload))
    return ref, eng


@pytest.mark.parametrize(
    "precision,clip,weights",
    [
        ("bf16", 0.0, True),
        ("bf16", 0.0, False),
        ("fp32", 0.0, False),
        ("bf16", 0.05, True),  # always clipped: speculation rolls back and redoes, then deferred updates
        ("bf16", 1e3, True),  # never clipped: speculative updates held
        ("fp16", 0.0, True),  # deferred updates, loss scaling
        ("bf16", 0.05, False),
        ("fp16", 1.0, False),
    ],
    ids=[
        "bf16-all",
        "bf16-moments",
        "fp32-moments",
        "clipped",
        "unclipped-speculation",
        "fp16",
        "clipped-moments",
        "fp16-clipped-moments",
    ],
)
def test_disk_tier_is_bitwise_the_in_memory_path(tmp_path, precision, clip, weights):
    ref, eng = _pair(tmp_path, precision=precision, clip=clip, disk_blocks=2, disk_weights=weights)
    assert eng.plan.disk_of == {2: "all" if weights else "moments", 3: "all" if weights else "moments"}
    assert [u.swap for u in eng.blocks] == [None, None] + ["all" if weights else "moments"] * 2
    data = tm.batches(5, G)
    l_ref = [ref.train_batch(m) for m in data]
    l_eng = [eng.train_batch(m) for m in data]
    assert l_eng == l_ref
    _assert_bitwise(_state(eng), _state(ref))
    assert eng.tier.bytes_read > 0 and eng.tier.bytes_written > 0
    if eng.deferred:  # [Note: gradients on the disk]: no host buffer for a swapped unit's gradient
        assert "grad" in eng.tier.regions[3].fields
        assert not any(id(u) in eng.grads.host_grads for u in eng.blocks if u.swap)
        assert eng.plan.host_bytes["grad_buffers"] == 4 * sum(
            u.numel for u in eng.units if not u.optimizer_on_device and not u.swap
        )
    if clip == 0.05:
        assert eng.speculation_stats["rolled_back"] >= 1
    ref.close()
    eng.close()


def test_deepspeed_style_loop_over_the_disk_tier(tmp_path):
    ref, eng = _pair(tmp_path, disk_blocks=3, disk_weights=True)
    data = tm.batches(3, G)
    for mbs in data:
        a = tm.ds_losses(ref, mbs)
        b = tm.ds_losses(eng, mbs)
        assert torch.equal(torch.stack(a), torch.stack(b))
    _assert_bitwise(_state(eng), _state(ref))


def test_module_and_export_read_the_weights_on_the_disk(tmp_path):
    ref, eng = _pair(tmp_path, disk_blocks=2, disk_weights=True)
    for m in tm.batches(2, G):
        ref.train_batch(m)
        eng.train_batch(m)
    for (n, p), (_, q) in zip(eng.module.named_parameters(), ref.module.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), n
    eng.save_pretrained(tmp_path / "out")
    from safetensors.torch import load_file

    exported = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        exported.update(load_file(f))
    for n, q in ref.module.named_parameters():
        if n in exported:
            assert torch.equal(exported[n], q.detach().to(exported[n].dtype)), n
    final = {n: p.detach().clone() for n, p in ref.module.named_parameters()}
    eng.close()  # the swap file goes; the module keeps the final weights in host memory
    assert not list((tmp_path / "nvme").glob("zerofit-swap-*.bin"))
    for n, p in eng.module.named_parameters():
        assert torch.equal(p.detach(), final[n]), n


def _straight(model, data):
    """The same model trained on ``data`` in one run, state in host memory: the reference of a resume."""
    ref = zerofit.initialize(copy.deepcopy(model), _cfg())
    for m in data:
        ref.train_batch(m)
    return ref


@pytest.mark.parametrize("direction", ["disk-to-memory", "memory-to-disk"])
def test_checkpoints_are_the_same_whatever_the_tier(tmp_path, direction):
    """Saved with the tier, resumed without it (and the other way): the continuation is bitwise the
    uninterrupted run's."""
    torch.manual_seed(0)
    model = tm.llama(layers=4)
    init = copy.deepcopy(model)
    data = tm.batches(6, G)
    straight = _straight(model, data)
    tier = dict(disk_blocks=2, disk_weights=True)
    first = zerofit.initialize(model, _cfg(tmp_path / "nvme", **tier) if direction == "disk-to-memory" else _cfg())
    for m in data[:3]:
        first.train_batch(m)
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    second = zerofit.initialize(init, _cfg(tmp_path / "nvme2", **tier) if direction == "memory-to-disk" else _cfg())
    second.load_checkpoint(tmp_path / "ckpt")
    for m in data[3:]:
        second.train_batch(m)
    _assert_bitwise(_state(second), _state(straight))


def _inject(monkeypatch, op: str, err: int, after: int):
    """Make the tier's ``op`` ('read'/'write') fail with ``err`` from its ``after``-th call on."""
    name = "_pwrite" if op == "write" else "_pread"
    real = getattr(swapfile_mod, name)
    calls = [0]

    def faulty(fd, bufs, offset):
        calls[0] += 1
        if calls[0] > after:
            raise OSError(err, os.strerror(err))
        return real(fd, bufs, offset)

    monkeypatch.setattr(swapfile_mod, name, faulty)
    return calls


@pytest.mark.parametrize("op,err", [("write", errno.ENOSPC), ("read", errno.EIO)], ids=["ENOSPC-write", "EIO-read"])
def test_io_error_mid_step_fails_the_engine_and_the_checkpoint_resumes(tmp_path, monkeypatch, op, err):
    torch.manual_seed(0)
    model = tm.llama(layers=4)
    init = copy.deepcopy(model)
    data = tm.batches(5, G)
    straight = _straight(model, data)
    eng = zerofit.initialize(model, _cfg(tmp_path / "nvme", disk_blocks=2, disk_weights=True))
    eng.train_batch(data[0])
    eng.save_checkpoint(tmp_path / "ckpt")
    _inject(monkeypatch, op, err, after=3)  # a few requests of the next step go through, then it fails
    with pytest.raises(EngineFailedError) as info:
        for m in data[1:]:
            eng.train_batch(m)
        eng.wait()
    msg = str(info.value)
    assert "zerofit-swap-0.bin" in msg and os.strerror(err) in msg, msg
    assert "resume from the last checkpoint" in msg
    with pytest.raises(EngineFailedError):  # never trains on from a half-written step
        eng.train_batch(data[1])
    monkeypatch.undo()
    assert not list((tmp_path / "nvme").glob("zerofit-swap-*.bin")), "a failed engine removes its swap file"
    fresh = zerofit.initialize(init, _cfg(tmp_path / "nvme", disk_blocks=2, disk_weights=True))
    fresh.load_checkpoint(tmp_path / "ckpt")
    for m in data[1:]:
        fresh.train_batch(m)
    _assert_bitwise(_state(fresh), _state(straight))


def test_preflight_refusals(tmp_path, monkeypatch):
    from zerofit.config.schema import ConfigError

    model = tm.llama(layers=4)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):  # (root can write anywhere)
            with pytest.raises(ConfigError, match="nvme_path"):
                zerofit.initialize(copy.deepcopy(model), _cfg(ro / "x", disk_blocks=1))
    finally:
        ro.chmod(0o700)
    with pytest.raises(ConfigError, match="nvme_path"):  # a file, not a folder
        (tmp_path / "file").write_text("x")
        zerofit.initialize(copy.deepcopy(model), _cfg(tmp_path / "file", disk_blocks=1))
    # not enough free space for the plan: refused by the planner, naming the disk bytes
    monkeypatch.setattr("zerofit.engine.plan.engine_plan.free_bytes", lambda p: 4096)
    with pytest.raises(PlanError, match="disk needs"):
        zerofit.initialize(copy.deepcopy(model), _cfg(tmp_path / "nvme", disk_blocks=2))
    monkeypatch.undo()

    # the reservation itself fails (the space went meanwhile): DiskTierError naming the path, nothing left
    def no_space(fd, off, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(disk_mod.DiskTierError, match=r"zerofit-swap-0\.bin: cannot reserve"):
        zerofit.initialize(copy.deepcopy(model), _cfg(tmp_path / "nvme", disk_blocks=2))
    assert not list((tmp_path / "nvme").glob("zerofit-swap-*.bin"))


def test_swap_files_are_reused_and_removed(tmp_path):
    folder = tmp_path / "nvme"
    folder.mkdir()
    # two files a crashed run left behind (no lock held): the next run reuses the first, removes the other
    (folder / "zerofit-swap-0.bin").write_bytes(b"\x7f" * 8192)
    (folder / "zerofit-swap-3.bin").write_bytes(b"\x7f" * 8192)
    model = tm.llama(layers=4)
    a = zerofit.initialize(copy.deepcopy(model), _cfg(folder, disk_blocks=2))
    assert a.tier.file.reused and a.tier.file.path.name == "zerofit-swap-0.bin"
    assert sorted(p.name for p in folder.iterdir()) == ["zerofit-swap-0.bin"]
    # the reused file's old bytes do not show through: the moments start at zero
    assert all(float(u.exp_avg.abs().max()) == 0.0 for u in a.blocks if u.swap)
    b = zerofit.initialize(copy.deepcopy(model), _cfg(folder, disk_blocks=2))  # a second live run
    assert b.tier.file.path.name == "zerofit-swap-1.bin"
    with open(a.tier.file.path, "rb") as f:  # held while in use
        with pytest.raises(BlockingIOError):
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    a.close()
    assert sorted(p.name for p in folder.iterdir()) == ["zerofit-swap-1.bin"]
    del b  # never closed: released when collected
    gc.collect()
    assert list(folder.iterdir()) == []


def test_planner_puts_moments_on_the_disk_first_and_only_what_host_memory_cannot_hold():
    shape = ModelShape(1000, (40_000_000,) * 8, 64, 256, 100)
    batch = BatchShape(1, 16, 1)
    kw = dict(
        compute_dtype=torch.bfloat16,
        on_cuda=True,
        device_budget=None,
        deferred_updates=False,
        checkpointing=True,
        stream_params=True,
        resident_blocks=0,
        prefetch_depth=None,
        disk=True,
        disk_budget=10**12,
    )
    roomy = make_plan(shape, batch, host_budget=10**12, **kw)
    assert roomy.disk_blocks == ()
    need = roomy.host_total

    def forced(budget, k, weights):
        return make_plan(shape, batch, host_budget=10**12, **(kw | dict(disk_blocks=k, disk_weights=weights)))

    # 2 GB short: the moments of the last few blocks move, no master; one block fewer would not fit
    budget = need - 2_000_000_000
    p1 = make_plan(shape, batch, host_budget=budget, **kw)
    k = len(p1.disk_blocks)
    assert set(p1.disk_of.values()) == {"moments"} and sorted(p1.disk_of) == list(range(8 - k, 8))
    assert p1.host_total <= budget < forced(budget, k - 1, False).host_total
    assert k > 1 and p1.disk_bytes == k * 2 * -(-160_000_000 // 4096) * 4096  # fields 4 KiB aligned
    # shorter than every block's moments can make up: masters follow, from the last block
    all_moments = forced(None, 8, False)
    budget = all_moments.host_total - 100_000_000
    p3 = make_plan(shape, batch, host_budget=budget, **kw)
    assert set(p3.disk_of) == set(range(8)) and p3.disk_of[7] == "all" and p3.disk_of[0] == "moments"
    assert p3.host_total <= budget
    # a disk too small for what must go there: refused, naming the disk bytes
    with pytest.raises(PlanError, match="disk needs"):
        make_plan(shape, batch, host_budget=budget, **(kw | dict(disk_budget=10**8)))
    # no NVMe tier: the refusal says what would fit, with the numbers
    with pytest.raises(PlanError) as info:
        make_plan(shape, batch, host_budget=budget, **(kw | dict(disk=False, disk_budget=None)))
    msg = str(info.value)
    assert "an NVMe tier with at least" in msg and "max_host_memory" in msg, msg


def test_a_plan_with_the_tier_says_where_everything_is(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="zerofit")
    model = tm.llama(layers=4)
    eng = zerofit.initialize(model, _cfg(tmp_path / "nvme", disk_blocks=2, disk_weights=False))
    text = eng.plan.describe()
    assert "disk" in text and "moments of blocks 2-3" in text and "measured write" in text, text
    logs = caplog.text
    assert "NVMe tier" in logs and "GB/s" in logs
    assert "blocks 2-3: master in host memory, moments on the disk" in logs
    eng.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tier_streams_any_order_of_updates_without_losing_a_write(tmp_path, seed):
    """The tier's scheduling under orders it was not told: reads announced in one order, updates taken in
    another (read-ahead buffers taken back), write-only gradient stashes between them, few buffers. Every
    element ends as the arithmetic says, and nothing waits forever."""
    import random
    import threading

    from zerofit.engine.disk.tier import DiskTier, SwapFile, layout

    rng = random.Random(seed)
    numels = [10_000, 7_000, 12_288, 4_096, 9_999]
    regions, nbytes = layout([(i, n, ("master", "exp_avg", "grad")) for i, n in enumerate(numels)])
    tier = DiskTier(SwapFile(tmp_path, nbytes, threads=3, block_bytes=8192), regions, chunk=3072, buffers=4)
    expected = {i: torch.zeros(n) for i, n in enumerate(numels)}
    errors = []

    def work():
        try:
            for rnd in range(6):
                order = list(range(len(numels)))
                rng.shuffle(order)
                told = order[:]
                rng.shuffle(told)
                tier.expect(told[:3])  # some announced, in another order
                for key in order:
                    g = float(rnd + key + 1)
                    for c, (_a, _k) in enumerate(tier.chunks(key)):  # stash a gradient, write-only
                        tier.acquire(key, c, write_only=("grad",))["grad"].fill_(g)
                        tier.release(key, c)
                    for c, (_a, _k) in enumerate(tier.chunks(key)):  # then the update reads it with the state
                        f = tier.acquire(key, c)
                        assert torch.all(f["grad"] == g), (key, c, rnd)
                        f["master"].add_(f["grad"])
                        f["exp_avg"].add_(1.0)
                        tier.release(key, c)
                    expected[key] += g
            tier.drain()
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the tier deadlocked"
    assert not errors, errors
    for key, _n in enumerate(numels):
        assert torch.equal(tier.view(key, "master"), expected[key]), key
        assert torch.all(tier.view(key, "exp_avg") == 6.0), key
    assert tier.bytes_written > 0 and tier.bytes_read > 0
    tier.close()
    assert not list(tmp_path.glob("zerofit-swap-*.bin"))


def test_split_updates_beside_the_disk_tier(tmp_path):
    """Clipped bf16 with split updates ([Note: the master behind its cast]) and blocks on the disk tier: the
    in-memory streamed blocks take the cast pass and the rest pass, the swapped ones their chunked one-pass update;
    losses, masters and moments are the in-memory engine's bitwise."""
    ref, eng = _pair(tmp_path, clip=0.05, disk_blocks=2, disk_weights=False, split_updates=True)
    assert eng.host_updates.split and eng.stepper.cast_first
    parts = []
    apply = eng.host_updates.apply
    eng.host_updates.apply = lambda unit, grad, ops, part=None: (
        parts.append((unit.swap, part)),
        apply(unit, grad, ops, part),
    )
    data = tm.batches(4, G)
    assert [eng.train_batch(m) for m in data] == [ref.train_batch(m) for m in data]
    _assert_bitwise(_state(eng), _state(ref))
    assert (None, "cast") in parts and (None, "rest") in parts
    assert {p for s, p in parts if s} == {None}  # the disk tier's units: one pass
    ref.close()
    eng.close()


def test_a_refusal_beside_the_tier_names_the_smallest_host_budget_and_fewer_micro_batches():
    """32 micro-batches keep 32 micro-batches' block checkpoints in host memory: with the NVMe tier configured,
    the refusal names the smallest host budget that fits beside it (to a MiB) and the most micro-batches per step
    that fit the budget given, each checked by planning it."""
    import re

    from zerofit.engine.plan.search import GiB, MiB

    shape = ModelShape(50_000_000, (40_000_000,) * 8, 1024, 2816, 32000)
    batch = BatchShape(2, 2048, 32)
    kw = dict(
        compute_dtype=torch.bfloat16,
        on_cuda=True,
        device_budget=3 * GiB,
        deferred_updates=False,
        checkpointing=True,
        stream_params=True,
        resident_blocks=None,
        prefetch_depth=None,
        disk=True,
        disk_budget=10**12,
    )
    with pytest.raises(PlanError) as info:
        make_plan(shape, batch, host_budget=2 * GiB, **kw)
    msg = str(info.value)
    m = re.search(r"max_host_memory\) of at least ([\d.]+) GiB beside the NVMe tier", msg)
    assert m, msg
    need = round(float(m.group(1)) * GiB)
    fits = make_plan(shape, batch, host_budget=need + 10 * MiB, **kw)  # the figure is rounded to 0.01 GiB
    assert fits.disk_blocks and fits.offload_checkpoints
    with pytest.raises(PlanError):
        make_plan(shape, batch, host_budget=need - 10 * MiB, **kw)
    m = re.search(r"gradient_accumulation_steps (\d+) or fewer", msg)
    assert m, msg
    g = int(m.group(1))
    assert g < 32
    make_plan(shape, BatchShape(2, 2048, g), host_budget=2 * GiB, **kw)
    with pytest.raises(PlanError):
        make_plan(shape, BatchShape(2, 2048, 2 * g), host_budget=2 * GiB, **kw)


def test_closing_with_writes_in_flight_reads_nothing_more(tmp_path, monkeypatch, caplog):
    """A write that completes while the tier closes frees its buffer; that must not issue the next expected read
    on the stopping pool (else a run's exit prints "cannot schedule new futures after shutdown" tracebacks from the
    write callbacks, as W3a at 32 micro-batches did: docs/benchmarks.md). The file goes."""
    import logging
    import threading

    from zerofit.engine.disk.tier import DiskTier, SwapFile, layout

    real = swapfile_mod._pwrite
    gate = threading.Event()

    def slow(fd, bufs, offset):
        gate.wait(5)
        return real(fd, bufs, offset)

    monkeypatch.setattr(swapfile_mod, "_pwrite", slow)
    regions, nbytes = layout([(i, 3072, ("master", "exp_avg")) for i in range(4)])
    tier = DiskTier(SwapFile(tmp_path, nbytes, threads=2, block_bytes=8192), regions, chunk=3072, buffers=2)
    tier.expect([0, 1, 2, 3])  # two buffers: units 0 and 1 read ahead, 2 and 3 queued
    for key in (0, 1):
        f = tier.acquire(key, 0)
        f["master"].fill_(key + 1.0)
        tier.release(key, 0)  # its write waits on the gate
    pool, stopped = tier.file._pool, threading.Event()
    real_shutdown = pool.shutdown

    def shutdown(wait=True, **kw):  # the pool refuses new work, then the writes may complete
        real_shutdown(wait=False, **kw)
        stopped.set()
        real_shutdown(wait=wait, **kw)

    pool.shutdown = shutdown
    closer = threading.Thread(target=tier.close)
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        closer.start()
        assert stopped.wait(10)
        gate.set()  # the writes complete, their callbacks free the buffers
        closer.join(30)
    assert not closer.is_alive()
    assert not [r for r in caplog.records if r.name == "concurrent.futures"], caplog.text
    assert not list(tmp_path.glob("zerofit-swap-*.bin"))


def test_the_mixed_speed_test_reads_and_writes_what_it_counts(tmp_path, monkeypatch):
    """SwapFile.measure_mixed (bench/probes/disk_probe.py) counts the bytes of half the file read while the other half
    is written: the pool sees exactly those, after the untimed write of the half read."""
    from zerofit.engine.disk.tier import SwapFile

    seen = []
    real_r, real_w = swapfile_mod._pread, swapfile_mod._pwrite

    def rd(fd, bufs, offset):
        seen.append(("read", offset, sum(len(b) for b in bufs)))
        return real_r(fd, bufs, offset)

    def wr(fd, bufs, offset):
        seen.append(("write", offset, sum(len(b) for b in bufs)))
        return real_w(fd, bufs, offset)

    monkeypatch.setattr(swapfile_mod, "_pread", rd)
    monkeypatch.setattr(swapfile_mod, "_pwrite", wr)
    f = SwapFile(tmp_path, 8 << 20, threads=2, block_bytes=1 << 20)
    try:
        speed = f.measure_mixed(8 << 20)
    finally:
        f.close()
    half = 4 << 20
    first, timed = seen[:4], seen[4:]  # the untimed write of the first half, then the mix
    assert all(op == "write" and off < half for op, off, _ in first)
    assert sum(n for op, off, n in timed if op == "read" and off < half) == half
    assert sum(n for op, off, n in timed if op == "write" and off >= half) == half
    assert len(timed) == 8
    assert speed > 0
