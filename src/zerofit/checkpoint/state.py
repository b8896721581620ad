"""The engine <-> checkpoint glue: which tensors an engine's training state is, and how a loaded state
becomes a consistent engine again.

The checkpoint names tensors by the model's canonical parameter names (the first
name of tied parameters), never by unit, slot or device: a unit's flat buffers are
cut at its layout's offsets. So the files are the same whatever the placement
(resident blocks, where the shell's optimizer runs, later the number of GPUs), and a
checkpoint saved under one plan loads under any other. Parameter groups reorder a unit's layout
([Note: segments per unit], engine/memory/store.py), never its names: tensors are written in the model's order,
so a checkpoint does not depend on the groups either (they are recorded, and a change is warned about).
"""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path

import torch

from zerofit.checkpoint import deepspeed_format, deepspeed_load, rng
from zerofit.checkpoint.commit import RECORD as COMMIT_RECORD
from zerofit.checkpoint.commit import verify
from zerofit.checkpoint.entries import (
    MOMENTS,
    RESUME_FIELDS,
    named_units,
    optimizer_entries,
    weight_entries,
)
from zerofit.checkpoint.errors import (
    CheckpointMismatchError,
    CheckpointStateError,
    EngineStateLostError,
    MissingFileError,
)
from zerofit.checkpoint.load import copy_into, locate, match, open_checkpoint, shard_files
from zerofit.checkpoint.model_files import dtype_name, model_side_files
from zerofit.checkpoint.save import (
    DEFAULT_SHARD_BYTES,
    OPTIMIZER_INDEX,
    WEIGHTS_INDEX,
    Content,
    SideFile,
    write_checkpoint,
)
from zerofit.lora import is_peft
from zerofit.optim.client_schedule import LR_SCHEDULER

log = logging.getLogger("zerofit")

CLIENT_STATE = "client_state.pt"
ZEROFIT_CONFIG = "zerofit_config.json"


def _refuse_mid_step(engine, action: str) -> None:
    open_window = engine.window.in_progress()
    if open_window:
        raise CheckpointStateError(
            f"cannot {action} in the middle of a gradient accumulation ({open_window}): the loaded weights would "
            "meet gradients of the current ones. Call it after engine.step() has taken the optimizer step "
            "(engine.is_gradient_accumulation_boundary())."
        )


# [Note: a save in the middle of an accumulation window]
# DeepSpeed's save_checkpoint between the micro-batches of a window saves the weights and optimizer state of
# the last optimizer step; the window's gradients are not saved (runtime/engine.py, save_checkpoint: the
# module and optimizer state only). zerofit does the same: between a window's micro-batches nothing has
# changed the masters, moments or step counts since the last step (the blocks' backward waits for the
# boundary: [Note: the block backward waits for the boundary], engine/step/window.py), so after
# engine.wait() (the last step's updates applied) the save reads them as at the boundary. The save only
# reads: the window (its held micro-batches, a pending forward, announced forwards) goes on in the saving
# engine, and its step is bitwise the one it takes without the save (tests/integration/test_deepspeed_checkpoints.py).
# The record says how far into the window it was; a load warns that those micro-batches' gradients are gone
# and that the loaded engine starts a new window. One moment is refused: after the boundary's backward and
# before its step(), the blocks' updates are under way (a streaming engine updates them during that backward).


def _window(engine) -> dict | None:
    """Where in an accumulation window a save is made: None at a boundary."""
    at = engine.window.position()
    if at is None:
        return None
    if at["micro_batches"] and engine.adapter.streaming and not at["held"]:
        raise CheckpointStateError(
            f"cannot save a checkpoint between the accumulation boundary's backward() and its step() "
            f"({at['micro_batches']} micro-batches): the optimizer step has begun (the blocks' updates run during "
            "that backward). Call engine.step() first, then save: the checkpoint then holds this step's update"
        )
    return {
        "micro_batches": at["micro_batches"],
        "forward_pending": at["forward_pending"],
        "gradient_accumulation_steps": engine.config.gradient_accumulation_steps,
    }


