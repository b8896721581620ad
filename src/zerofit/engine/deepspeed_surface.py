"""DeepSpeed's engine surface on zerofit's engine: the names a DeepSpeed training script calls.

``deepspeed_api.py`` runs the micro-batch loop (``engine(**batch)``, ``backward``, ``step``); this mixin adds
the rest of what scripts written for ``deepspeed.initialize`` read or call, with DeepSpeed's meaning
(deepspeed/runtime/engine.py, read at commit 38327e07f6cd39b63418f60cedd1651b0be3e7c3): the step counters,
the accumulation boundary, the learning rate, the batch sizes, the data loader, and the optimizer and
scheduler objects :func:`zerofit.deepspeed.initialize` returns (views over the engine, below). Every other
name of DeepSpeed's engine raises :class:`UnsupportedAttribute` naming it and what to do instead; nothing
is silently ignored. The table of names and their status is docs/migration.md.

[Note: DeepSpeed's accumulation boundary]
DeepSpeed counts ``micro_steps`` in ``step()``, which scripts call after every micro-batch, and
``is_gradient_accumulation_boundary()`` is ``(micro_steps + 1) % gradient_accumulation_steps == 0``: true
during the forward, backward and step of the *last* micro-batch of an accumulation (always, with one).
zerofit's engine counts backward()s since the optimizer step (``_micro_steps``, reset by the step and by a
dropped accumulation); the micro-batch being worked on is that count, less one between a backward() and
its step() (``_ds_unstepped`` holds the count the last backward() left, until step() clears it).
"""

from __future__ import annotations

import collections
import logging
import os
import weakref
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

log = logging.getLogger("zerofit")


class _WindowLoader(DataLoader):
    """DeepSpeed's training loader (``deepspeed_io``, the loader ``initialize(training_data=...)`` returns).

    [Note: the loader reads the window ahead]
    The DeepSpeed tutorial loop draws its micro-batches from this loader. When the engine is at the start of an
    accumulation window (the last step() taken, nothing pending), fetching the window's first micro-batch also
    fetches the rest of the window from the underlying loader (the same batches, in the same order) and offers
    them to the engine; if the next ``engine(**batch)`` is for the first of them, the engine makes the window's
    forwards at once ([Note: a window's forwards at once], deepspeed_api.py), as ``forward_window`` does. The
    loop yields the batches as always; a loop that changes the batches before calling the engine gets no
    offer taken, and runs as without it."""

    zerofit_engine = None       # weakref.ref to the engine

    def __iter__(self):
        it = super().__iter__()
        ahead: collections.deque = collections.deque()
        while True:
            if not ahead:
                try:
                    ahead.append(next(it))
                except StopIteration:
                    return
                engine = self.zerofit_engine() if self.zerofit_engine is not None else None
                if engine is not None and engine._can_offer():
                    for _ in range(engine.config.gradient_accumulation_steps - 1):
                        try:
                            ahead.append(next(it))
                        except StopIteration:
                            break
                    engine._offer_window(list(ahead))
            yield ahead.popleft()


class DeepSpeedUnsupported(NotImplementedError):
    """A DeepSpeed feature, argument or call zerofit does not provide; the message names it and says what to do."""


class UnsupportedAttribute(DeepSpeedUnsupported, AttributeError):
    """A DeepSpeed attribute zerofit does not provide (an ``AttributeError`` too, so ``hasattr`` is False)."""


class DeepSpeedAssertion(DeepSpeedUnsupported, ValueError, AssertionError):
    """A call DeepSpeed refuses with an ``assert`` (an ``AssertionError`` there, which its callers and tests catch):
    zerofit refuses it too, with a message that says what to do."""


# ---------------------------------------------------------------------------------------------- refusals

# what the DeepSpeed door does with several processes; the engine itself trains on several GPUs (ranks.py)
ONE_PROCESS = ("zerofit.deepspeed runs one process (one GPU, or the CPU); several GPUs of one host train with "
               "zerofit.initialize (or zerofit.hf.Trainer) in a script launched by torchrun --nproc-per-node N, "
               "or with zerofit train --gpus N (docs/ranks.md)")
