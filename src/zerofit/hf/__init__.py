"""The Hugging Face Trainer on zerofit: change ``from transformers import Trainer`` into::

    from zerofit.hf import Trainer

and the same script (``TrainingArguments(..., deepspeed="ds_config.json")`` included) trains with zerofit's
engine: weights and AdamW state in host memory, blocks streamed through the GPU. For Trainer subclasses
(TRL's ``SFTTrainer``, your own), either of::

    class MySFTTrainer(ZerofitTrainerMixin, SFTTrainer): ...
    SFTTrainer = with_zerofit(SFTTrainer)          # the same class, built for you

Import ``zerofit.hf`` before building ``TrainingArguments`` with ``deepspeed=`` ([Note: deepspeed= without
DeepSpeed], hooks.py). docs/hf_trainer.md has before/after scripts and every ``TrainingArguments`` field's
status; ``zerofit.hf.arguments.FIELDS`` is the same table in code.

Design
------

The Trainer keeps its own loop. Two ways were weighed:

(a) keep ``Trainer._inner_training_loop`` and stand zerofit where the loop expects a model, an optimizer
    and a scheduler: ``training_step`` calls ``model(**inputs)`` (the engine's forward) and
    ``accelerator.backward(loss)`` (the engine's backward; at the Trainer's accumulation boundary also
    ``engine.step()``), one micro-batch at a time through zerofit's DeepSpeed-shaped API;
(b) override the loop to gather the G micro-batches of a step and call ``engine.train_batch`` once.

(b) is the faster path (``train_batch`` moves each block's weights twice per step; the per-micro-batch API
streams every block again for each micro-batch's forward, though its backward now runs block-major at the
boundary like ``train_batch``'s: slower than ``train_batch`` on a 3B model; docs/benchmarks.md, the
DeepSpeed-shaped loop), but it would re-implement the loop: callbacks (``on_step_begin``, ``on_substep_end``,
``on_pre_optimizer_step``...), ``logging_steps`` accounting, NaN filtering, evaluation
and saving schedules, epoch ends, resumption's data skipping, token counting, ``num_items_in_batch``; and it
would bypass ``compute_loss`` and ``training_step``, which TRL's trainers override (``train_batch`` computes
the model's own loss). Every transformers release moves that loop. (a) leaves all of it to the Trainer and
honours overridden ``compute_loss``/``training_step`` by construction, so it is what this package does;
whatever makes the engine's per-micro-batch path faster speeds this up with no change here.

How (a) fits the Trainer (details in trainer.py):

* ``create_optimizer``/``create_scheduler``/``_wrap_model`` build the engine (``zerofit.initialize``) on
  first use, from ``TrainingArguments`` or the DeepSpeed JSON (arguments.py), and return stand-ins
  (``EngineOptimizer``, ``EngineSchedule``, ``EngineModel``). The model stays in host memory
  (``_move_model_to_device`` does nothing); accelerate runs with mixed precision "no" and no DeepSpeed plugin.
* ``accelerator.backward(loss)`` becomes ``engine.set_gradient_accumulation_boundary(sync_gradients);
  engine.backward(loss, scale_wrt_gas=False); engine.step() at the boundary`` — what accelerate does for
  DeepSpeed. The Trainer divides the loss itself (by the step's micro-batches, or by its token count through
  ``num_items_in_batch``), so the gradients are plain Trainer's; a short last accumulation of an epoch steps
  early as the Trainer does. The step (clipping included) happens there, so ``_clip_grad_norm`` returns the
  engine's norm, ``optimizer.step()``/``zero_grad()`` have nothing left to do and ``lr_scheduler.get_last_lr()``
  is the lr the engine used (transformers' own schedule formulas: ``zerofit.optim.schedules``, ``hf_*``).
* Evaluation calls the same ``EngineModel`` in eval mode under ``torch.no_grad()``: the engine's evaluation
  forwards.
* ``save_model`` writes ``engine.save_pretrained`` (a ``from_pretrained`` directory, in the model's dtype);
  checkpoints add a zerofit checkpoint where the Trainer writes optimizer and scheduler state, and a resume
  loads it (trainer.py's docstring).

What differs from plain Trainer: ``grad_norm`` is logged when the engine computes the norm (clipping on,
which ``max_grad_norm=1.0`` by default is, or fp16); ``on_pre_optimizer_step`` callbacks run after the
step was taken (as under DeepSpeed); parameters have no ``.grad`` (the gradients are the engine's); one
``train()`` per Trainer.
"""

from __future__ import annotations

import transformers

from zerofit.hf import hooks
from zerofit.hf.arguments import FIELDS, UnsupportedArgumentError
from zerofit.hf.rl import GRPOMixin, is_grpo_trainer
from zerofit.hf.trainer import EngineModel, EngineOptimizer, EngineSchedule, ZerofitTrainerMixin

__all__ = [
    "Trainer",
    "GRPOTrainer",
    "RLOOTrainer",
    "ZerofitTrainerMixin",
    "with_zerofit",
    "UnsupportedArgumentError",
    "FIELDS",
    "EngineModel",
    "EngineOptimizer",
    "EngineSchedule",
]

hooks.install()


class Trainer(ZerofitTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` trained by zerofit's engine (see the module docstring)."""


def with_zerofit(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass) with :class:`ZerofitTrainerMixin` in front, under
    the same name; ``with_zerofit(SFTTrainer)`` is ``class SFTTrainer(ZerofitTrainerMixin, SFTTrainer)``."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TypeError(f"with_zerofit takes a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, ZerofitTrainerMixin):
        return trainer_cls
    front: tuple[type, ...] = (GRPOMixin,) if is_grpo_trainer(trainer_cls) else ()  # [Note: GRPO on the engine]
    return type(
        trainer_cls.__name__,
        (*front, ZerofitTrainerMixin, trainer_cls),
        {
            "__module__": trainer_cls.__module__,
            "__qualname__": trainer_cls.__qualname__,
            "__doc__": trainer_cls.__doc__,
        },
    )


def __getattr__(name: str):
    """``GRPOTrainer``, ``RLOOTrainer``: TRL's, on zerofit ([Note: GRPO on the engine], rl.py); TRL is imported when
    one is asked for."""
    if name in ("GRPOTrainer", "RLOOTrainer"):
        import trl

        cls = with_zerofit(getattr(trl, name))
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