def save(
    engine,
    save_dir: Path | str,
    tag: str | None = None,
    client_state: dict | None = None,
    save_latest: bool = True,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    workers: int = 4,
    exclude_frozen: bool = False,
) -> Path:
    """Write the engine's whole training state as ``save_dir/<tag>`` (see docs/checkpoints.md); with
    ``exclude_frozen`` (DeepSpeed's ``exclude_frozen_parameters``) without the frozen parameters' weights,
    which the model the checkpoint is loaded into then supplies."""
    window = _window(engine)  # [Note: a save in the middle of an accumulation window]
    tag = tag if tag is not None else f"global_step{engine.global_step}"
    engine.wait()
    engine.dev.synchronize()
    buf = io.BytesIO()
    torch.save(client_state if client_state is not None else {}, buf)
    model = engine.adapter.model
    # [Note: the base's fingerprint] (zerofit/checkpoint/lora_base.py): a PEFT run's checkpoint holds its trainable
    # state, its adapter folder's files (for zerofit export) and a reference to the base, never the frozen base
    peft = is_peft(model)
    exclude_frozen = exclude_frozen or peft
    hf = model_side_files(model.get_base_model() if peft else model, engine.source_dir, torch.float32)
    side = [
        SideFile(CLIENT_STATE, buf.getvalue()),
        SideFile(ZEROFIT_CONFIG, json.dumps(engine.config.model_dump(mode="json"), indent=2).encode()),
    ] + hf
    schedule = engine.hypers.client  # [Note: a client scheduler drives the engine's lr]
    if schedule is not None:
        side.append(SideFile(LR_SCHEDULER, schedule.state_bytes(engine.hypers)))
    if peft:
        from zerofit.checkpoint.adapter_files import adapter_files

        side += [SideFile(n, data) for n, data in adapter_files(engine).items()]
    weights = weight_entries(engine, frozen=not exclude_frozen)
    state = {
        "frozen_excluded": bool(exclude_frozen and engine.frozen),
        "global_step": engine.global_step,
        "skipped_steps": engine.skipped_steps,
        "unit_steps": {u.name: int(u.step.item()) for u in engine.units if u.trains},
        "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "rng": rng.capture(engine.dev.device if engine.dev.is_cuda else None),
        "precision": engine.config.precision,
        "model_class": type(model).__name__,
        "model_dtype": dtype_name(engine.model_dtype),  # what zerofit export writes by default
        "parameters": {"tensors": len(weights), "numel": sum(e.numel for e in weights)},
        "placement": {
            "resident_blocks": engine.plan.resident_blocks,
            "shell_optimizer_on_device": engine.plan.shell_optimizer_on_device,
            "device": str(engine.dev.device),
        },
        "model_files": [f.name for f in hf],
        # [Note: speculative updates] (engine/update/speculation.py): whether the next step speculates depends on
        # whether the last one was clipped, and a speculated-then-redone update differs in rounding
        "speculate_next": engine.speculator.next,
        "param_groups": groups_record(engine),
        "window": window,
    }
    if peft:
        import zerofit.checkpoint.lora_base as base

        state["lora_base"] = base.record(engine)
    from zerofit.version import __version__

    state["zerofit_version"] = __version__
    content = Content(tag, weights, optimizer_entries(engine), side, state)
    t = time.perf_counter()
    with torch.profiler.record_function("zerofit::checkpoint.save"):
        # [Note: one writer per folder] (lock.py): the engine holds save_dir from now until it closes
        folder = write_checkpoint(
            save_dir, content, save_latest, max_shard_bytes, workers, holder=engine.lifecycle.resources
        )
    s = time.perf_counter() - t
    if engine.tier is not None:
        engine.tier.file.flush_mapping()  # the disk tier's pages read for the save leave memory
    nbytes = sum(f.stat().st_size for f in folder.iterdir())
    log.info("saved %s: %.1f MB in %.2f s (%.0f MB/s)", folder, nbytes / 1e6, s, nbytes / 1e6 / max(s, 1e-9))
    return folder


