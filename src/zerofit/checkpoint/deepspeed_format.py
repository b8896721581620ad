"""Reading a DeepSpeed ZeRO checkpoint folder (stages 1, 2 and 3, and DeepSpeed's "universal" layout) as
per-parameter tensors, without DeepSpeed installed and without gathering a state dict.

[Note: DeepSpeed's checkpoint layout]
What ``DeepSpeedEngine.save_checkpoint(save_dir, tag)`` writes (DeepSpeed 0.19.8: runtime/engine.py,
runtime/zero/stage_1_and_2.py and stage3.py ``state_dict()``, utils/zero_to_fp32.py, checkpoint/constants.py)::

    save_dir/latest                                          the tag
    save_dir/<tag>/mp_rank_00_model_states.pt                stages 1-2 (stage 3: one per data-parallel rank,
                                                             zero_pp_rank_<r>_mp_rank_00_model_states.pt)
    save_dir/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   one per data-parallel rank r

The model-states file (a pickle) holds ``module`` (the 16-bit weights; empty tensors under stage 3),
``param_shapes`` (per optimizer group, the parameters' names and shapes *in the order of the flat fp32
partitions*), ``shared_params`` (tied names: alias -> stored name), ``frozen_param_shapes`` /
``frozen_param_fragments``, ``buffer_names``, ``lr_scheduler`` (DeepSpeed's schedules:
``{"last_batch_iteration": n}``), ``global_steps``, ``global_samples``, ``skipped_steps``, ``dp_world_size``,
``mp_world_size``, ``ds_config``, ``ds_version``, and every key of the user's ``client_state`` beside them.

Each rank's optimizer file holds ``optimizer_state_dict``:

- stages 1 and 2: ``single_partition_of_fp32_groups[g]`` (rank r's slice of group g's flat fp32 master,
  its alignment padding removed), ``base_optimizer_state`` (the torch optimizer's state dict over those
  flat partitions: ``state[g] = {step, exp_avg, exp_avg_sq}``, the last rank's moments still padded; or,
  with ``elastic_checkpoint``, a list of per-group states without padding and ``base_optimizer_state_step``),
  ``param_alignment_paddings[g][i]`` (numel after parameter i inside the flat group), ``group_paddings``,
  ``partition_count``, ``loss_scaler`` (a pickled DeepSpeed object), ``zero_stage``. The ranks' slices,
  concatenated in rank order, are the flat group: parameter i of group g starts where the numels and paddings
  of the parameters before it end (zero_to_fp32's ``_zero2_merge_trainable_params``).
- stage 3: ``fp32_flat_groups[s]`` (rank r's flat fp32 of sub-group s), ``optimizer_state_dict`` (the torch
  optimizer's state over the sub-groups), ``loss_scaler``, ``partition_count``. Every parameter is split
  over the ranks in ``ceil(numel / world)`` pieces (the last padded): rank r's flat is, parameter after
  parameter in ``param_shapes`` order, each parameter's r-th piece (``_zero3_merge_trainable_params``).

The "universal" layout (checkpoint/ds_to_universal.py) is per parameter already:
``<folder>/zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` (each ``{"param": tensor, ...}``), beside the
copied model-states file(s); ``latest_universal`` names the folder.

A :class:`Gathered` is one parameter's tensor as views of the ranks' pieces: it is copied piece by piece
into its destination, never concatenated. Every file is opened with ``mmap``, so only what is
copied is read. Files are unpickled with DeepSpeed's own classes replaced by :class:`DeepSpeedObject`
(their attributes kept), so neither DeepSpeed nor its accelerator set-up is needed to read them; like
DeepSpeed's own ``torch.load(weights_only=False)``, any other class a ``client_state`` holds is imported:
load only checkpoints you trust.
"""

from __future__ import annotations

import math
import pickle
import re
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerofit.checkpoint.errors import CheckpointError

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
MOMENTS = ("exp_avg", "exp_avg_sq")
_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_RE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
_EXPERT_RE = re.compile(r"^(?:layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$|^expp_rank_\d+_.*optim_states\.pt$")
_PIPE_RE = re.compile(r"^layer_\d+-model_.*\.pt$")
# the keys DeepSpeed's load_checkpoint keeps for itself; every other key of the model-states file comes back
# as client_state (runtime/engine.py, _load_checkpoint: deepspeed_states)
_DS_STATES = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler", "random_ltd")