_CONFIG_GETTER = ("a DeepSpeed config getter; zerofit's resolved configuration is engine.config (a ZerofitConfig; "
                  "`zerofit config show ds_config.json` shows how each DeepSpeed key was read)")
_NO_ZERO = ("zerofit has no ZeRO stages: it streams whole blocks through the GPU (engine.plan says what stays "
            "where) and its resolved configuration is engine.config")
_HINTS = {
    "save_16bit_model": "use engine.save_pretrained(out_dir, dtype='bf16' or 'fp16'): a Hugging Face model "
                        "directory of safetensors, streamed block by block",
    "save_fp16_model": "use engine.save_pretrained(out_dir, dtype='fp16')",
    "module_state_dict": "use engine.module.state_dict() (the model with its current fp32 weights, on the host)",
    "load_module_state_dict": "load weights with engine.load_checkpoint(dir), or into the model before "
                              "zerofit.deepspeed.initialize",
    "load_moe_state_dict": "zerofit has no mixture-of-experts layers of its own",
    "set_train_batch_size": "set train_batch_size / gradient_accumulation_steps in the config",
    "set_train_micro_batch_size": "set train_micro_batch_size_per_gpu in the config",
    "no_sync": ONE_PROCESS + " (there is no gradient all-reduce to skip)",
    "compile": "zerofit runs the model's own forward per block; torch.compile the model's blocks yourself",
    "is_compiled": "zerofit does not compile the model",
    "clip_fp32_gradients": "set gradient_clipping in the config: zerofit clips by the global norm in step()",
    "load_universal_checkpoint": "engine.load_checkpoint(dir) reads zerofit's checkpoints under any placement, and "
                                 "DeepSpeed's (ZeRO stages 1-3 and the universal layout) too",
    "get_pld_theta": "progressive layer drop is not implemented",
    "print_forward_breakdown": "see engine.timeline() and engine.trace()",
    "get_data_types": "zerofit computes in config.precision with fp32 master weights and gradients",
    "get_sequence_parallel_group": ONE_PROCESS,
    "set_data_post_process_func": "data efficiency is not implemented",
    "set_custom_curriculum_learning_schedule": "curriculum learning is not implemented",
    "random_ltd_initialize": "random layer-token drop is not implemented",
    "basic_optimizer": "zerofit's AdamW is its own; engine.optimizer is a view of its settings",
    "client_optimizer": "zerofit's AdamW is its own; engine.optimizer is a view of its settings",
    "client_lr_scheduler": "engine.lr_scheduler is the client's scheduler itself when initialize() was given one",
    "timers": "see engine.timeline() and engine.trace()",
    "monitor": "zerofit logs to its own timeline (engine.timeline())",
    "losses": "engine(**batch).loss is each micro-batch's loss",
    "mpu": ONE_PROCESS,
    "mesh_device": ONE_PROCESS,
    "checkpoint_engine": "zerofit's checkpoints are written by zerofit.checkpoint (engine.save_checkpoint)",
    "flops_profiler": "see engine.timeline() and engine.trace()",
}
_COMMUNICATION = {
    "allreduce_gradients", "allreduce_bucket", "allreduce_and_copy", "allreduce_no_retain",
    "buffered_allreduce_fallback", "sparse_allreduce", "sparse_allreduce_bucket", "sparse_allreduce_no_retain",
    "sparse_all_gather", "all_gather_scalar", "data_parallel_group", "seq_data_parallel_group", "seq_parallel_group",
    "expert_parallel_group", "expert_data_parallel_group", "all_to_all_group", "local_all_to_all_group",
    "mp_world_size", "seq_dp_world_size", "sequence_parallel_size", "dist_backend", "use_ds_comm",
    "enable_backward_allreduce", "inside_no_sync_ctxt", "gradient_average", "communication_data_type",
}
_CONFIG_GETTERS = {
    "aio_config", "amp_enabled", "amp_params", "autotp_size", "autotuning_enabled", "autotuning_end_profile_step",
    "autotuning_metric", "autotuning_metric_path", "autotuning_model_info_path", "autotuning_profile_model_info",
    "autotuning_start_profile_step", "checkpoint_tag_validation_enabled", "checkpoint_tag_validation_fail",
    "curriculum_enabled_legacy", "curriculum_learning_config", "curriculum_learning_enabled",
    "curriculum_params_legacy", "data_efficiency_config", "data_efficiency_enabled", "data_sampling_config",
    "data_sampling_enabled", "dataloader_drop_last", "dump_state", "dynamic_loss_scale", "dynamic_loss_scale_args",
    "eigenvalue_enabled", "eigenvalue_gas_boundary_resolution", "eigenvalue_layer_name", "eigenvalue_layer_num",
    "eigenvalue_max_iter", "eigenvalue_stability", "eigenvalue_tol", "eigenvalue_verbose", "elasticity_enabled",
    "is_elastic_model_parallel_supported", "flops_profiler_detailed", "flops_profiler_enabled",
    "flops_profiler_module_depth", "flops_profiler_output_file", "flops_profiler_profile_step",
    "flops_profiler_recompute_fwd_factor", "flops_profiler_top_modules", "fp16_auto_cast",
    "fp16_master_weights_and_gradients", "gradient_predivide_factor", "graph_harvesting", "initial_dynamic_scale",
    "loss_scale", "memory_breakdown", "optimizer_legacy_fusion", "optimizer_name", "optimizer_params",
    "pld_enabled", "pld_gamma", "pld_params", "pld_theta", "postscale_gradients", "quantize_training",
    "random_ltd_config", "random_ltd_enabled", "scheduler_name", "scheduler_params", "sparse_gradients_enabled",
    "swap_tensor_config", "use_node_local_storage", "get_batch_info",
}
_ZERO = {"is_first_weights_partition_group", "mics_shard_size", "zero_grad_hooks", "save_zero_checkpoint",
         "save_non_zero_checkpoint"}
