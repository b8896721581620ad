"""A DeepSpeed ZeRO checkpoint into a zerofit engine: a run started on DeepSpeed continues on zerofit.

[Note: a DeepSpeed checkpoint into the units]
``engine.load_checkpoint(dir)`` on a folder DeepSpeed wrote (deepspeed_format.py reads it, [Note: DeepSpeed's
checkpoint layout]) fills the same things a zerofit checkpoint does, by the model's parameter names:

- each unit's ``master`` from DeepSpeed's fp32 partitions (not the 16-bit module weights), its ``exp_avg`` and
  ``exp_avg_sq`` from the Adam state of the same partitions, cut at the unit's layout offsets; tied weights
  through DeepSpeed's ``shared_params``;
- each unit's AdamW step from the step of the DeepSpeed optimizer group(s) its parameters were in (one
  value per unit, or refused);
- ``global_step`` (zerofit's count of applied steps, which the lr schedule is a function of) from the
  scheduler's position: DeepSpeed's ``lr_scheduler.last_batch_iteration + 1`` (its schedules step once per
  applied step: [Note: DeepSpeed's step offset], optim/schedules.py), else ``global_steps - skipped_steps``;
  ``skipped_steps`` from the checkpoint, so ``engine.global_steps`` is DeepSpeed's;
- the fp16 loss scaler's state (``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``);
- ``client_state``, returned as DeepSpeed returns it (every key of the model-states file but DeepSpeed's own).

DeepSpeed saves no random generator states: they go on from where they are. Nothing is written into the
engine before every name, shape, step count and the scaler's kind have been checked ([Note: verify before
copying], load.py): a checkpoint of another model (the differing names and shapes are listed) or one zerofit
cannot map leaves the engine as it was. A failure while copying fails the engine, as a zerofit load does.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from zerofit.checkpoint.deepspeed_format import DeepSpeedCheckpoint, ParamState, read
from zerofit.checkpoint.entries import RESUME_FIELDS, named_units
from zerofit.checkpoint.errors import CheckpointMismatchError, EngineStateLostError

log = logging.getLogger("zerofit")

_SHOWN = 6


def _names(names) -> str:
    names = list(names)
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def load(engine, folder: Path, load_optimizer_states: bool = True) -> tuple[str, dict]:
    """Load the DeepSpeed checkpoint ``folder`` into ``engine`` (see [Note: a DeepSpeed checkpoint into the
    units]); ``(path, client_state)`` as DeepSpeed's ``load_checkpoint`` returns them."""

    ck = read(folder, optimizer_states=load_optimizer_states)
    units = named_units(engine)
    sources = _match(engine, ck, units, load_optimizer_states)
    steps = _unit_steps(ck, units, sources) if load_optimizer_states else {}
    scaler = _scaler_state(engine, ck)
    global_step, skipped = _counters(engine, ck)
    _warn_differences(engine, ck, sources, global_step + skipped)
    client_state = ck.client_state(load_optimizer_states)
    engine.wait()
    engine.dev.synchronize()
    try:
        with torch.profiler.record_function("zerofit::checkpoint.load_deepspeed"):
            for u, prefix in units:
                for n, shape, off in zip(u.layout.names, u.layout.shapes, u.layout.offsets):
                    p, numel = sources[prefix + n], shape.numel()
                    p.master.copy_into(u.master[off : off + numel])
                    if load_optimizer_states:
                        p.exp_avg.copy_into(u.exp_avg[off : off + numel])
                        p.exp_avg_sq.copy_into(u.exp_avg_sq[off : off + numel])
                if load_optimizer_states:
                    u.step.fill_(float(steps[u.name]))
        engine.weights_loaded()  # [Note: engine consistency after a load] (engine/memory/store.py)
    except BaseException as e:
        # [Note: a failed load fails the engine] (state.py): Engine.load_checkpoint makes the engine FAILED
        raise EngineStateLostError(
            f"loading the DeepSpeed checkpoint {folder} failed after tensors were copied "
            f"into the engine ({e}); build a new engine and load again"
        ) from e
    engine.global_step, engine.skipped_steps = global_step, skipped
    if scaler is not None:
        engine.scaler.load_state_dict(scaler)
    log.info(
        "zerofit: loaded DeepSpeed %s checkpoint %s (ZeRO stage %s, %s, %d data-parallel rank(s)) at "
        "global step %d; DeepSpeed saves no random generator states, so they go on from their current state",
        ck.ds_version or "",
        folder,
        ck.stage,
        ck.precision,
        ck.dp_world_size,
        ck.global_steps,
    )
    return str(folder), client_state