class DeepSpeedCheckpointError(CheckpointError):
    """A DeepSpeed checkpoint zerofit cannot read or map (the message names what and says what to do)."""


# ---------------------------------------------------------------------------------------------- unpickling


class DeepSpeedObject:
    """Stands in for a DeepSpeed class in a checkpoint's pickle: its qualified name in ``ds_class``, its
    constructor arguments in ``ds_args`` and its attributes as attributes (``vars()``)."""

    ds_class = "deepspeed"

    def __init__(self, *args, **kwargs):
        self.ds_args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.ds_state = state

    def __repr__(self):
        return f"<{self.ds_class} {self.ds_args or ''}{ {k: v for k, v in vars(self).items() if k != 'ds_args'} }>"


_STUBS: dict[str, type] = {}


def _stub(module: str, name: str) -> type:
    key = f"{module}.{name}"
    if key not in _STUBS:
        _STUBS[key] = type(name, (DeepSpeedObject,), {"ds_class": key})
    return _STUBS[key]


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "deepspeed" or module.startswith("deepspeed."):
            return _stub(module, name)
        return super().find_class(module, name)


_pickle = types.ModuleType("zerofit_deepspeed_pickle")
_pickle.Unpickler = _Unpickler
_pickle.load = lambda f, **kw: _Unpickler(f, **kw).load()
_pickle.__dict__.update({k: getattr(pickle, k) for k in ("dump", "dumps", "loads", "HIGHEST_PROTOCOL")})


def load_pickle(path: Path):
    """A DeepSpeed ``.pt`` file, DeepSpeed's classes as :class:`DeepSpeedObject` s, its tensors memory-mapped
    (read when copied; a file of torch's legacy format is read whole)."""
    try:
        try:
            return torch.load(path, map_location="cpu", pickle_module=_pickle, weights_only=False, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(path, map_location="cpu", pickle_module=_pickle, weights_only=False)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as e:
        raise DeepSpeedCheckpointError(
            f"{path}: not readable as a DeepSpeed checkpoint file ({e}); a save that "
            "did not finish, or a damaged copy: load another tag"
        ) from None


def _int(x) -> int:
    return int(x.ds_args[0]) if isinstance(x, DeepSpeedObject) else int(x)


# ---------------------------------------------------------------------------------------------- the result


@dataclass(frozen=True)
class Gathered:
    """One parameter's values in one kind (master or a moment): ``numel`` elements taken from ``pieces``
    (flat source tensor, start) in order, the pieces' lengths in ``lengths``."""

    pieces: tuple[tuple[torch.Tensor, int], ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.lengths)

    def copy_into(self, dst: torch.Tensor) -> None:
        """Into the flat ``dst`` (its numel, any device, float32)."""
        pos = 0
        for (src, start), n in zip(self.pieces, self.lengths):
            dst[pos : pos + n].copy_(src[start : start + n])
            pos += n

    def tensor(self) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=torch.float32)
        self.copy_into(out)
        return out


