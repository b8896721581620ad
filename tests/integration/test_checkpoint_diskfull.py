"""Disk full while saving (RELIABILITY.md): a typed error naming the path, the bytes needed and free; the
partial save removed; the training state untouched; the previous checkpoint still loads.

Injected ENOSPC (a write seam) everywhere; a real full disk on a small tmpfs where mounting is allowed
(root on Linux), both refused up front and hit mid-write with the up-front check switched off.
"""

from __future__ import annotations

import errno
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.checkpoint import CheckpointDiskFullError, seams
from zerofit.checkpoint import save as save_mod
from zerofit.checkpoint.lock import SAVE_LOCK
from zerofit.checkpoint.state import optimizer_entries, weight_entries

G = 2
_CFG = {
    "device": "cpu",
    "precision": "fp32",
    "micro_batch_size": 2,
    "gradient_accumulation_steps": G,
    "gradient_clipping": 1.0,
}


def _pair():
    """Two identical engines after 2 steps: one tries the failing save, the twin does not."""
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        e = zerofit.initialize(tm.llama(), _CFG)
        for mbs in tm.batches(2, G):
            e.train_batch(mbs)
        out.append(e)
    return out


def _state(engine):
    engine.wait()
    return {
        e.name: e.base[e.offset : e.offset + e.numel].clone()
        for e in weight_entries(engine) + optimizer_entries(engine)
    }


def _assert_untouched_and_trains_on(engine, twin):
    a, b = _state(engine), _state(twin)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert engine.global_step == twin.global_step
    for mbs in tm.batches(2, G, seed=4):
        assert engine.train_batch(mbs) == twin.train_batch(mbs)
    assert all(torch.equal(x, y) for x, y in zip(_state(engine).values(), _state(twin).values()))


def _assert_previous_loads(root: Path, tag: str):
    assert (root / "latest").read_text() == tag
    assert not [p for p in root.iterdir() if p.name.startswith(".") and p.name != SAVE_LOCK], (
        "the partial save was left behind"
    )
    fresh = zerofit.initialize(tm.llama(), _CFG)
    path, client = fresh.load_checkpoint(root)
    assert Path(path).name == tag and client == {"tag": tag}


def _numbers(err: CheckpointDiskFullError):
    m = re.search(r"needs .*\((\d+) bytes\), .*\((\d+) bytes\) are free", str(err))
    assert m, str(err)
    return int(m[1]), int(m[2])


@pytest.mark.parametrize("where", ["weights", "optimizer", "client_state.pt"])
def test_injected_enospc_mid_write(tmp_path, where):
    engine, twin = _pair()
    engine.save_checkpoint(tmp_path, client_state={"tag": "global_step2"})
    twin.train_batch(tm.batches(1, G, seed=8)[0])
    engine.train_batch(tm.batches(1, G, seed=8)[0])
    with seams.fail_writes(errno.ENOSPC, after_bytes=100, match=where):
        with pytest.raises(CheckpointDiskFullError, match=rf"\.tmp-global_step3-.*/{re.escape(where)}") as ei:
            engine.save_checkpoint(tmp_path, client_state={"tag": "global_step3"})
    needed, free = _numbers(ei.value)
    assert needed > 3 * 4 * sum(p.numel() for p in engine.adapter.model.parameters() if p is not None) // 2
    assert ei.value.errno == errno.ENOSPC and isinstance(ei.value, OSError)
    _assert_previous_loads(tmp_path, "global_step2")
    _assert_untouched_and_trains_on(engine, twin)


def test_refused_before_writing_when_the_disk_is_too_small(tmp_path, monkeypatch):
    engine, twin = _pair()
    engine.save_checkpoint(tmp_path, client_state={"tag": "global_step2"})
    monkeypatch.setattr(save_mod, "free_bytes", lambda p: 1000)
    with pytest.raises(CheckpointDiskFullError, match=r"global_step2: not enough disk space before writing") as ei:
        engine.save_checkpoint(tmp_path, tag="global_step2", client_state={"tag": "other"})
    assert _numbers(ei.value)[1] == 1000
    _assert_previous_loads(tmp_path, "global_step2")
    _assert_untouched_and_trains_on(engine, twin)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A tmpfs of a given size (skipped where mounting is not permitted)."""
    mounted = []

    def make(size: int) -> Path:
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True, text=True
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
        mounted.append(point)
        return point

    yield make
    for p in mounted:
        subprocess.run(["umount", "-l", str(p)], capture_output=True)


def test_real_full_disk_on_a_small_tmpfs(tmp_path, tiny_tmpfs, monkeypatch):
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    engine, twin = _pair()
    with monkeypatch.context() as m:  # what the saver asks for one checkpoint
        m.setattr(save_mod, "free_bytes", lambda p: 0)
        with pytest.raises(CheckpointDiskFullError) as probe:
            engine.save_checkpoint(tmp_path / "probe", client_state={"tag": "global_step2"})
    root = tiny_tmpfs(-(-(_numbers(probe.value)[0] + 65536) // 4096) * 4096)  # one fits, not two
    engine.save_checkpoint(root, client_state={"tag": "global_step2"})
    for e in (engine, twin):
        e.train_batch(tm.batches(1, G, seed=8)[0])
    with pytest.raises(CheckpointDiskFullError, match="before writing") as ei:
        engine.save_checkpoint(root, client_state={"tag": "global_step3"})
    needed, free = _numbers(ei.value)
    assert needed > free and free == shutil.disk_usage(root).free
    _assert_previous_loads(root, "global_step2")
    monkeypatch.setattr(seams, "space_check", False)  # now the kernel's ENOSPC itself
    with pytest.raises(CheckpointDiskFullError, match=rf"{root}/\.tmp-global_step3-.*while writing"):
        engine.save_checkpoint(root, client_state={"tag": "global_step3"})
    _assert_previous_loads(root, "global_step2")
    _assert_untouched_and_trains_on(engine, twin)