def load(
    engine, load_dir: Path | str, tag: str | None = None, load_optimizer_states: bool = True, workers: int = 4
) -> tuple[str | None, dict | None]:
    """Load a checkpoint into the engine; ``(path, client_state)``, or ``(None, None)`` with a warning when
    ``tag`` is None and ``load_dir`` has no ``latest``. See [Note: verify before copying] (load.py)."""
    _refuse_mid_step(engine, "load a checkpoint")
    ds_folder = deepspeed_format.find(load_dir, tag, COMMIT_RECORD)
    if ds_folder is not None:  # [Note: a DeepSpeed checkpoint into the units] (deepspeed_load.py)
        return deepspeed_load.load(engine, ds_folder, load_optimizer_states)
    opened = open_checkpoint(load_dir, tag)
    if opened is None:
        log.warning(
            "%s: no 'latest' file, so no checkpoint to load; training starts from the current state. "
            "Pass tag=... to load a specific one.",
            load_dir,
        )
        return None, None
    folder, record = opened
    st = record.state
    if st.get("lora_base") is not None:  # [Note: the base's fingerprint] (zerofit/checkpoint/lora_base.py)
        import zerofit.checkpoint.lora_base as base

        base.check(engine, st["lora_base"], folder)
    indexes = [WEIGHTS_INDEX] + ([OPTIMIZER_INDEX] if load_optimizer_states else [])
    if load_optimizer_states and record.file(OPTIMIZER_INDEX) is None:
        raise MissingFileError(
            folder / OPTIMIZER_INDEX, "this checkpoint has no optimizer state; load it with load_optimizer_states=False"
        )
    files = {ix: shard_files(folder, record, ix) for ix in indexes}
    side = [n for n in (CLIENT_STATE, ZEROFIT_CONFIG, LR_SCHEDULER) if record.file(n) is not None]
    verify(folder, record, [f for ix in indexes for f in [ix, *files[ix]]] + side, workers)
    trained = {
        p + n: (tuple(s), torch.float32)
        for u, p in named_units(engine)
        for n, s in zip(u.layout.names, u.layout.shapes)
    }
    with_frozen = not st.get("frozen_excluded", False)  # save_checkpoint(exclude_frozen_parameters=True)
    entries = weight_entries(engine, frozen=with_frozen)
    expected_w = {e.name: (e.shape, torch.float32) for e in entries}
    found = locate(folder, files[WEIGHTS_INDEX], WEIGHTS_INDEX)
    match(found, expected_w, folder, "weight")
    targets = {e.name: e.base[e.offset : e.offset + e.numel] for e in entries}
    if load_optimizer_states:
        opt = locate(folder, files[OPTIMIZER_INDEX], OPTIMIZER_INDEX)
        match(opt, {f"{n}.{m}": v for n, v in trained.items() for m in MOMENTS}, folder, "optimizer")
        targets.update({e.name: e.base[e.offset : e.offset + e.numel] for e in optimizer_entries(engine)})
        found = {**found, **opt}
        steps = unit_steps(engine, st["unit_steps"], folder)
    _check_scaler(engine, st.get("scaler"), folder)
    _warn_config_changes(engine, folder, st)
    _warn_partial_window(folder, st.get("window"))
    client_state = torch.load(io.BytesIO((folder / CLIENT_STATE).read_bytes()), weights_only=False)
    # nothing has been written into the engine so far; from here on a failure must not go unnoticed
    engine.wait()
    engine.dev.synchronize()
    try:
        with torch.profiler.record_function("zerofit::checkpoint.load"):
            copy_into(folder, record, found, targets, workers)
        if load_optimizer_states:
            for u in engine.units:
                if u.trains:
                    u.step.fill_(float(steps[u.name]))
        engine.weights_loaded()  # [Note: engine consistency after a load] (engine/memory/store.py)
    except BaseException as e:
        # [Note: a failed load fails the engine]: its weights are partly from the checkpoint; Engine.load_checkpoint
        # makes the engine FAILED (engine/lifecycle.py): every later call raises, naming this cause
        raise EngineStateLostError(
            f"loading {folder} failed after tensors were copied into the engine ({e}); its "
            "weights are partly from the checkpoint: build a new engine and load again"
        ) from e
    engine.global_step = int(st["global_step"])
    engine.skipped_steps = int(st["skipped_steps"])
    if st.get("speculate_next") is not None:
        engine.speculator.resume(bool(st["speculate_next"]))
    if engine.scaler is not None and st.get("scaler") is not None:
        engine.scaler.load_state_dict(st["scaler"])
    _restore_client_schedule(engine, folder, LR_SCHEDULER in side)
    rng.restore(st["rng"], engine.dev.device if engine.dev.is_cuda else None)
    return str(folder), client_state