def _match(engine, ck: DeepSpeedCheckpoint, units, with_moments: bool) -> dict[str, ParamState]:
    """Each of the engine's parameter names -> the checkpoint's parameter; refuses another model, naming the
    names and shapes that differ, and frozen-in-DeepSpeed parameters the engine trains (no moments)."""
    expected = {p + n: tuple(s) for u, p in units for n, s in zip(u.layout.names, u.layout.shapes)}
    sources, used, missing, shapes = {}, set(), [], []
    for name, shape in expected.items():
        stored = name if name in ck.params else ck.aliases.get(name)
        if stored is None:  # the engine's canonical name is stored under another name of the same tie
            stored = next((a for a, t in ck.aliases.items() if t == name and a in ck.params), None)
        if stored not in ck.params:
            missing.append(name)
            continue
        p = ck.params[stored]
        if stored in used:
            shapes.append(
                f"{name}: tied to {stored} in the checkpoint (shared_params), a parameter of its own in this model"
            )
            continue
        used.add(stored)
        if tuple(p.shape) != shape:
            shapes.append(f"{name}: {tuple(p.shape)} in the checkpoint, {shape} in this model")
        sources[name] = p
    extra = [n for n, p in ck.params.items() if n not in used and not p.frozen]
    if missing or extra or shapes:
        parts = (
            ([f"in this model but not in the checkpoint: {_names(missing)}"] if missing else [])
            + ([f"in the checkpoint but not in this model: {_names(extra)}"] if extra else [])
            + ([f"that differ: {_names(shapes)}"] if shapes else [])
        )
        raise CheckpointMismatchError(
            f"{ck.folder}: a DeepSpeed checkpoint of another model: parameters {'; '.join(parts)}. Build the engine "
            "from the model the checkpoint was trained with (the same class and config, the same parameter names: "
            "a wrapper such as PEFT's adds prefixes), or read the weights with DeepSpeed's zero_to_fp32.py and "
            "load them into the model by name yourself"
        )
    trained_frozen = [n for n, p in sources.items() if p.frozen]
    if trained_frozen and with_moments:
        raise CheckpointMismatchError(
            f"{ck.folder}: DeepSpeed did not train {_names(trained_frozen)} (frozen there: no optimizer state), "
            "this engine trains them. Freeze them in the model too, or load the weights only "
            "(load_optimizer_states=False: their moments start from zero)"
        )
    untrained = [n for n, p in ck.params.items() if p.frozen and n not in used]
    if untrained:
        _check_frozen(engine, ck, untrained)
    _check_buffers(engine, ck)
    return sources


def _check_buffers(engine, ck: DeepSpeedCheckpoint) -> None:
    """Persistent buffers are the model's, as with zerofit's own checkpoints: say so when DeepSpeed's differ."""
    module = ck.model_states.get("module") or {}
    own = dict(engine.adapter.model.named_buffers())
    differ = [
        n
        for n in ck.model_states.get("buffer_names") or ()
        if n in module
        and (
            n not in own
            or own[n].shape != module[n].shape
            or not torch.equal(own[n].detach().cpu().to(module[n].dtype), module[n])
        )
    ]
    if differ:
        log.warning(
            "zerofit: %s: the model's buffers %s differ from those DeepSpeed saved; zerofit keeps the "
            "model's own buffers (its checkpoints hold parameters only)",
            ck.folder,
            _names(differ),
        )


