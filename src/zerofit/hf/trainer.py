"""The mixin that puts a zerofit engine under the Hugging Face Trainer's own loop (design: zerofit/hf/__init__.py).

Three small objects stand where the Trainer expects a model, an optimizer and a scheduler:

* :class:`EngineModel`, the ``model`` its ``training_step``/``prediction_step`` call: ``model(**inputs)`` is
  ``engine(**inputs)`` (a training forward, or an evaluation forward in eval mode / under no_grad);
* the accelerator's ``backward(loss)`` is the engine's: ``engine.backward(loss, scale_wrt_gas=False)`` (the
  Trainer has already divided the loss as it wants), and at the Trainer's accumulation boundary (its
  ``sync_gradients``) ``engine.step()``, as accelerate's own DeepSpeed wrapper does: the step, clipping
  included, is taken there, so the gradient norm is known when the Trainer asks for it;
* :class:`EngineOptimizer` (``step()`` and ``zero_grad()`` have nothing left to do) and
  :class:`EngineSchedule`: the engine's one optimizer and scheduler view (engine/faces/views.py), reporting each
  parameter group's lr, betas, eps and weight decay as the engine applies them.

Checkpoints: each ``checkpoint-N`` folder gets the model (``engine.save_pretrained``, loadable by
``from_pretrained``) from the Trainer's ``save_model``, a zerofit checkpoint (``latest``, ``global_stepN/``:
masters, moments, step counts) where the Trainer would write ``optimizer.pt``/``scheduler.pt``, and the
Trainer's own ``trainer_state.json`` and ``rng_state.pth``. A resume loads the zerofit checkpoint into the
engine; the Trainer restores its state, RNG and data position as it always does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from zerofit.engine.faces.views import OptimizerView, SchedulerView
from zerofit.hf.arguments import check_arguments, check_model, check_trainer, zerofit_config

log = logging.getLogger("zerofit")


class EngineModel(nn.Module):
    """The Trainer's ``model_wrapped``: calls go to the engine, the rest to the Hugging Face model.

    Not a container of the model (the engine owns its weights): ``parameters()`` are the model's (whose
    values are the engine's host weights), ``config`` and the class name are the model's (the Trainer's label
    smoother looks at the name)."""

    def __init__(self, engine, model: nn.Module, boundary: Callable[[], bool]) -> None:
        super().__init__()
        self.__dict__["engine"] = engine  # not registered: nn.Module must not walk into the engine or model
        self.__dict__["module"] = model
        self.__dict__["_boundary"] = boundary
        self.training = model.training

    def forward(self, *args, **inputs):
        if args:
            raise TypeError("zerofit's engine takes keyword inputs (model(**inputs)), as the Trainer passes them")
        if self.training and torch.is_grad_enabled():
            # the Trainer says before each micro-batch whether it ends the accumulation (its sync_gradients); the
            # engine wants to know at the forward already (whether to keep 16-bit copies for the next forward)
            self.engine.set_gradient_accumulation_boundary(bool(self._boundary()))
        return self.engine(**inputs)

    def train(self, mode: bool = True):
        self.engine.train(mode)
        self.training = mode
        return self

    @property
    def config(self):
        return self.module.config

    def _get_name(self):
        return self.module._get_name()

    # zerofit checkpoints every block itself: the model's own switch stays off under the engine (TRL's generation
    # helpers read it, and turn it off and on again around a generate)
    is_gradient_checkpointing = False

    def gradient_checkpointing_disable(self) -> None:
        return None

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        return None

    def generate(self, *args, **kwargs):
        """The model's ``generate`` over the engine's current weights (Engine.generate)."""
        return self.engine.generate(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)


class EngineOptimizer(OptimizerView):
    """The Trainer's ``optimizer``: the engine's one optimizer view (engine/faces/views.py: each parameter group's lr,
    betas, eps and weight decay of the next step, as the engine applies them), stepped by the engine at the
    accumulation boundary, inside ``backward``: ``step()`` and ``zero_grad()`` have nothing left to do."""

    def __init__(self, engine, model: nn.Module) -> None:
        super().__init__(engine.hypers, model)
        self.engine = engine

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("zerofit's optimizer step takes no closure")
        return None  # taken by the engine at the boundary micro-batch's backward

    def state_dict(self) -> dict:
        return {}  # moments and step counts are in the zerofit checkpoint (global_stepN/)

    def load_state_dict(self, state_dict: dict) -> None:
        return None


class EngineSchedule(SchedulerView):
    """The Trainer's ``lr_scheduler``: ``get_last_lr()`` is each group's lr of the step just taken until ``step()``
    moves it to the next one, as ``LambdaLR`` does; both are the engine's own (the view's, engine/faces/views.py)."""

    def __init__(self, engine) -> None:
        super().__init__(engine.hypers, OptimizerView(engine.hypers, engine.adapter.model))
        self.engine = engine
        self._last_lr = self.optimizer.lrs()

    def refresh(self) -> None:
        self._last_lr = self.optimizer.lrs()

    def step(self) -> None:
        self.refresh()  # an fp16 step skipped for overflow did not advance the engine: the lr stays

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"last_lr": list(self._last_lr)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.refresh()


class ZerofitTrainerMixin:
    """Put before a ``transformers.Trainer`` subclass: ``class MyTrainer(ZerofitTrainerMixin, SFTTrainer)``.

    Takes one keyword of its own, ``zerofit_config``: zerofit config fields applied last (for example
    ``{"max_gpu_memory": "24GiB", "offload": {"resident_blocks": 4}}``). ``trainer.zerofit_engine`` is the zerofit
    engine once training (or an evaluation) started."""

    _zerofit_trainer = True  # the hook on transformers.Trainer.__init__ looks for it (hooks.py)

    def __init__(self, *args, zerofit_config: dict | None = None, **kwargs) -> None:
        self._zerofit_overrides = dict(zerofit_config or {})
        self.zerofit_engine = None
        self._zerofit_model: EngineModel | None = None
        self._zerofit_steps: int | None = None  # the run length the engine's schedule was built for
        self._zerofit_trained = False
        self._zerofit_dtype = None  # the model's own dtype: what save_model writes
        self._zerofit_window: list | None = None  # the step's micro-batches, until its first training_step
        super().__init__(*args, **kwargs)
        check_trainer(self)

    # ------------------------------------------------------------------ set-up

    def _build_accelerator_args(self, **kwargs) -> dict:
        check_arguments(self.args)  # refusals before accelerate is set up
        out = super()._build_accelerator_args(**kwargs)
        out["mixed_precision"] = "no"  # zerofit runs the compute dtype itself (no autocast, no scaler)
        out["deepspeed_plugin"] = None
        return out

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # [the Trainer's backward is the engine's]: training_step (and a subclass's own) ends with
        # self.accelerator.backward(loss); accelerate routes that to DeepSpeed's engine the same way.
        self.accelerator.backward = self._zerofit_backward

    def _move_model_to_device(self, model, device) -> None:
        return None  # the model stays in host memory: the engine places (and streams) its weights

    def _zerofit_build(self, num_training_steps: int | None):
        """The engine, built on first use for a run of ``num_training_steps`` optimizer steps."""
        if self.zerofit_engine is not None:
            if num_training_steps is not None and self._zerofit_steps != num_training_steps:
                raise RuntimeError(
                    f"zerofit's engine was built for {self._zerofit_steps} optimizer steps, the "
                    f"Trainer now asks for {num_training_steps}: build a new Trainer"
                )
            return self.zerofit_engine
        import zerofit

        model = self.model
        check_model(model)
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()  # zerofit checkpoints every block itself
            log.info("zerofit.hf: the model's gradient checkpointing is off; zerofit checkpoints every block")
        self._zerofit_dtype = next(model.parameters()).dtype
        loaded, groups = zerofit_config(self, num_training_steps, self._zerofit_overrides)
        kw = {"param_groups": groups} if groups is not None else {}
        self.zerofit_engine = zerofit.initialize(model, loaded, **kw)
        self._zerofit_steps = num_training_steps
        return self.zerofit_engine

    def _zerofit_run_length(self) -> int | None:
        """The run's optimizer steps as train() will compute them (None without a training set)."""
        if self.train_dataset is None:
            return None
        return self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]

    def _zerofit_current(self):
        """The engine; before train() built it (an evaluation first), built for the run train() will make."""
        if self.zerofit_engine is not None:
            return self.zerofit_engine
        return self._zerofit_build(self._zerofit_run_length())

    def _zerofit_facade(self) -> EngineModel:
        if self._zerofit_model is None:
            self._zerofit_model = EngineModel(
                self._zerofit_current(), self.model, boundary=lambda: self.accelerator.sync_gradients
            )
        return self._zerofit_model

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self._zerofit_trained:
            raise RuntimeError(
                "zerofit.hf: this Trainer has trained already and its engine's step count goes on; "
                "build a new Trainer (with resume_from_checkpoint to continue from a checkpoint)"
            )
        self._zerofit_trained = True
        if getattr(self.model, "is_gradient_checkpointing", False):  # train() enables it for gradient_checkpointing
            self.model.gradient_checkpointing_disable()
        self._zerofit_build(max_steps)
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = EngineOptimizer(self._zerofit_current(), self.model)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = EngineSchedule(self._zerofit_build(num_training_steps))
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self._zerofit_facade()

    # ------------------------------------------------------------------ the step

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The Trainer fetches an optimizer step's micro-batches up front: remember them, so that the window's
        first training_step can announce them to the engine ([Note: a window's forwards at once],
        engine/step/window.py)."""
        samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._zerofit_window = list(samples)
        return samples, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        """At the first micro-batch of a window, the engine makes all of the window's forwards at once (each
        streamed block's weights cross PCIe once for the step, as in train_batch); the Trainer's own
        training_step (or a subclass's) then runs as always, each model call taking its forward from there. A
        subclass whose model calls do not match the micro-batches (a compute_loss that changes the inputs) is
        noticed at its first call and the Trainer goes on one forward at a time."""
        window, self._zerofit_window = self._zerofit_window, None
        engine = self.zerofit_engine
        if (
            window
            and len(window) > 1
            and inputs is window[0]
            and isinstance(inputs, dict)
            and "input_ids" in inputs  # the model's own inputs (an RL trainer's are prompts it generates from)
            and engine is not None
            and engine.window_stats["mismatched"] == 0
        ):
            model.train()
            engine.forward_window([self._prepare_inputs(s) for s in window])
        return super().training_step(model, inputs, num_items_in_batch)

    def _zerofit_backward(self, loss: torch.Tensor, **kwargs) -> None:
        unknown = set(kwargs) - {"scale_wrt_gas"}
        if unknown:
            raise TypeError(f"zerofit.hf: accelerator.backward() got {sorted(unknown)}, which zerofit does not take")
        if self.zerofit_engine is None:
            raise RuntimeError("zerofit.hf: backward() before the engine exists (call it from training_step)")
        boundary = bool(self.accelerator.sync_gradients)
        self.zerofit_engine.set_gradient_accumulation_boundary(boundary)
        self.zerofit_engine.backward(loss, scale_wrt_gas=False)
        if boundary:
            self.zerofit_engine.step()

    def _zerofit_grad_norm(self):
        """The last step's global gradient norm (before clipping), when the engine computed one (clipping on,
        or fp16); None otherwise (the Trainer then logs no grad_norm)."""
        return getattr(self.zerofit_engine, "last_grad_norm", None) if self.zerofit_engine is not None else None

    def _clip_grad_norm(self, model):
        return self._zerofit_grad_norm()  # clipped inside the engine's step

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm if grad_norm is not None else self._zerofit_grad_norm()

    # ------------------------------------------------------------------ checkpoints and the model

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.zerofit_engine is None:
            raise RuntimeError("zerofit.hf: nothing to checkpoint before training starts")
        self.zerofit_engine.save_checkpoint(output_dir)  # output_dir/latest, output_dir/global_stepN/

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # train() calls this before the engine exists: check the folder now, load it in _load_optimizer_and_scheduler
        if not (Path(resume_from_checkpoint) / "latest").is_file():
            raise FileNotFoundError(
                f"{resume_from_checkpoint} has no zerofit or DeepSpeed checkpoint (no 'latest' file): it was written "
                "with save_only_model=True, or by a Trainer without zerofit or DeepSpeed; resume from a folder a "
                "zerofit.hf Trainer (or a Trainer with deepspeed=) saved"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self._load_from_checkpoint(checkpoint)
        self.zerofit_engine.load_checkpoint(checkpoint)
        if isinstance(self.lr_scheduler, EngineSchedule):
            self.lr_scheduler.refresh()

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        log.info("zerofit.hf: loading the best checkpoint's weights from %s (score %s)", best, self.state.best_metric)
        self.zerofit_engine.load_checkpoint(best, load_optimizer_states=False)
        if isinstance(self.lr_scheduler, EngineSchedule):
            self.lr_scheduler.refresh()

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.zerofit_engine is None:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self._zerofit_dtype, "fp32")
        self.zerofit_engine.save_pretrained(output_dir, dtype=dtype)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, Path(output_dir) / "training_args.bin")
