"""The optimizer, scheduler and offload sections of a DeepSpeed config in zerofit's fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerofit.config.deepspeed_keys import (
    ADAM_PARAMS,
    AUTO,
    DEEPSPEED_VERSION,
    MAPPED,
    NO_DEFAULT,
    SCHEDULER_PARAMS,
    TORCH_ADAMW_WEIGHT_DECAY,
    KeyReport,
    default,
)
from zerofit.config.deepspeed_walk import Values, walk
from zerofit.config.schema import ConfigError, OptimizerConfig, check_nvme_path, show

_ZF_OPT = OptimizerConfig()


def optimizer(v: Values, notes: dict, origin: dict, extra: list) -> dict:
    if "optimizer" not in v:
        extra.append(
            KeyReport(
                "optimizer",
                MAPPED,
                f"not given: zerofit's AdamW with lr={_ZF_OPT.lr}, "
                f"betas={_ZF_OPT.betas}, eps={_ZF_OPT.eps}, weight_decay={_ZF_OPT.weight_decay}",
            )
        )
        return {}
    kind = v.get("optimizer.type")
    if kind is None:
        raise ConfigError(v.name("optimizer") + ".type", "'AdamW' or 'Adam'", "nothing")
    if kind.lower() not in ("adam", "adamw"):
        raise ConfigError(
            v.name("optimizer.type"),
            "'AdamW' or 'Adam' (zerofit implements AdamW only)",
            show(kind),
            "zerofit's AdamW has the math of torch.optim.AdamW",
        )
    params = v.get("optimizer.params", {})
    if isinstance(params, Mapping) and "max_grad_norm" in params:
        raise ConfigError(
            v.name("optimizer") + ".params.max_grad_norm",
            f"no max_grad_norm (DeepSpeed {DEEPSPEED_VERSION} refuses it as an optimizer parameter)",
            show(params["max_grad_norm"]),
            "set the top-level gradient_clipping instead",
        )
    walk(ADAM_PARAMS, params, "optimizer.params", v.name("optimizer") + ".params", v)

    adam_w = kind.lower() == "adamw" or v.get("optimizer.params.adam_w_mode", default("optimizer.params.adam_w_mode"))
    out = {}
    # DeepSpeed's Adam/AdamW defaults for absent keys (its own Adam kernels' defaults, or torch.optim.AdamW's with
    # torch_adam: weight_decay 0.01); zerofit's defaults for "auto".
    torch_adamw = adam_w and v.get("optimizer.params.torch_adam", default("optimizer.params.torch_adam"))
    for key in ("lr", "betas", "eps", "weight_decay"):
        path = f"optimizer.params.{key}"
        ds_default = TORCH_ADAMW_WEIGHT_DECAY if key == "weight_decay" and torch_adamw else default(path)
        value = v.get(path, ds_default)
        if value is AUTO:
            value = getattr(_ZF_OPT, key)
            notes[path] = f"auto -> {value} (zerofit's default)"
        out[key] = value
        origin[f"optimizer.{key}"] = v.name(path)
    if kind.lower() == "adam":
        if not adam_w and out["weight_decay"] > 0:
            raise ConfigError(
                v.name("optimizer.params.adam_w_mode"),
                "true (decoupled weight decay, AdamW)",
                "false with weight_decay > 0 (L2-regularised Adam)",
                "zerofit implements AdamW only; set weight_decay 0 or adam_w_mode true",
            )
        notes["optimizer.type"] = "Adam with adam_w_mode=true (DeepSpeed's default) is AdamW -> zerofit's AdamW"
    return out


def scheduler(v: Values, optimizer: dict, notes: dict, origin: dict) -> dict:
    kind = v.get("scheduler.type")
    if kind not in SCHEDULER_PARAMS:
        raise ConfigError(
            v.name("scheduler") + ".type",
            "one of " + ", ".join(map(repr, SCHEDULER_PARAMS)),
            "nothing" if kind is None else show(kind),
            "zerofit implements DeepSpeed's schedules, and constant/linear/cosine in its own "
            "config; DeepSpeed's torch.optim.lr_scheduler names are not read from a config: pass "
            "the torch scheduler as zerofit.deepspeed.initialize(lr_scheduler=...)",
        )
    walk(SCHEDULER_PARAMS[kind], v.get("scheduler.params", {}), "scheduler.params", v.name("scheduler") + ".params", v)
    origin["scheduler.type"] = v.name("scheduler.type")
    if kind in _OWN_SECTION:
        return _cyclic_scheduler(v, kind, origin)

    def param(key: str, auto_value: Any = None, auto_note: str = "") -> Any:
        """The key's value; DeepSpeed's default when absent (the table's); ``auto_value`` for "auto"."""
        path = f"scheduler.params.{key}"
        value = v.get(path, default(path, kind))
        if value is AUTO:
            notes[path] = f"auto -> {auto_note}"
            return auto_value
        return value

    out: dict[str, Any] = {
        "type": kind,
        "warmup_steps": param("warmup_num_steps", 0, "0 (no warm-up beyond DeepSpeed's minimum of 2)"),
        "warmup_type": param("warmup_type"),
    }
    if kind in ("WarmupLR", "WarmupDecayLR"):
        out["warmup_min_lr"] = param("warmup_min_lr", 0.0, "0.0")
        # DeepSpeed: WarmupLR's warmup_max_lr defaults to the optimizer's lr (None), WarmupDecayLR's to 0.001.
        out["warmup_max_lr"] = param("warmup_max_lr", None, "the optimizer's lr")
        if kind == "WarmupDecayLR" and "scheduler.params.warmup_max_lr" not in v:
            notes["scheduler.type"] = (
                "WarmupDecayLR without warmup_max_lr: DeepSpeed's default peak 0.001 "
                f"(not the optimizer's lr {optimizer.get('lr', _ZF_OPT.lr)})"
            )
    if kind in ("WarmupDecayLR", "WarmupCosineLR"):
        if "scheduler.params.total_num_steps" not in v:
            raise ConfigError(
                v.name("scheduler") + ".params.total_num_steps",
                f"the run's length in optimizer steps ({kind} needs it)",
                "nothing",
                'give a number, or "auto" to have the engine supply it',
            )
        out["total_steps"] = param("total_num_steps", None, "the run length, supplied by the engine")
    if kind == "WarmupCosineLR":
        out["warmup_min_ratio"] = param("warmup_min_ratio")
        out["min_lr_ratio"] = param("cos_min_ratio")
    for zf, ds in (
        ("warmup_steps", "warmup_num_steps"),
        ("warmup_type", "warmup_type"),
        ("warmup_min_lr", "warmup_min_lr"),
        ("warmup_max_lr", "warmup_max_lr"),
        ("total_steps", "total_num_steps"),
        ("warmup_min_ratio", "warmup_min_ratio"),
        ("min_lr_ratio", "cos_min_ratio"),
    ):
        origin[f"scheduler.{zf}"] = v.name(f"scheduler.params.{ds}")
    return out


# DeepSpeed's OneCycle and LRRangeTest: their parameters go to a section of their own (zerofit field -> DeepSpeed key)
_OWN_SECTION = {
    "OneCycle": ("one_cycle", {k: k for k in SCHEDULER_PARAMS["OneCycle"] if k != "last_batch_iteration"}),
    "LRRangeTest": (
        "lr_range_test",
        {
            "min_lr": "lr_range_test_min_lr",
            "step_size": "lr_range_test_step_size",
            "step_rate": "lr_range_test_step_rate",
            "staircase": "lr_range_test_staircase",
        },
    ),
}


def _cyclic_scheduler(v: Values, kind: str, origin: dict) -> dict:
    section, names = _OWN_SECTION[kind]
    params = {}
    for zf, ds in names.items():
        path = f"scheduler.params.{ds}"
        value = v.get(path, default(path, kind))
        if value is NO_DEFAULT:
            raise ConfigError(
                v.name("scheduler") + f".params.{ds}",
                f"a number ({kind} needs it)",
                "nothing",
                f"DeepSpeed's {kind} requires {ds}",
            )
        params[zf] = value
        origin[f"scheduler.{section}.{zf}"] = v.name(path)
    return {"type": kind, section: params}


def offload(v: Values, notes: dict, origin: dict) -> dict:
    z = "zero_optimization"
    stage = v.get(f"{z}.stage", 0)
    devices = {}
    for part, legacy in (("offload_optimizer", "cpu_offload"), ("offload_param", "cpu_offload_param")):
        if v.get(f"{z}.{part}") is not None:
            devices[part] = v.get(f"{z}.{part}.device", "none")  # DeepSpeed's default device
        else:
            devices[part] = "cpu" if v.get(f"{z}.{legacy}") is True else "none"
    if devices["offload_param"] != "none" and stage != 3:
        raise ConfigError(
            v.name(f"{z}.offload_param.device"),
            f"'none' unless {z}.stage is 3",
            f"{devices['offload_param']!r} with stage {stage}",
            "DeepSpeed offloads parameters only in stage 3; set stage 3 or remove offload_param",
        )
    if devices["offload_optimizer"] != "none" and stage == 0:
        raise ConfigError(
            v.name(f"{z}.offload_optimizer.device"),
            f"'none' unless {z}.stage is 1, 2 or 3",
            f"{devices['offload_optimizer']!r} with stage 0",
            "DeepSpeed offloads the optimizer only with ZeRO; set a stage or remove offload_optimizer",
        )

    nvme: dict[str, str] = {}
    for part in ("offload_optimizer", "offload_param"):
        path = f"{z}.{part}.nvme_path"
        if devices[part] == "nvme":
            check = check_nvme_path(v.get(path), field=v.name(path))
            nvme[part] = v.get(path)
            notes[path] = (
                f"-> offload.nvme_path; {check.describe()}; the disk tier's swap file goes there, "
                "sized by the plan (only what max_host_memory cannot hold)"
            )
        elif v.get(path) is not None:
            notes[path] = "unused: the device is not nvme"
    notes.update(_device_notes(z, devices))
    if len(set(nvme.values())) > 1:
        raise ConfigError(
            v.name(f"{z}.offload_param.nvme_path"),
            f"the same folder as {v.name(f'{z}.offload_optimizer.nvme_path')}",
            show(nvme["offload_param"]),
            "zerofit keeps its NVMe tier in one folder",
        )

    out: dict[str, Any] = {
        "param_device": devices["offload_param"],
        "optimizer_device": devices["offload_optimizer"],
        "nvme_path": next(iter(nvme.values()), None),
    }
    # DeepSpeed's aio block: its request size, and its requests in flight (queue depth x threads)
    if v.get("aio.block_size") is not None:
        out["nvme_block_size"] = max(4096, -(-int(v.get("aio.block_size")) // 4096) * 4096)
        origin["offload.nvme_block_size"] = v.name("aio.block_size")
    # (DeepSpeed 0.19.8's threads per request are intra_op_parallelism; thread_count is its older name)
    threads = v.get("aio.intra_op_parallelism", v.get("aio.thread_count"))
    if v.get("aio.queue_depth") is not None or threads is not None:
        depth = int(v.get("aio.queue_depth", default("aio.queue_depth")))
        out["nvme_queue_depth"] = max(1, min(256, depth * int(threads or default("aio.intra_op_parallelism"))))
        origin["offload.nvme_queue_depth"] = v.name("aio.queue_depth")
    pins = {
        p: v.get(p)
        for p in (
            f"{z}.offload_optimizer.pin_memory",
            f"{z}.offload_param.pin_memory",
            f"{z}.cpu_offload_use_pin_memory",
        )
        if v.get(p) is not None
    }
    if pins:
        out["pin_memory"] = any(pins.values())
        if len(set(pins.values())) > 1:
            for p in pins:
                notes[p] = f"-> offload.pin_memory={out['pin_memory']} (zerofit has one setting; any true wins)"
    origin.update(
        {
            "offload.param_device": v.name(f"{z}.offload_param.device"),
            "offload.optimizer_device": v.name(f"{z}.offload_optimizer.device"),
            "offload.nvme_path": v.name(f"{z}.{next(iter(nvme), 'offload_param')}.nvme_path"),
            "offload.pin_memory": v.name(next(iter(pins), f"{z}.offload_param.pin_memory")),
        }
    )
    if f"{z}.stage" in v:
        if "none" in devices.values():
            notes[f"{z}.stage"] = (
                f"stage {stage}: every block stays on the GPU with its optimizer state (zerofit "
                "offloads whole blocks, and only when offload_param and offload_optimizer are "
                "both set)"
            )
        else:
            notes[f"{z}.stage"] = (
                f"stage {stage}: zerofit streams whole blocks; weights "
                f"{_where(devices['offload_param'])}, optimizer state "
                f"{_where(devices['offload_optimizer'])}"
            )
    return out


def _where(device: str) -> str:
    return {
        "cpu": "in host memory (the planner keeps on the GPU what fits)",
        "nvme": "in host memory first, what max_host_memory cannot hold on the disk tier under nvme_path",
    }[device]


def _device_notes(z: str, devices: Mapping[str, str]) -> dict[str, str]:
    """What each offload device key becomes for the values given, in the words of what the plan will do."""
    opt, param = devices["offload_optimizer"], devices["offload_param"]
    notes = {}
    if opt == "nvme":
        notes[f"{z}.offload_optimizer.device"] = (
            "nvme -> the disk tier: the optimizer state host memory cannot "
            "hold (max_host_memory) goes to a swap file under nvme_path, Adam "
            "moments first, then master weights, streamed around each CPU "
            "update; the rest stays in host memory (the engine logs the "
            "placement)"
        )
    elif opt == "cpu" and param == "none":
        notes[f"{z}.offload_optimizer.device"] = (
            "cpu, but without offload_param every block's weights stay on "
            "the GPU, and zerofit updates a block where its weights live: the "
            "optimizer state stays on the GPU too (the engine logs the "
            "placement and a warning); add offload_param cpu (stage 3) to "
            "move it to host memory"
        )
    elif opt == "cpu":
        notes[f"{z}.offload_optimizer.device"] = (
            "cpu -> host memory for the blocks the planner streams; blocks it "
            "keeps on the GPU (and the shell, when it fits) keep their state "
            "there (the engine logs the placement)"
        )
    if param != "none" and opt == "none":
        notes[f"{z}.offload_param.device"] = (
            f"{param}, but without offload_optimizer zerofit keeps every block on "
            "the GPU with its optimizer state (the engine logs a warning)"
        )
    elif param == "nvme":
        notes[f"{z}.offload_param.device"] = (
            "nvme -> the 16-bit weights a step reads stay in host memory (read "
            "once per forward and backward); it enables the disk tier for the "
            "optimizer state, as offload_optimizer nvme does"
        )
    elif param == "cpu":
        notes[f"{z}.offload_param.device"] = (
            "cpu -> blocks stream from host memory; the planner keeps on the GPU "
            "those that fit (offload.resident_blocks bounds them)"
        )
    return notes