def _check_frozen(engine, ck: DeepSpeedCheckpoint, names: list[str]) -> None:
    """Parameters DeepSpeed froze and this engine does not train: the model keeps its own values; say so
    when they differ from the checkpoint's."""
    own = dict(engine.adapter.model.named_parameters(remove_duplicate=False))
    differ = [
        n
        for n in names
        if n not in own
        or tuple(own[n].shape) != tuple(ck.params[n].shape)
        or not torch.equal(own[n].detach().float().cpu().reshape(-1), ck.params[n].master.tensor())
    ]
    if differ:
        log.warning(
            "zerofit: %s: DeepSpeed's frozen parameters %s differ from this model's (or it has none of that "
            "name and shape); zerofit keeps the model's own values for parameters it does not train",
            ck.folder,
            _names(differ),
        )


def _unit_steps(ck: DeepSpeedCheckpoint, units, sources: dict[str, ParamState]) -> dict[str, int]:
    applied = ck.global_steps - ck.skipped_steps
    out = {}
    for u, prefix in units:
        found = {sources[prefix + n].step for n in u.layout.names}
        if None in found:
            log.warning(
                "zerofit: %s: no AdamW step count saved for %s: it takes the count of applied steps, %d",
                ck.folder,
                u.name,
                applied,
            )
            found = (found - {None}) | {applied}
        if len(found) > 1:
            raise CheckpointMismatchError(
                f"{ck.folder}: the parameters of {u.name} were in DeepSpeed optimizer groups with different AdamW "
                f"step counts ({sorted(found)}); zerofit keeps one step count per block. Load the weights only "
                "(load_optimizer_states=False)"
            )
        out[u.name] = found.pop() if found else applied
    return out


def _counters(engine, ck: DeepSpeedCheckpoint) -> tuple[int, int]:
    """(global_step, skipped_steps) for the engine: the lr schedule's position and DeepSpeed's skipped steps."""
    applied = ck.global_steps - ck.skipped_steps
    sched = ck.lr_scheduler if isinstance(ck.lr_scheduler, dict) else {}
    if "last_batch_iteration" in sched:  # DeepSpeed's schedules: -1 before the first step
        position = int(sched["last_batch_iteration"]) + 1
    elif "last_epoch" in sched:  # a torch scheduler: stepped once per applied step
        position = int(sched["last_epoch"])
    else:
        return applied, ck.skipped_steps
    if position != applied:
        log.warning(
            "zerofit: %s: the lr scheduler's position (%d steps) is not DeepSpeed's count of applied steps "
            "(global_steps %d - skipped_steps %d = %d); the schedule goes on from the scheduler's position, "
            "as it would in DeepSpeed",
            ck.folder,
            position,
            ck.global_steps,
            ck.skipped_steps,
            applied,
        )
    return position, max(ck.global_steps - position, 0)