_OTHER_STATE = {
    "autotuning_model_info", "block_eigenvalue", "collate_fn", "compression_scheduler", "curriculum_scheduler_legacy",
    "dont_change_device", "eigenvalue", "engine_timers", "first_dataloader_check", "flatten", "flops",
    "fwd_duration", "gas_boundary_ctr", "gate_modules", "has_moe_layers", "loaded_checkpoint_dp_world_size",
    "loaded_checkpoint_mp_world_size", "moe_layers", "num_experts", "optimized_linear_base_weight_sharding",
    "optimized_linear_lora_enabled", "param_names", "pipeline_parallelism", "progressive_layer_drop", "quantizer",
    "random_ltd_scheduler", "scale_wrt_gas", "sparse_tensor_module_names", "summary_events", "training_data",
    "unflatten", "warn_unscaled_loss", "get_type", "is_map_style_dataset", "is_iterable_style_dataset",
}


def deepspeed_hint(name: str) -> str | None:
    """What to do instead of DeepSpeed engine attribute ``name``; None if DeepSpeed's engine has no such name."""
    if name in _HINTS:
        return _HINTS[name]
    if name in _COMMUNICATION:
        return ONE_PROCESS
    if name in _CONFIG_GETTERS:
        return _CONFIG_GETTER
    if name in _ZERO or name.startswith(("zero_", "zeropp_")):
        return _NO_ZERO
    if name in _OTHER_STATE:
        return "DeepSpeed engine internals with no counterpart in zerofit"
    return None


def bind_inputs(model, inputs: tuple, batch: dict) -> dict:
    """Positional arguments of a forward call as the keyword arguments of ``model.forward`` they bind to (the
    engine passes its micro-batches by name): ``engine(x, y)`` of ``forward(self, x, y)`` is ``{"x": x, "y": y}``."""
    import inspect

    sig = inspect.signature(model.forward)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()):
        raise TypeError(f"engine(...) got {len(inputs)} positional argument(s) for {type(model).__name__}.forward"
                        f"{sig}, which takes *args: zerofit passes a micro-batch by name; call the engine with "
                        "keyword arguments")
    try:
        bound = sig.bind_partial(*inputs, **batch)
    except TypeError as e:
        raise TypeError(f"engine(...): {e}, for {type(model).__name__}.forward{sig}") from None
    out = {}
    for name, value in bound.arguments.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def refuse_attribute(owner: str, name: str, hint: str) -> UnsupportedAttribute:
    return UnsupportedAttribute(f"zerofit's DeepSpeed {owner} has no {name}: {hint}")


