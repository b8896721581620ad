"""Checkpoints: DeepSpeed's save/load meaning, the on-disk format, and refusal of anything not complete.

RELIABILITY.md: "corrupt checkpoints are refused: truncate a shard, flip bytes, delete a
shard, change a shape: a specific error naming the file; never a silent load". Each
refusal here also checks that the engine it was loading into is untouched and still trains.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import zerofit
from tests.support import tiny_models as tm
from zerofit.checkpoint import (
    CheckpointIncompleteError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointStateError,
    ChecksumMismatchError,
    EngineStateLostError,
    MissingFileError,
    TruncatedFileError,
    list_tags,
    prune,
)
from zerofit.checkpoint import commit as commit_mod
from zerofit.checkpoint import state as state_mod
from zerofit.checkpoint.commit import RECORD, CommitRecord
from zerofit.checkpoint.lock import SAVE_LOCK

G = 2


def _cfg(**kw):
    return {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": G,
        "gradient_clipping": 1.0,
        "optimizer": {"lr": 3e-3},
    } | kw


def _engine(build=tm.llama, steps=2, **kw):
    torch.manual_seed(0)
    engine = zerofit.initialize(build(), _cfg(**kw))
    for mbs in tm.batches(steps, G):
        engine.train_batch(mbs)
    return engine


def _snapshot(engine):
    engine.wait()
    out = {}
    for e in state_mod.weight_entries(engine) + state_mod.optimizer_entries(engine):
        out[e.name] = e.base[e.offset : e.offset + e.numel].clone()
    return out, [float(u.step) for u in engine.units], engine.global_step


def _same(a, b) -> bool:
    return a[1:] == b[1:] and a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])


def test_deepspeed_meaning_tags_latest_and_client_state(tmp_path, caplog):
    engine = _engine()
    with caplog.at_level(logging.WARNING, logger="zerofit"):
        assert engine.load_checkpoint(tmp_path) == (None, None)  # nothing saved yet: a warning only
    assert "no 'latest'" in caplog.text
    path = engine.save_checkpoint(tmp_path, client_state={"data": {"epoch": 1, "pos": 17}})
    assert Path(path) == tmp_path / "global_step2" and (tmp_path / "latest").read_text() == "global_step2"
    engine.train_batch(tm.batches(1, G, seed=5)[0])
    engine.save_checkpoint(tmp_path, tag="mine", client_state={"n": 3}, save_latest=False)
    assert (tmp_path / "latest").read_text() == "global_step2"
    fresh = zerofit.initialize(tm.llama(), _cfg())
    p, client = fresh.load_checkpoint(tmp_path)  # latest
    assert Path(p).name == "global_step2" and client == {"data": {"epoch": 1, "pos": 17}}
    assert fresh.global_step == 2
    p, client = fresh.load_checkpoint(tmp_path, tag="mine")
    assert client == {"n": 3} and fresh.global_step == 3
    assert _same(_snapshot(fresh), _snapshot(engine))
    with pytest.raises(CheckpointNotFoundError, match=r"'nope'.*tags there: .*global_step2"):
        fresh.load_checkpoint(tmp_path, tag="nope")
    with pytest.raises(ValueError, match="plain folder name"):
        engine.save_checkpoint(tmp_path, tag="../x")


def test_files_are_safetensors_named_by_parameter_weights_apart_from_moments(tmp_path):
    engine = _engine(build=tm.gpt2)  # tied: lm_head.weight is transformer.wte.weight
    folder = Path(engine.save_checkpoint(tmp_path))
    index = json.loads((folder / "weights.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    canonical = {n for n, _ in engine.adapter.model.named_parameters()}
    assert names == canonical and "lm_head.weight" not in names
    master = engine.master_state_dict()
    with safe_open(folder / "weights-00001-of-00001.safetensors", "pt") as f:
        for n in f.keys():
            assert torch.equal(f.get_tensor(n), master[n]), n
    opt = json.loads((folder / "optimizer.safetensors.index.json").read_text())["weight_map"]
    assert set(opt) == {f"{n}.{m}" for n in canonical for m in ("exp_avg", "exp_avg_sq")}
    unit = engine.blocks[1]
    name = engine.adapter.block_prefix(1) + "." + unit.layout.names[0]
    with safe_open(folder / opt[name + ".exp_avg_sq"], "pt") as f:
        want = unit.exp_avg_sq[: unit.layout.shapes[0].numel()].view(unit.layout.shapes[0])
        assert torch.equal(f.get_tensor(name + ".exp_avg_sq"), want)
    record = json.loads((folder / RECORD).read_text())
    assert record["state"]["global_step"] == 2 and set(record["files"]) == {p.name for p in folder.iterdir()} - {RECORD}
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gpt2"


def test_many_shards_and_a_replaced_tag(tmp_path):
    engine = _engine()
    state_mod.save(engine, tmp_path, "t", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "t").glob("*.safetensors"))
    assert len([f for f in files if f.startswith("weights-")]) > 2 and "optimizer-00001-of-000" in files[0]
    first = _snapshot(engine)
    engine.train_batch(tm.batches(1, G, seed=9)[0])
    state_mod.save(engine, tmp_path, "t")  # same tag: swapped in atomically
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != SAVE_LOCK]  # the engine holds it
    fresh = zerofit.initialize(tm.llama(), _cfg())
    fresh.load_checkpoint(tmp_path, "t")
    assert _same(_snapshot(fresh), _snapshot(engine)) and not _same(first, _snapshot(fresh))


def _corrupt_cases():
    def truncate(folder):
        p = folder / "weights-00001-of-00001.safetensors"
        os.truncate(p, p.stat().st_size - 5)
        return p, TruncatedFileError

    def flip(folder):
        p = folder / "optimizer-00001-of-00001.safetensors"
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 0x10
        p.write_bytes(bytes(b))
        return p, ChecksumMismatchError

    def delete(folder):
        p = folder / "optimizer-00001-of-00001.safetensors"
        p.unlink()
        return p, MissingFileError

    def record(folder):
        p = folder / RECORD
        p.write_text(p.read_text().replace('"global_step": 2', '"global_step": 7'))
        return p, ChecksumMismatchError

    return {"truncated shard": truncate, "flipped byte": flip, "deleted shard": delete, "edited record": record}


@pytest.mark.parametrize("case", list(_corrupt_cases()))
def test_corrupt_checkpoint_is_refused_naming_the_file_and_the_engine_is_untouched(tmp_path, case):
    saved = _engine()
    folder = Path(saved.save_checkpoint(tmp_path))
    path, err = _corrupt_cases()[case](folder)
    target = _engine(steps=1)
    before = _snapshot(target)
    with pytest.raises(err, match=str(path)):
        target.load_checkpoint(tmp_path)
    assert _same(before, _snapshot(target))
    target.train_batch(tm.batches(1, G)[0])  # still usable


def _rewrite_shape(folder: Path, name: str, new_shape: list[int]) -> Path:
    """Edit one tensor's shape in a shard header (same bytes) and re-seal the record: a consistent file of
    another model, which only the shape check can catch."""
    p = folder / "weights-00001-of-00001.safetensors"
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    head[name]["shape"] = new_shape
    new = json.dumps(head, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n
    p.write_bytes(raw[:8] + new + raw[8 + n :])
    rec = CommitRecord.read(folder)
    files = tuple(commit_mod.FileEntry(f.name, f.bytes, commit_mod.crc_of_file(folder / f.name)[1]) for f in rec.files)
    (folder / RECORD).write_bytes(CommitRecord(rec.tag, files, rec.state).to_bytes())
    return p


def test_changed_shape_and_other_model_are_refused_naming_the_tensor(tmp_path):
    saved = _engine()
    folder = Path(saved.save_checkpoint(tmp_path))
    name = "model.layers.1.mlp.up_proj.weight"  # (64, 32)
    path = _rewrite_shape(folder, name, [32, 64])
    target = _engine(steps=1)
    before = _snapshot(target)
    with pytest.raises(CheckpointMismatchError, match=rf"{path}: tensor {name} is \[32, 64\]"):
        target.load_checkpoint(tmp_path)
    other = zerofit.initialize(tm.llama(layers=2), _cfg())
    folder2 = Path(saved.save_checkpoint(tmp_path / "b"))
    with pytest.raises(CheckpointMismatchError, match=r"not in this model \(e\.g\. model\.layers\.2\."):
        other.load_checkpoint(folder2.parent)
    assert _same(before, _snapshot(target))


def test_incomplete_and_stale_folders_are_never_loaded_and_are_cleaned_up(tmp_path):
    engine = _engine()
    engine.save_checkpoint(tmp_path)
    dead = tmp_path / ".tmp-global_step9-999999999-abcd"  # a killed save (no such pid)
    dead.mkdir()
    (dead / "weights-00001-of-00001.safetensors").write_bytes(b"junk")
    (tmp_path / "half").mkdir()  # a folder without a commit record
    fresh = zerofit.initialize(tm.llama(), _cfg())
    with pytest.raises(CheckpointIncompleteError, match="half: no zerofit_checkpoint.json"):
        fresh.load_checkpoint(tmp_path, tag="half")
    assert Path(fresh.load_checkpoint(tmp_path)[0]).name == "global_step2"
    live = tmp_path / f".tmp-global_step9-{os.getppid()}-beef"  # another live process's save in progress
    live.mkdir()
    engine.train_batch(tm.batches(1, G)[0])
    engine.save_checkpoint(tmp_path)
    assert not dead.exists() and live.exists()


def test_replacement_without_rename_exchange_recovers_from_the_moved_aside_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(commit_mod, "exchange", lambda a, b: False)
    engine = _engine()
    engine.save_checkpoint(tmp_path, tag="t")
    engine.train_batch(tm.batches(1, G)[0])
    engine.save_checkpoint(tmp_path, tag="t")
    assert sorted(p.name for p in tmp_path.iterdir()) == [SAVE_LOCK, "latest", "t"]
    os.rename(tmp_path / "t", tmp_path / ".replaced-t-1-ab")  # killed between the two renames
    fresh = zerofit.initialize(tm.llama(), _cfg())
    assert Path(fresh.load_checkpoint(tmp_path)[0]).name == ".replaced-t-1-ab"
    assert _same(_snapshot(fresh), _snapshot(engine))


def test_load_refused_mid_accumulation(tmp_path):
    """A save mid-window saves the last step's state, as DeepSpeed does
    (tests/integration/test_deepspeed_checkpoints.py); a load mid-window is refused."""
    engine = _engine()
    out = engine(**tm.batches(1, G)[0][0])
    engine.save_checkpoint(tmp_path / "mid")
    engine.backward(out.loss)
    with pytest.raises(CheckpointStateError, match="1 micro-batches since"):
        engine.load_checkpoint(tmp_path)
    engine.step()  # a no-op before the boundary
    out = engine(**tm.batches(1, G)[0][1])
    engine.backward(out.loss)
    engine.step()
    assert engine.global_step == 3 and engine.save_checkpoint(tmp_path)
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_failure_after_copying_started_makes_the_engine_unusable(tmp_path, monkeypatch):
    engine = _engine()
    engine.save_checkpoint(tmp_path)
    real = state_mod.copy_into

    def copy_then_fail(*a, **k):
        real(*a, **k)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(state_mod, "copy_into", copy_then_fail)
    target = _engine(steps=1)
    with pytest.raises(EngineStateLostError, match="partly from the checkpoint"):
        target.load_checkpoint(tmp_path)
    from zerofit.engine.lifecycle import EngineFailedError, EngineState

    assert target.state is EngineState.FAILED
    for use in (
        lambda: target.train_batch(tm.batches(1, G)[0]),
        lambda: target.module,
        lambda: target(**tm.batches(1, G)[0][0]),
        lambda: target.save_checkpoint(tmp_path / "other"),
    ):
        with pytest.raises(EngineFailedError, match="partly from the checkpoint"):
            use()


def test_prune_keeps_the_newest_and_never_the_latest(tmp_path):
    engine = _engine(steps=1)
    for i in range(4):
        engine.save_checkpoint(tmp_path, tag=f"s{i}", save_latest=(i != 3))
        time.sleep(0.01)  # distinct commit times
    assert prune(tmp_path, keep=2) == ["s0", "s1"]
    assert list_tags(tmp_path) == ["s2", "s3"] and (tmp_path / "latest").read_text() == "s2"
    assert prune(tmp_path, keep=1) == []  # s2 is older but `latest` names it
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != SAVE_LOCK]  # the engine holds it