def _scaler_state(engine, ck: DeepSpeedCheckpoint) -> dict | None:
    """The engine's loss scaler state from DeepSpeed's, or None (nothing to load: warned when one side is fp16)."""
    saved = ck.loss_scaler if ck.precision == "fp16" else None
    if engine.scaler is None or saved is None:
        if (engine.scaler is None) != (saved is None):
            log.warning(
                "zerofit: %s: saved by DeepSpeed in %s, loaded with precision %s: the fp16 loss scaler state is %s",
                ck.folder,
                ck.precision,
                engine.config.precision,
                "ignored" if saved else "fresh",
            )
        return None
    kind = engine.scaler.state_dict()["kind"]
    theirs = "dynamic" if saved.get("dynamic") else "static"
    if kind != theirs:
        raise CheckpointMismatchError(
            f"{ck.folder}: DeepSpeed's fp16 loss scaler is {theirs}, this engine's is "
            f"{kind} (fp16.loss_scale differs: 0 is dynamic)"
        )
    if kind == "static":
        return {
            "kind": "static",
            "cur_scale": float(saved["cur_scale"]),
            "cur_iter": ck.global_steps,
            "skipped_steps": ck.skipped_steps,
        }
    mine = vars(engine.scaler)
    differ = [
        k
        for k in ("scale_window", "min_scale", "delayed_shift", "consecutive_hysteresis")
        if k in saved and saved[k] != mine.get(k)
    ]
    if differ:
        log.warning(
            "zerofit: %s: DeepSpeed's loss scaler had %s; this engine's config says %s",
            ck.folder,
            ", ".join(f"{k}={saved[k]}" for k in differ),
            ", ".join(f"{k}={mine.get(k)}" for k in differ),
        )
    return {
        "kind": "dynamic",
        "cur_scale": float(saved["cur_scale"]),
        "cur_iter": int(saved["cur_iter"]),
        "last_overflow_iter": int(saved["last_overflow_iter"]),
        "cur_hysteresis": int(saved.get("cur_hysteresis", mine["cur_hysteresis"])),
        "skipped_steps": ck.skipped_steps,
    }


def _warn_differences(engine, ck: DeepSpeedCheckpoint, sources: dict[str, ParamState], global_steps: int) -> None:
    """Warn where the engine's settings differ from the run that saved (changes can be intended)."""

    if ck.ds_config is not None:
        from zerofit.config import ConfigError
        from zerofit.config.deepspeed import from_deepspeed

        try:
            saved = from_deepspeed(ck.ds_config, world_size=ck.dp_world_size)[0].model_dump(mode="json")
        except (ConfigError, ValueError, TypeError) as e:
            log.info(
                "zerofit: %s: the DeepSpeed config saved with it does not read as a zerofit config (%s); "
                "settings not compared",
                ck.folder,
                e,
            )
        else:
            now = engine.config.model_dump(mode="json")
            changed = [k for k in RESUME_FIELDS if saved.get(k) != now.get(k)]
            if changed == ["gradient_accumulation_steps"] and saved["train_batch_size"] == now["train_batch_size"]:
                changed = []  # several ranks' micro-batches as one process's window: the same batch
                log.info(
                    "zerofit: %s: saved by %d data-parallel ranks with %d micro-batches each, loaded in %d "
                    "process(es) with %d: the same batch of %d samples a step",
                    ck.folder,
                    ck.dp_world_size,
                    saved["gradient_accumulation_steps"],
                    now["world_size"],
                    now["gradient_accumulation_steps"],
                    now["train_batch_size"],
                )
            if changed:
                log.warning(
                    "zerofit: %s: saved by DeepSpeed with a different %s; the run continues with this "
                    "engine's settings, so it will not match DeepSpeed going on",
                    ck.folder,
                    ", ".join(changed),
                )
    group_of = {n: g.optimizer for g in getattr(engine, "param_groups", ()) for n in g.names}
    differ = []
    for name, p in sources.items():
        if p.group is None or p.group >= len(ck.groups) or name not in group_of:
            continue
        theirs, mine = ck.groups[p.group], group_of[name]
        if ("betas" in theirs and tuple(map(float, theirs["betas"])) != tuple(mine.betas)) or any(
            k in theirs and float(theirs[k]) != float(getattr(mine, k)) for k in ("eps", "weight_decay")
        ):
            differ.append(name)
    if differ:
        log.warning(
            "zerofit: %s: DeepSpeed trained %s with other AdamW betas, eps or weight_decay than this engine's "
            "parameter groups give them; they continue with this engine's",
            ck.folder,
            _names(differ),
        )
    samples = global_steps * engine.config.train_batch_size
    if ck.global_samples is not None and ck.global_samples != samples:
        log.info(
            "zerofit: %s: DeepSpeed's global_samples is %d; zerofit counts global_steps x train_batch_size (%d)",
            ck.folder,
            ck.global_samples,
            samples,
        )