@dataclass
class ParamState:
    """A trained parameter: fp32 master, Adam moments (None for a frozen one, or without optimizer state),
    AdamW step count, and the index of its optimizer group in ``DeepSpeedCheckpoint.groups``."""

    name: str
    shape: torch.Size
    master: Gathered
    exp_avg: Gathered | None = None
    exp_avg_sq: Gathered | None = None
    step: int | None = None
    group: int | None = None
    frozen: bool = False


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint folder, read (see [Note: DeepSpeed's checkpoint layout])."""

    folder: Path
    stage: int | str  # 1, 2, 3, or "universal"
    precision: str  # "fp32", "bf16", "fp16"
    dp_world_size: int
    params: dict[str, ParamState]  # in DeepSpeed's order
    aliases: dict[str, str]  # tied weights: alias -> the name stored
    groups: list[dict]  # each optimizer group's lr, betas, eps, weight_decay (as saved)
    global_steps: int
    global_samples: int | None
    skipped_steps: int
    lr_scheduler: dict | None
    loss_scaler: dict | None  # the loss scaler's attributes ("dynamic", "cur_scale", ...)
    ds_config: dict | None
    ds_version: str | None
    model_states: dict = field(repr=False, default_factory=dict)

    def client_state(self, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True) -> dict:
        """What DeepSpeed's ``load_checkpoint`` returns as ``client_state``: every key of the model-states file
        but those it keeps for itself (so the user's keys, and ``param_shapes``, ``ds_config``... beside them)."""
        own = (
            list(_DS_STATES)
            + (["lr_scheduler"] if load_lr_scheduler_states else [])
            + (["optimizer"] if load_optimizer_states else [])
        )
        return {k: v for k, v in self.model_states.items() if k not in own}


# ---------------------------------------------------------------------------------------------- finding


def find(load_dir: Path | str, tag: str | None, record_name: str) -> Path | None:
    """The DeepSpeed checkpoint folder ``load_checkpoint(load_dir, tag)`` means, or None when it is not one
    (a zerofit checkpoint: one with ``record_name``; or nothing there: zerofit's loader says so)."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir() or (load_dir / record_name).is_file():
        return None
    if tag is None:
        if _looks_deepspeed(load_dir):
            return load_dir
        for pointer in (LATEST, LATEST_UNIVERSAL):
            path = load_dir / pointer
            if path.is_file():
                try:
                    tag = path.read_bytes().decode("utf-8").strip()
                except UnicodeDecodeError:
                    return None  # not DeepSpeed's pointer: zerofit's loader names the damaged file
                break
        else:
            return None
    folder = load_dir / str(tag)
    if "/" in str(tag) or not folder.is_dir() or (folder / record_name).is_file():
        return None
    return folder if _looks_deepspeed(folder) else None


def _looks_deepspeed(folder: Path) -> bool:
    return any(
        p.name.endswith("_model_states.pt") or p.name.endswith("optim_states.pt") or _PIPE_RE.match(p.name)
        for p in folder.iterdir()
        if p.is_file()
    )


# ---------------------------------------------------------------------------------------------- reading


def read(folder: Path | str, optimizer_states: bool = True) -> DeepSpeedCheckpoint:
    """Read ``folder`` (a DeepSpeed tag folder) into per-parameter tensors; refuses by name what zerofit
    cannot map (several model-parallel ranks, pipeline and mixture-of-experts checkpoints, stage 0, another
    optimizer than Adam/AdamW, optimizer state left on NVMe). ``optimizer_states=False``: masters only."""
    folder = Path(folder)
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    _refuse_layouts(folder, names)
    models = {m: _MODEL_RE.match(m) for m in names if _MODEL_RE.match(m)}
    if not models:
        raise DeepSpeedCheckpointError(
            f"{folder}: no mp_rank_00_model_states.pt (or zero_pp_rank_0_mp_rank_00_"
            "model_states.pt): not a complete DeepSpeed checkpoint; load another tag"
        )
    mp_ranks = sorted({int(m.group(2)) for m in models.values()})
    if mp_ranks != [0]:
        raise DeepSpeedCheckpointError(
            f"{folder}: written by {len(mp_ranks)} model-parallel (tensor-parallel) ranks (mp_rank "
            f"{', '.join(f'{r:02d}' for r in mp_ranks)}); zerofit reads checkpoints of one model-parallel rank, with "
            "whole tensors. Convert it first with DeepSpeed's ds_to_universal.py (it merges the ranks' slices), "
            "then load the universal folder"
        )
    first = next(m for m in names if m in models and (models[m].group(1) in (None, "0")))
    states = load_pickle(folder / first)
    _refuse_states(folder / first, states)
    if (folder / "zero").is_dir():
        return _read_universal(folder, states, optimizer_states)
    return _read_zero(folder, names, states, optimizer_states)


def _refuse_layouts(folder: Path, names: list[str]) -> None:
    experts = [n for n in names if _EXPERT_RE.match(n)]
    if experts:
        raise DeepSpeedCheckpointError(
            f"{folder}: a mixture-of-experts checkpoint ({experts[0]}, {len(experts)} expert files); zerofit has no "
            "expert layers of its own and cannot map DeepSpeed's expert-parallel state. Export the model with "
            "DeepSpeed (zero_to_fp32.py) and start from its weights"
        )
    pipe = [n for n in names if _PIPE_RE.match(n)]
    if pipe:
        raise DeepSpeedCheckpointError(
            f"{folder}: a pipeline-parallel checkpoint (layer files such as {pipe[0]}); its parameters are named by "
            "pipeline layer, not by the model's own names. Convert it with DeepSpeed's ds_to_universal.py, or "
            "export the model's weights from DeepSpeed and start from them"
        )
    if (folder / "offloaded_tensors").is_dir():
        raise DeepSpeedCheckpointError(
            f"{folder}: the optimizer state was offloaded to NVMe (offloaded_tensors/): its files are DeepSpeed's "
            "swap format. Load it in DeepSpeed and save again with offload_optimizer on 'cpu' or 'none', then "
            "load that checkpoint"
        )


def _refuse_states(path: Path, states) -> None:
    if not isinstance(states, dict) or "module" not in states:
        raise DeepSpeedCheckpointError(f"{path}: not a DeepSpeed model-states file (no 'module' key)")
    if states.get("module") is None:
        raise DeepSpeedCheckpointError(
            f"{path}: 'module' is None: a pipeline-parallel checkpoint (its weights are "
            "in per-layer files); convert it with DeepSpeed's ds_to_universal.py"
        )
    if int(states.get("mp_world_size", 1) or 1) > 1:
        raise DeepSpeedCheckpointError(
            f"{path}: mp_world_size {states['mp_world_size']}: several model-parallel "
            "ranks; convert it with DeepSpeed's ds_to_universal.py first"
        )
    if "num_experts" in states or states.get("ds_autoep_layers") or states.get("autoep_layers"):
        raise DeepSpeedCheckpointError(
            f"{path}: a mixture-of-experts model (num_experts / AutoEP layers); zerofit "
            "cannot map expert-parallel state"
        )
    if states.get("param_shapes") is None:
        raise DeepSpeedCheckpointError(
            f"{path}: no param_shapes: saved without ZeRO (zero_optimization.stage 0), whose optimizer state "
            "names parameters by position only. zerofit reads ZeRO stages 1-3: save with stage 1 or more, or "
            "start from the weights (engine.load_checkpoint(dir, load_optimizer_states=False) reads them from "
            "a ZeRO checkpoint)"
        )


def _common(
    folder: Path, states: dict, stage, precision: str, dp: int, params: dict, groups: list[dict], scaler: dict | None
) -> DeepSpeedCheckpoint:
    config = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else None
    return DeepSpeedCheckpoint(
        folder=folder,
        stage=stage,
        precision=precision,
        dp_world_size=dp,
        params=params,
        aliases=dict(states.get("shared_params") or {}),
        groups=groups,
        global_steps=int(states.get("global_steps", 0)),
        global_samples=None if states.get("global_samples") is None else int(states["global_samples"]),
        skipped_steps=int(states.get("skipped_steps", 0)),
        lr_scheduler=states.get("lr_scheduler"),
        loss_scaler=scaler,
        ds_config=config,
        ds_version=states.get("ds_version"),
        model_states=states,
    )


def _precision(states: dict, bf16_files: bool) -> str:
    config = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {}
    for key in ("bf16", "bfloat16", "fp16"):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return "fp16" if key == "fp16" else "bf16"
    if bf16_files:
        return "bf16"
    dtypes = {v.dtype for v in (states.get("module") or {}).values() if isinstance(v, torch.Tensor)}
    return "fp16" if torch.float16 in dtypes else "bf16" if torch.bfloat16 in dtypes else "fp32"


def _optim_files(folder: Path, names: list[str], dp: int) -> tuple[list[Path], bool]:
    found = {}
    for n in names:
        m = _OPTIM_RE.match(n)
        if m and int(m.group(3)) == 0:
            found.setdefault(int(m.group(2)), []).append((m.group(1) == "bf16_", n))
    ranks = sorted(found)
    if ranks != list(range(dp)):
        raise DeepSpeedCheckpointError(
            f"{folder}: expected the optimizer files of {dp} data-parallel rank(s) (zero_pp_rank_0..{dp - 1}_"
            f"mp_rank_00_optim_states.pt, dp_world_size {dp} in the model states), found ranks {ranks or 'none'}: "
            "a save that did not finish on every rank, or files overwritten by another run; load another tag"
        )
    files = []
    for r in ranks:
        if len(found[r]) > 1:
            raise DeepSpeedCheckpointError(
                f"{folder}: rank {r} has several optimizer files ({[n for _, n in found[r]]})"
            )
        files.append(folder / found[r][0][1])
    return files, found[0][0][0]


def _scaler(osd: dict) -> dict | None:
    s = osd.get("loss_scaler")
    if s is None:
        return None
    out = (
        {k: v for k, v in vars(s).items() if k != "ds_args"}
        if isinstance(s, DeepSpeedObject)
        else (dict(s) if isinstance(s, dict) else {"cur_scale": float(s)})
    )
    out.setdefault("dynamic", bool(osd.get("dynamic_loss_scale", False)))
    return out


def _hypers(group: dict) -> dict:
    return {
        k: (tuple(group[k]) if k == "betas" else group[k]) for k in ("lr", "betas", "eps", "weight_decay") if k in group
    }


def _adam_state(path: Path, state, index: int, what: str) -> dict:
    s = state.get(index) if isinstance(state, dict) else state[index] if index < len(state) else None
    if s is None:
        raise DeepSpeedCheckpointError(
            f"{path}: no optimizer state for {what}: the checkpoint was saved before the "
            "first optimizer step, or without one; load it with "
            "load_optimizer_states=False"
        )
    missing = [m for m in MOMENTS if m not in s]
    if missing:
        raise DeepSpeedCheckpointError(
            f"{path}: the optimizer state of {what} has {sorted(s)}, not Adam's exp_avg and exp_avg_sq: another "
            "optimizer than Adam/AdamW; zerofit trains with AdamW. Load the weights only "
            "(load_optimizer_states=False)"
        )
    return s


def _read_zero(folder: Path, names: list[str], states: dict, optimizer_states: bool) -> DeepSpeedCheckpoint:
    dp = int(states.get("dp_world_size", 1) or 1)
    files, bf16_files = _optim_files(folder, names, dp)
    osds = []
    for f in files:
        sd = load_pickle(f)
        osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
        if not isinstance(osd, dict) or "zero_stage" not in osd:
            raise DeepSpeedCheckpointError(f"{f}: not a ZeRO optimizer file (no optimizer_state_dict.zero_stage)")
        osds.append(osd)
    stage = _int(osds[0]["zero_stage"])
    shapes = [dict(g) for g in states["param_shapes"]]
    if stage in (1, 2):
        params, groups = _zero12(folder, files, osds, shapes, dp, optimizer_states)
    elif stage == 3:
        params, groups = _zero3(folder, files, osds, shapes, dp, optimizer_states)
    else:
        raise DeepSpeedCheckpointError(f"{files[0]}: zero_stage {stage}; zerofit reads stages 1, 2 and 3")
    _frozen(folder, states, params, dp, stage, files)
    return _common(folder, states, stage, _precision(states, bf16_files), dp, params, groups, _scaler(osds[0]))


def _zero12(folder, files, osds, shapes, dp, optimizer_states):
    fp32 = [o["single_partition_of_fp32_groups"] for o in osds]
    paddings = osds[0].get("param_alignment_paddings")
    base = [o.get("base_optimizer_state") for o in osds]
    elastic = isinstance(base[0], list)
    groups = []
    if not elastic and isinstance(base[0], dict):
        groups = [_hypers(g) for g in base[0].get("param_groups", [])]
    params: dict[str, ParamState] = {}
    for g, group_shapes in enumerate(shapes):
        sizes = [int(fp32[r][g].numel()) for r in range(dp)]
        bounds = [sum(sizes[:r]) for r in range(dp + 1)]  # rank r holds [bounds[r], bounds[r+1]) of the group
        srcs = {"master": [fp32[r][g] for r in range(dp)]}
        step = None
        if optimizer_states:
            for r in range(dp):
                s = _adam_state(files[r], base[r] if elastic else base[r]["state"], g, f"parameter group {g}")
                for m in MOMENTS:
                    if s[m].numel() < sizes[r]:
                        raise DeepSpeedCheckpointError(
                            f"{files[r]}: group {g}'s {m} has {s[m].numel()} elements, its fp32 partition {sizes[r]}"
                        )
                    srcs.setdefault(m, []).append(s[m].reshape(-1))
                if r == 0:
                    step = s.get("step", osds[0].get("base_optimizer_state_step"))
        offset = 0
        pads = paddings[g] if paddings is not None else None
        if pads is not None and len(pads) != len(group_shapes):
            raise DeepSpeedCheckpointError(
                f"{files[0]}: {len(pads)} alignment paddings for group {g}'s {len(group_shapes)} parameters"
            )
        for i, (name, shape) in enumerate(group_shapes.items()):
            n = math.prod(shape)
            if offset + n > bounds[-1]:
                raise DeepSpeedCheckpointError(
                    f"{files[0]}: group {g} holds {bounds[-1]} elements, parameter "
                    f"{name} {tuple(shape)} would end at {offset + n}"
                )
            cut = {k: _span(v, bounds, offset, n) for k, v in srcs.items()}
            params[name] = ParamState(
                name,
                torch.Size(shape),
                cut["master"],
                cut.get("exp_avg"),
                cut.get("exp_avg_sq"),
                None if step is None else _int_step(step),
                g,
            )
            offset += n + (int(pads[i]) if pads is not None else 0)
        align = 2 * dp  # zero_to_fp32's check: what is left is DeepSpeed's alignment padding only
        if math.ceil(offset / align) * align != math.ceil(bounds[-1] / align) * align:
            raise DeepSpeedCheckpointError(
                f"{files[0]}: group {g}'s parameters take {offset} elements, its fp32 "
                f"partitions {bounds[-1]}: param_shapes do not describe these partitions"
            )
    return params, groups


def _span(srcs: list[torch.Tensor], bounds: list[int], offset: int, n: int) -> Gathered:
    """Elements [offset, offset + n) of the ranks' partitions laid end to end (rank r from bounds[r])."""
    pieces, lengths = [], []
    for r, src in enumerate(srcs):
        lo, hi = max(offset, bounds[r]), min(offset + n, bounds[r + 1])
        if lo < hi:
            pieces.append((src, lo - bounds[r]))
            lengths.append(hi - lo)
    return Gathered(tuple(pieces), tuple(lengths))


def _int_step(step) -> int:
    value = float(step.item() if isinstance(step, torch.Tensor) else step)
    if value != int(value):
        raise DeepSpeedCheckpointError(f"an AdamW step count of {value}")
    return int(value)


def _zero3(folder, files, osds, shapes, dp, optimizer_states):
    flats = [list(o["fp32_flat_groups"]) for o in osds]
    torch_state = [o.get("optimizer_state_dict") or {} for o in osds]
    groups = [_hypers(g) for g in torch_state[0].get("param_groups", [])]
    sub_group = {}  # sub-group index -> its optimizer group
    for gi, g in enumerate(torch_state[0].get("param_groups", [])):
        for s in g.get("params", []):
            sub_group[int(s)] = gi
    sizes = [int(t.numel()) for t in flats[0]]
    for r in range(1, dp):
        if [int(t.numel()) for t in flats[r]] != sizes:
            raise DeepSpeedCheckpointError(f"{files[r]}: its fp32 sub-groups differ in size from rank 0's")
    starts = [sum(sizes[:s]) for s in range(len(sizes) + 1)]
    per_rank = {"master": flats}
    steps = {}
    if optimizer_states:
        for r in range(dp):
            for s in range(len(sizes)):
                st = _adam_state(files[r], torch_state[r].get("state", {}), s, f"sub-group {s}")
                for m in MOMENTS:
                    if st[m].numel() != sizes[s]:
                        raise DeepSpeedCheckpointError(
                            f"{files[r]}: sub-group {s}'s {m} has {st[m].numel()} elements, its fp32 flat {sizes[s]}"
                        )
                    per_rank.setdefault(m, [[] for _ in range(dp)])[r].append(st[m].reshape(-1))
                if r == 0:
                    steps[s] = _int_step(st["step"]) if "step" in st else None
    params: dict[str, ParamState] = {}
    offset = 0
    for name, shape in ((n, s) for g in shapes for n, s in g.items()):
        numel = math.prod(shape)
        part = math.ceil(numel / dp)
        s = next((i for i in range(len(sizes)) if starts[i] <= offset < starts[i + 1]), None)
        if s is None or offset + part > starts[s + 1]:
            raise DeepSpeedCheckpointError(
                f"{files[0]}: parameter {name} {tuple(shape)} does not fit the fp32 "
                f"sub-groups ({sizes}): param_shapes do not describe these partitions"
            )
        cut = {}
        for kind, ranks in per_rank.items():
            pieces, lengths, left = [], [], numel
            for r in range(dp):
                k = min(part, left)
                if k > 0:
                    pieces.append((ranks[r][s], offset - starts[s]))
                    lengths.append(k)
                left -= k
            cut[kind] = Gathered(tuple(pieces), tuple(lengths))
        params[name] = ParamState(
            name,
            torch.Size(shape),
            cut["master"],
            cut.get("exp_avg"),
            cut.get("exp_avg_sq"),
            steps.get(s),
            sub_group.get(s),
        )
        offset += part
    if offset != starts[-1]:
        raise DeepSpeedCheckpointError(
            f"{files[0]}: the parameters take {offset} elements per rank, the fp32 "
            f"sub-groups {starts[-1]}: param_shapes do not describe these partitions"
        )
    return params, groups


def _frozen(folder: Path, states: dict, params: dict, dp: int, stage: int, files) -> None:
    """Parameters DeepSpeed did not train (no optimizer state): their saved values, as frozen entries."""
    frozen = states.get("frozen_param_shapes") or {}
    if not frozen:
        return
    if stage == 3:
        rank_states = [states] + [
            load_pickle(folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(1, dp)
        ]
    else:
        rank_states = [states]
    for name, shape in frozen.items():
        frags = [s["frozen_param_fragments"][name].reshape(-1).float() for s in rank_states]
        numel = math.prod(shape)
        lengths, left, pieces = [], numel, []
        for t in frags:
            k = min(t.numel(), left)
            if k > 0:
                pieces.append((t, 0))
                lengths.append(k)
            left -= k
        if left:
            raise DeepSpeedCheckpointError(
                f"{folder}: frozen parameter {name} {tuple(shape)}: its saved fragments hold {numel - left} elements"
            )
        params[name] = ParamState(name, torch.Size(shape), Gathered(tuple(pieces), tuple(lengths)), frozen=True)


def _read_universal(folder: Path, states: dict, optimizer_states: bool) -> DeepSpeedCheckpoint:
    zero = folder / "zero"
    common = zero / "optimizer_state.pt"
    osd = load_pickle(common) if common.is_file() else {}
    osd = osd if isinstance(osd, dict) else {}
    groups = [_hypers(g) for g in osd.get("param_groups", [])]
    owner = {int(s): gi for gi, g in enumerate(osd.get("param_groups", [])) for s in g.get("params", [])}
    params: dict[str, ParamState] = {}
    for sub, group_shapes in enumerate(states["param_shapes"]):
        for name, shape in dict(group_shapes).items():
            d = zero / name
            kinds = {"master": "fp32"} | ({m: m for m in MOMENTS} if optimizer_states else {})
            cut, step = {}, None
            for kind, file in kinds.items():
                path = d / f"{file}.pt"
                if not path.is_file():
                    raise DeepSpeedCheckpointError(
                        f"{path}: missing (the universal checkpoint's {kind} of {name}): convert the checkpoint again"
                        + ("" if kind == "master" else ", or load the weights only (load_optimizer_states=False)")
                    )
                t = load_pickle(path)
                t = t["param"] if isinstance(t, dict) else t
                if not isinstance(t, torch.Tensor) or math.prod(t.shape) != math.prod(shape):
                    raise DeepSpeedCheckpointError(
                        f"{path}: {getattr(t, 'shape', type(t).__name__)} for {name} {tuple(shape)}"
                    )
                flat = t.reshape(-1).float()
                cut[kind] = Gathered(((flat, 0),), (flat.numel(),))
            if optimizer_states and (d / "step.pt").is_file():
                s = load_pickle(d / "step.pt")
                step = _int_step(s["param"] if isinstance(s, dict) else s)
            params[name] = ParamState(
                name,
                torch.Size(shape),
                cut["master"],
                cut.get("exp_avg"),
                cut.get("exp_avg_sq"),
                step,
                owner.get(sub, 0 if len(groups) == 1 else None),
            )
    return _common(
        folder,
        states,
        "universal",
        _precision(states, False),
        int(states.get("dp_world_size", 1) or 1),
        params,
        groups,
        _scaler(osd) if osd else None,
    )