# ---------------------------------------------------------------------------------------------- the mixin

class DeepSpeedSurface:
    """Mixed into :class:`~zerofit.engine.engine.Engine` before ``DeepSpeedStyleAPI``. State: the marker of
    [Note: DeepSpeed's accumulation boundary], whether the last step() applied an update, and what
    :func:`zerofit.deepspeed.initialize` attached (the optimizer's groups, the data loader's settings)."""

    _ds_unstepped: int | None = None          # _micro_steps after the last backward() whose step() is pending
    _ds_step_applied: bool = False
    _ds_groups: tuple | None = None           # GroupSettings per group; None: one group, the config's optimizer
    _ds_collate_fn = None
    _ds_drop_last: bool = False
    _ds_samples: int = 0                      # managed_gradient_accumulation false: samples of the steps taken
    _ds_stepping: bool = False                # managed_gradient_accumulation false: inside step() (the boundary)
    _client_schedule = None                   # [Note: a client scheduler drives the engine's lr]
    training_dataloader = None                # the loader initialize(training_data=...) built (DeepSpeed's name)

    def _configure_deepspeed(self, groups=None, collate_fn=None, drop_last: bool = False, training_data=None) -> None:
        """What zerofit.deepspeed.initialize knows beyond the config: groups, collate_fn, dataloader_drop_last."""
        self._ds_groups = tuple(groups) if groups else None
        self._ds_collate_fn, self._ds_drop_last = collate_fn, drop_last
        self.__dict__.pop("_ds_views", None)
        if training_data is not None:
            self.training_dataloader = self.deepspeed_io(training_data)

    # ----------------------------------------------------------------- the micro-batch loop, DeepSpeed's arguments

    def __call__(self, *inputs, **batch):
        """The model's forward on one micro-batch, with the model's own arguments (positional ones too, as
        DeepSpeed passes them on: ``engine(x, y)``); returns what the model returns."""
        if inputs:
            batch = bind_inputs(self._model, inputs, batch)
        G = self.config.gradient_accumulation_steps
        if not self.config.managed_gradient_accumulation and self._micro_steps >= G and torch.is_grad_enabled():
            raise DeepSpeedUnsupported(
                f"engine(**batch): micro-batch {G + 1} before engine.step() with managed_gradient_accumulation false: "
                f"zerofit's window holds at most gradient_accumulation_steps ({G}) micro-batches (their block "
                f"checkpoints wait on the device for the blocks' backward). Call engine.step() after at most {G} "
                "backward() calls, or raise gradient_accumulation_steps")
        return super().__call__(**batch)

    def forward(self, *inputs, **batch):
        return self(*inputs, **batch)

    def backward(self, loss, release_loss: bool = False, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate one micro-batch's loss; returns the loss divided by gradient_accumulation_steps (detached),
        as DeepSpeed returns it. ``release_loss`` is ignored, as DeepSpeed does."""
        if retain_graph:
            raise DeepSpeedUnsupported("engine.backward(retain_graph=True): zerofit frees each block's graph as it "
                                       "goes (it recomputes blocks from checkpoints), so a second backward through "
                                       "the same forward is not possible; run the forward again")
        super().backward(loss, scale_wrt_gas=scale_wrt_gas)
        self._ds_unstepped = self._micro_steps
        G = self.config.gradient_accumulation_steps
        out = loss.detach().float()
        return out / G if G > 1 and scale_wrt_gas else out

    def step(self, lr_kwargs=None) -> None:
        """The optimizer step at the accumulation boundary (a no-op before it), then the lr schedule's step
        (a client scheduler's ``step(**lr_kwargs)``, after an applied step only, as DeepSpeed steps it). With
        ``managed_gradient_accumulation`` false every call after a backward() is the boundary, as in DeepSpeed."""
        if lr_kwargs and self._client_schedule is None:
            raise DeepSpeedUnsupported(f"engine.step(lr_kwargs={lr_kwargs!r}): the config's schedule takes no "
                                       "arguments (it is a function of the applied steps); lr_kwargs go to a client "
                                       "lr_scheduler passed to initialize()")
        applied_before, micro = self.global_step, self._micro_steps
        unmanaged = not self.config.managed_gradient_accumulation
        if unmanaged and micro:       # the caller's boundary: DeepSpeed steps whatever the count
            self._boundary_override, self._ds_stepping = True, True
        try:
            super().step()
        finally:
            if unmanaged:
                self._boundary_override, self._ds_stepping = None, False
        self._ds_unstepped = None
        self._ds_step_applied = self.global_step > applied_before
        if unmanaged and self._micro_steps == 0:       # DeepSpeed counts the micro-batches the caller gave
            self._ds_samples += micro * (self.train_batch_size() // self.config.gradient_accumulation_steps)
        if self._ds_step_applied and self._client_schedule is not None:
            self._client_schedule.catch_up(self, lr_kwargs)

    def set_gradient_accumulation_boundary(self, is_boundary):
        if not self.config.managed_gradient_accumulation:
            raise DeepSpeedUnsupported("engine.set_gradient_accumulation_boundary(): not with "
                                       "managed_gradient_accumulation false, where every engine.step() is the "
                                       "boundary (DeepSpeed refuses it too)")
        return super().set_gradient_accumulation_boundary(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True while the last micro-batch of an accumulation is worked on ([Note: DeepSpeed's accumulation
        boundary]): from its forward until its step(); what set_gradient_accumulation_boundary() said, when set."""
        if not self.config.managed_gradient_accumulation:
            return self._ds_stepping          # DeepSpeed: true only while step() runs
        if getattr(self, "_boundary_override", None) is not None:
            return self._boundary_override
        return (self._micro_position() + 1) % self.config.gradient_accumulation_steps == 0

    def _micro_position(self) -> int:
        done = self._micro_steps
        if done and self._ds_unstepped == done:    # its step() has not been called yet
            done -= 1
        return done

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the weights (False before the boundary and for a skipped fp16 step)."""
        return self._ds_step_applied

    def zero_grad(self) -> None:
        """A no-op: gradients live in the engine's own buffers and the optimizer step consumes them; the
        module's parameters have none. (DeepSpeed's ZeRO engines likewise keep accumulating across it.)"""

    # ----------------------------------------------------------------- counters and settings

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken, skipped fp16 steps included (DeepSpeed counts both)."""
        return self.global_step + self.skipped_steps

    @property
    def global_samples(self) -> int:
        """global_steps * train_batch_size; with managed_gradient_accumulation false, the samples of the
        micro-batches each step() took (DeepSpeed's count), since this engine started."""
        if not self.config.managed_gradient_accumulation:
            return self._ds_samples
        return self.global_steps * self.train_batch_size()

    @property
    def micro_steps(self) -> int:
        """DeepSpeed's count of step() calls: global_steps * gradient_accumulation_steps + the current micro-batch."""
        return self.global_steps * self.config.gradient_accumulation_steps + self._micro_position()

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    @property
    def local_rank(self) -> int:
        return self.device.index if self.device.type == "cuda" else int(os.environ.get("LOCAL_RANK", 0))

    global_rank = 0
    world_size = 1
    dp_world_size = 1

    def get_lr(self) -> list[float]:
        """The lr of each parameter group for the next optimizer step (DeepSpeed: after the scheduler's step)."""
        return self.optimizer._lrs()

    def get_mom(self) -> list[tuple[float, float]]:
        """Adam's betas of each group for the next optimizer step (OneCycle and a client scheduler may change them)."""
        return [(h.beta1, h.beta2) for h in self.optimizer._hypers()]

    def get_global_grad_norm(self) -> float | None:
        """The last step's global gradient norm, where the engine computed it (gradient clipping or fp16);
        None otherwise (DeepSpeed's ZeRO engines compute it always)."""
        return self.__dict__.get("last_grad_norm")

    def destroy(self) -> None:
        self.close()

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: frees ZeRO-3's cache of gathered parameters; without ZeRO-3 (and in zerofit, which keeps no
        parameters beyond its planned slots) there is none, and it frees the allocator's unused cache, as DeepSpeed
        does after it."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def tput_timer(self) -> "ThroughputTimerView":
        """DeepSpeed's throughput timer: its epoch and step counters (DeepSpeed-Chat calls
        ``engine.tput_timer.update_epoch_count()`` after each epoch); its timings are engine.timeline()'s."""
        from zerofit.engine.deepspeed_views import ThroughputTimerView

        view = self.__dict__.get("_ds_tput")
        if view is None:
            view = self.__dict__["_ds_tput"] = ThroughputTimerView(self)
        return view

    @property
    def optimizer(self) -> "OptimizerView":
        return self._views()[0]

    @property
    def lr_scheduler(self) -> "SchedulerView | None":
        return self._views()[1]

    def _views(self):
        views = self.__dict__.get("_ds_views")
        client = self._client_schedule
        if views is None or (client is not None and views[1] is not client.scheduler):
            opt = OptimizerView(self, self._ds_groups or (GroupSettings.of(self.config.optimizer, None),))
            sched = self.config.scheduler
            identity = sched.type == "constant" and sched.warmup_steps == 0
            if client is not None:      # DeepSpeed returns the client's scheduler itself (None without one)
                views = (opt, client.scheduler)
            elif identity:
                views = (opt, None)
            else:                       # DeepSpeed's class for its own schedules (deepspeed.runtime.lr_schedules)
                from zerofit.deepspeed.runtime.lr_schedules import view_class

                cls = view_class(sched.type)
                views = (opt, SchedulerView(self, opt) if cls is None else cls._of(self, opt))
            self.__dict__["_ds_views"] = views
        return views

    # ----------------------------------------------------------------- data

    def deepspeed_io(self, dataset, batch_size=None, route="train", pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None):
        """DeepSpeed's loader: micro-batches of ``train_micro_batch_size_per_gpu``, in the order of a
        ``DistributedSampler`` over one rank (shuffled with seed 0, the same order every epoch, as DeepSpeed never
        sets its epoch; unshuffled for ``route`` "eval"/"predict"), the config's ``dataloader_drop_last``.
        DeepSpeed starts 2 worker processes by default; zerofit 0 unless ``num_local_io_workers`` says so (the
        batches are the same)."""
        from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

        map_style = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
        if not (map_style or isinstance(dataset, IterableDataset)):
            raise ValueError(f"Training data must be a torch Dataset (map-style or iterable), got a "
                             f"{type(dataset).__name__}")
        if data_sampler is None and not isinstance(dataset, IterableDataset):
            data_sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=route == "train")
        cls = _WindowLoader if route == "train" else DataLoader
        loader = cls(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                     sampler=data_sampler, collate_fn=collate_fn or self._ds_collate_fn,
                     num_workers=num_local_io_workers or 0, pin_memory=pin_memory and self.device.type == "cuda",
                     drop_last=self._ds_drop_last)
        if route == "train":
            loader.zerofit_engine = weakref.ref(self)
        return loader

    # ----------------------------------------------------------------- checkpoints: DeepSpeed's extra arguments

    def _check_deepspeed_load_options(self, load_module_strict=True, load_lr_scheduler_states=True,
                                      load_module_only=False, custom_load_fn=None) -> None:
        for name, value, default, why in (
                ("load_module_strict", load_module_strict, True, "zerofit loads every tensor of the model, by name"),
                ("load_lr_scheduler_states", load_lr_scheduler_states, True,
                 "the lr schedule's position is the engine's step count, which the checkpoint restores"),
                ("load_module_only", load_module_only, False, "use load_optimizer_states=False to keep the moments "
                 "out (the step count and RNG states are still restored)"),
                ("custom_load_fn", custom_load_fn, None, "zerofit reads its own checkpoint format")):
            if value != default:
                raise DeepSpeedUnsupported(f"engine.load_checkpoint({name}={value!r}): {why}")

    # ----------------------------------------------------------------- everything else DeepSpeed's engine has

    def __getattr__(self, name: str):
        # only reached when normal lookup failed; must raise AttributeError (getattr(engine, x, default) relies on it)
        if name.startswith("_"):        # the engine's own (a mistyped private name is a plain AttributeError)
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        hint = deepspeed_hint(name)
        if hint is not None:
            raise refuse_attribute("engine", name, hint)
        model = self.__dict__.get("_model")
        if model is not None and hasattr(model, name):
            # DeepSpeed's engine passes what it does not have itself on to its module (engine.parameters(),
            # engine.config of a model...): the model with its current weights (engine.module applies pending updates)
            return getattr(self.module, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


# ---------------------------------------------------------------------------------------------- optimizer, scheduler

@dataclass(frozen=True)
class GroupSettings:
    """One parameter group's AdamW settings; ``names``: canonical parameter names, None for every parameter."""

    names: tuple[str, ...] | None
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    @classmethod
    def of(cls, optimizer_config, names, **given) -> "GroupSettings":
        """The group's own values where ``given``, else the config's optimizer block's."""
        base = {k: getattr(optimizer_config, k) for k in ("lr", "betas", "eps", "weight_decay")}
        base.update(given)
        return cls(None if names is None else tuple(names), float(base["lr"]), tuple(float(b) for b in base["betas"]),
                   float(base["eps"]), float(base["weight_decay"]))


class ParamGroup(dict):
    """One entry of ``optimizer.param_groups``: read-only, since the engine would not see a change."""

    def _refuse(self, *args, **kwargs):
        raise DeepSpeedUnsupported(
            "optimizer.param_groups is read-only in zerofit here: the engine computes each step's lr from the "
            "config's optimizer and scheduler blocks and would not see a change made here; set them in the config, "
            "or pass initialize() a torch optimizer (and lr_scheduler=...), whose param_groups the engine reads at "
            "every step")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse

    def __reduce__(self):    # copies (copy.deepcopy(optimizer.param_groups)) are plain dicts
        return (dict, (dict(self),))


class OptimizerView:
    """The optimizer ``zerofit.deepspeed.initialize`` returns (``engine.optimizer``): the AdamW settings of each
    parameter group, with the lr of the next step. The engine takes the step (``engine.step()``); gradients
    and moments live in its buffers, and its checkpoints hold them (``engine.save_checkpoint``)."""

    def __init__(self, engine, groups: tuple[GroupSettings, ...]):
        self._engine = engine
        self._groups = groups

    def _hypers(self):
        """The AdamW settings the engine will use for each group at its next step (its own [Note: group learning
        rates], or a client scheduler's: [Note: a client scheduler drives the engine's lr])."""
        client = self._engine._client_schedule
        hypers = client.reported(self._engine) if client is not None else self._engine._hyper()
        if len(hypers) != len(self._groups):
            raise RuntimeError(f"zerofit: the optimizer view has {len(self._groups)} groups and the engine "
                               f"{len(hypers)}")
        return hypers

    def _lrs(self) -> list[float]:
        return [h.lr for h in self._hypers()]

    @property
    def param_groups(self) -> list[ParamGroup]:
        """Each group's settings for the next step. With a client scheduler, the client optimizer's own groups
        (writable: the engine reads them at each step, as DeepSpeed's optimizer does)."""
        client = self._engine._client_schedule
        if client is not None:
            client.catch_up(self._engine)
            return client.optimizer.param_groups
        params = dict(self._engine._model.named_parameters())
        return [ParamGroup(params=list(params.values()) if g.names is None else [params[n] for n in g.names],
                           lr=h.lr, betas=(h.beta1, h.beta2), eps=g.eps, weight_decay=g.weight_decay)
                for g, h in zip(self._groups, self._hypers())]

    @property
    def defaults(self) -> dict:
        c = self._engine.config.optimizer
        return {"lr": c.lr, "betas": c.betas, "eps": c.eps, "weight_decay": c.weight_decay}

    @property
    def loss_scale(self) -> float:
        """The fp16 dynamic loss scale (1.0 in bf16/fp32, where no scaling is done)."""
        return float(self._engine.scaler.scale) if self._engine.scaler is not None else 1.0

    cur_scale = loss_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the fp16 loss scale is dynamic (DeepSpeed's FP16 optimizers' attribute)."""
        return self._engine.scaler is not None and bool(self._engine.scaler.dynamic)

    @property
    def loss_scaler(self) -> "LossScalerView":
        """DeepSpeed's FP16 optimizers' ``loss_scaler``: ``loss_scale`` (= ``cur_scale``) and ``dynamic``."""
        from zerofit.engine.deepspeed_views import LossScalerView

        return LossScalerView(self)

    @property
    def loss_scale_config(self):
        """DeepSpeed's ``optimizer.loss_scale_config`` (its FP16 optimizer's): the fp16 scale, its window, its
        counters, read live from the engine's scaler ([Note: fp16 without ZeRO], optim/loss_scaler.py)."""
        from zerofit.optim.loss_scaler import DeepSpeedLossScaleConfig

        return DeepSpeedLossScaleConfig(self._engine.scaler)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op: gradients live in the engine, which starts each accumulation from zero."""

    def step(self, closure=None):
        raise DeepSpeedUnsupported("optimizer.step(): engine.step() takes the optimizer step (at the gradient "
                                   "accumulation boundary), as with DeepSpeed; call engine.step() instead")

    def state_dict(self):
        raise DeepSpeedUnsupported("optimizer.state_dict(): the AdamW moments live in the engine's host buffers; "
                                   "engine.save_checkpoint(dir) saves them with the weights, step count and RNG "
                                   "states, and engine.load_checkpoint(dir) restores them")

    def load_state_dict(self, state_dict):
        raise DeepSpeedUnsupported("optimizer.load_state_dict(): restore the optimizer state with "
                                   "engine.load_checkpoint(dir)")

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise refuse_attribute("optimizer", name, "it offers param_groups, defaults, loss_scale, loss_scale_config, "
                                                  "dynamic_loss_scale, loss_scaler, "
                                                  "zero_grad() (a no-op); the engine steps and checkpoints the "
                                                  "optimizer")

    def __repr__(self) -> str:
        return f"zerofit AdamW view ({len(self._groups)} group(s), lr {self._lrs()})"


class SchedulerView:
    """The lr scheduler ``zerofit.deepspeed.initialize`` returns (``engine.lr_scheduler``) when the config has a
    schedule: the engine steps it inside ``engine.step()`` after every applied optimizer step, as DeepSpeed
    steps a scheduler from its config; so ``step()`` here does nothing (with a warning, once)."""

    def __init__(self, engine, optimizer: OptimizerView):
        self._engine = engine
        self.optimizer = optimizer
        self._warned = False

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's scheduler position: -1 before the first applied step."""
        return self._engine.global_step - 1

    def get_last_lr(self) -> list[float]:
        return self.optimizer._lrs()

    def get_lr(self) -> list[float]:
        return self.optimizer._lrs()

    def step(self, last_batch_iteration=None) -> None:
        if last_batch_iteration is not None:
            raise DeepSpeedUnsupported(f"lr_scheduler.step({last_batch_iteration!r}): the schedule's position is the "
                                       "engine's count of applied optimizer steps and cannot be set")
        if not self._warned:
            self._warned = True
            log.warning("zerofit: lr_scheduler.step() does nothing: engine.step() steps the schedule after every "
                        "applied optimizer step (DeepSpeed does the same, and a second step() there would advance "
                        "the schedule twice)")

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict):
        raise DeepSpeedUnsupported("lr_scheduler.load_state_dict(): the schedule's position is the engine's step "
                                   "count; engine.load_checkpoint(dir) restores it")

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise refuse_attribute("lr_scheduler", name, "it offers get_last_lr(), get_lr(), state_dict(), "
                                                     "last_batch_iteration and step() (a no-op)")

    def __repr__(self) -> str:
        return f"zerofit {self._engine.config.scheduler.type} schedule view (lr {self.get_last_lr()})"

