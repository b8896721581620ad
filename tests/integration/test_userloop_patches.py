"""The callables zerofit replaces in the process (zerofit/userloop/patches.py, [Note: the process-wide patches]):
its table ``PATCHES`` is what a wrap installs (accelerate and Lightning imported first, as their scripts do), each
replacement in place and its original recorded; ``ZEROFIT_PATCHES`` installs only the groups it names, ``none``
leaves torch's ``clip_grad_norm_``, the GradScalers' unscale and the rest untouched (identity against the originals),
and a wrap without the torch group is refused by name; importing zerofit replaces nothing; docs/fsdp.md lists the
table. Each case runs in a process of its own: the patches are process-wide and installed once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerofit.userloop import patches
from zerofit.userloop.patches import GROUPS, PATCHES

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

# run in a new process: the originals taken before zerofit is imported, then accelerate, Lightning and zerofit
# imported, a tiny model wrapped; prints what changed, as JSON
_SCRIPT = r"""
import json
import sys

import torch
import torch.nn.utils.clip_grad as clip_mod
import torch.optim.optimizer as optim_mod
from torch.amp.grad_scaler import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from torch.utils.data.dataloader import _BaseDataLoaderIter

import accelerate.accelerator
import lightning.fabric.strategies.ddp as fabric_ddp
import lightning.pytorch.strategies.ddp as trainer_ddp

def state():
    return {
        "torch.nn.utils.clip_grad_norm_": (torch.nn.utils.clip_grad_norm_, clip_mod.clip_grad_norm_),
        "torch.amp.GradScaler._unscale_grads_": vars(GradScaler)["_unscale_grads_"],
        "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler._unscale_grads_":
            vars(ShardedGradScaler)["_unscale_grads_"],
        "torch.optim.Optimizer.zero_grad": vars(torch.optim.Optimizer)["zero_grad"],
        "torch.nn.Module.zero_grad": vars(torch.nn.Module)["zero_grad"],
        "torch.utils.data.dataloader._BaseDataLoaderIter.__next__": vars(_BaseDataLoaderIter)["__next__"],
        "torch.optim.Optimizer.step (global pre-hook)": tuple(optim_mod._global_optimizer_pre_hooks.values()),
        "torch.optim.Optimizer.step (global post-hook)": tuple(optim_mod._global_optimizer_post_hooks.values()),
        "accelerate.Accelerator.prepare_model": vars(accelerate.accelerator.Accelerator)["prepare_model"],
        "accelerate.Accelerator._clip_grad_norm_dtensor_aware":
            vars(accelerate.accelerator.Accelerator)["_clip_grad_norm_dtensor_aware"],
        "lightning.pytorch.strategies.DDPStrategy.configure_ddp": vars(trainer_ddp.DDPStrategy)["configure_ddp"],
        "lightning.fabric.strategies.DDPStrategy.setup_module": vars(fabric_ddp.DDPStrategy)["setup_module"],
        "lightning.fabric.strategies.ddp._DDPBackwardSyncControl.no_backward_sync":
            vars(fabric_ddp._DDPBackwardSyncControl)["no_backward_sync"],
    }

def differs(a, b):
    if isinstance(a, tuple):
        return len(a) != len(b) or any(x is not y for x, y in zip(a, b))
    return a is not b

def changed(before, now):
    return sorted(k for k in before if differs(before[k], now[k]))

originals = state()
from zerofit.fsdp import CPUOffload, FullyShardedDataParallel as FSDP
from zerofit.userloop import UserLoopError, patches
from tests.support import tiny_models as tm

at_import = changed(originals, state())
try:
    FSDP(tm.llama(layers=1, tied=False), cpu_offload=CPUOffload(offload_params=True))
    refused = None
except UserLoopError as e:
    refused = str(e)
now = state()
records = patches.installed()
in_place = all(getattr(h, a) is r.replacement for r in records.values() for h, a in r.where)
originals_kept = all(
    r.original is (originals[o][0] if o == "torch.nn.utils.clip_grad_norm_" else originals[o])
    for o, r in records.items() if r.where
)
hooks_registered = all(
    r.replacement in now[o] for o, r in records.items() if not r.where
)
print("RESULT " + json.dumps({
    "at_import": at_import, "changed": changed(originals, now), "installed": sorted(records),
    "in_place": in_place, "originals_kept": originals_kept, "hooks_registered": hooks_registered,
    "refused": refused,
}))
"""


def _run(env_value: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop(patches.ENV, None)
    if env_value is not None:
        env[patches.ENV] = env_value
    p = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _of(*groups: str) -> list[str]:
    return sorted(o for o, p in PATCHES.items() if p.group in groups)


def test_the_table_is_what_a_wrap_installs():
    """Default: every entry of PATCHES installed, in place, its original recorded; nothing else changed; importing
    zerofit (zerofit.userloop, zerofit.fsdp) changed nothing before the wrap."""
    r = _run(None)
    assert r["refused"] is None
    assert r["at_import"] == []
    assert r["installed"] == sorted(PATCHES)
    assert r["changed"] == sorted(PATCHES)  # torch's clip and both GradScalers' unscale among them
    assert r["in_place"] and r["originals_kept"] and r["hooks_registered"]


def test_none_leaves_torch_untouched_and_a_wrap_is_refused_by_name():
    r = _run("none")
    assert r["at_import"] == [] and r["changed"] == [] and r["installed"] == []
    assert "ZEROFIT_PATCHES" in r["refused"] and "torch group" in r["refused"]


@pytest.mark.parametrize("groups", ["torch", "torch,lightning"])
def test_a_subset_installs_only_its_groups(groups):
    r = _run(groups)
    want = _of(*groups.split(","))
    assert r["refused"] is None
    assert r["installed"] == want and r["changed"] == want
    assert r["in_place"] and r["originals_kept"] and r["hooks_registered"]


def test_a_wrap_without_the_torch_group_or_with_an_unknown_group_is_refused():
    r = _run("accelerate,lightning")
    assert r["changed"] == [] and "ZEROFIT_PATCHES" in r["refused"] and "torch group" in r["refused"]
    r = _run("torch,deepspeed")
    assert r["changed"] == [] and "ZEROFIT_PATCHES" in r["refused"] and "deepspeed" in r["refused"]


def test_every_replacement_goes_through_the_table():
    """``_install`` of an owner missing from PATCHES fails: a replacement cannot be made without its row."""
    assert {p.group for p in PATCHES.values()} == set(GROUPS)
    with pytest.raises(KeyError):
        patches._install("torch.nn.functional.cross_entropy", lambda original: original)
    # what is installed in this process (whatever the tests before it wrapped) is in the table
    assert set(patches.installed()) <= set(PATCHES)


def test_the_docs_list_the_table():
    """docs/fsdp.md's "What zerofit replaces in your process": one row per entry of PATCHES, its group first."""
    text = (ROOT / "docs" / "fsdp.md").read_text()
    section = text.split("## What zerofit replaces in your process", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    assert [ln.split("|")[1].strip().strip("`") for ln in rows] == list(PATCHES)
    for ln in rows:
        owner = ln.split("|")[1].strip().strip("`")
        assert ln.split("|")[2].strip() == PATCHES[owner].group, owner
    assert "ZEROFIT_PATCHES" in section