def unit_steps(engine, saved: dict[str, int], folder: Path) -> dict[str, int]:
    """Each trained unit's AdamW step count from the checkpoint's. The units are the engine's cut of the model
    (blocks, or the whole model as one unit on the generic path: [Note: generic fallback], engine/recovery.py);
    when the checkpoint was cut otherwise, its parameters all took the same number of steps (every update steps
    every trained parameter), and that number is every unit's."""
    units = {u.name for u in engine.units if u.trains}
    if set(saved) == units:
        return dict(saved)
    counts = set(saved.values())
    if len(counts) != 1:
        raise CheckpointMismatchError(
            f"{folder}: optimizer step counts for units {sorted(saved)} differ "
            f"({sorted(counts)}), and this engine cuts the model into {sorted(units)}: load "
            "it into an engine built as the one that saved it (the same adapter and model)"
        )
    return dict.fromkeys(units, counts.pop())


def _restore_client_schedule(engine, folder: Path, saved: bool) -> None:
    schedule = engine.hypers.client
    if schedule is not None:
        schedule.restore((folder / LR_SCHEDULER).read_bytes() if saved else None, engine.global_step, str(folder))
    elif saved:
        log.warning(
            "%s: saved with a client lr_scheduler, loaded into an engine without one: its state is not used", folder
        )


def _warn_partial_window(folder: Path, window: dict | None) -> None:
    """[Note: a save in the middle of an accumulation window]: say what became of the saved window."""
    if not window:
        return
    n, G = window["micro_batches"], window["gradient_accumulation_steps"]
    pending = " (and a forward without its backward)" if window.get("forward_pending") else ""
    log.warning(
        "%s: the checkpoint was saved %d micro-batches into an accumulation window of %d%s; their "
        "gradients were not saved: the loaded engine starts a new window (the weights and optimizer state "
        "are those of the last optimizer step, as DeepSpeed saves them)",
        folder,
        n,
        G,
        pending,
    )


def _check_scaler(engine, saved: dict | None, folder: Path) -> None:
    if engine.scaler is None or saved is None:
        if (engine.scaler is None) != (saved is None):
            log.warning(
                "%s: saved with precision %s, loaded with %s: the fp16 loss scaler state is %s",
                folder,
                "fp16" if saved else "not fp16",
                engine.config.precision,
                "ignored" if saved else "fresh",
            )
        return
    kind = engine.scaler.state_dict()["kind"]
    if saved.get("kind") != kind:
        raise CheckpointMismatchError(
            f"{folder}: the checkpoint's fp16 loss scaler is {saved.get('kind')!r}, "
            f"this engine's is {kind!r} (fp16.loss_scale differs)"
        )


def groups_record(engine) -> list[dict] | None:
    """The engine's parameter groups as recorded in a checkpoint ([Note: parameter groups], engine/model/groups.py):
    None when there is one group with the config's optimizer values (no groups), else each group's
    parameter names and its resolved hyperparameters. Tensors are stored by name whatever the groups."""
    groups = getattr(engine, "param_groups", None)
    if not groups or (len(groups) == 1 and groups[0].optimizer == engine.config.optimizer):
        return None
    return [g.record() for g in groups]


def _warn_config_changes(engine, folder: Path, state: dict) -> None:
    path = folder / ZEROFIT_CONFIG
    if not path.is_file():
        return
    saved = json.loads(path.read_bytes())
    now = engine.config.model_dump(mode="json")
    changed = [k for k in RESUME_FIELDS if saved.get(k) != now.get(k)]
    if state.get("param_groups") != groups_record(engine):
        changed.append("param_groups")
    if changed:
        log.warning(
            "%s: saved with a different %s; the run continues with the new settings, so it will not "
            "match an uninterrupted one exactly",
            folder,
            ", ".join(changed),
        )
