"""The two hooks ``import zerofit.hf`` installs in transformers, so that ``deepspeed=`` never reaches DeepSpeed.

[Note: deepspeed= without DeepSpeed]
``TrainingArguments(deepspeed="ds_config.json")`` acts in its own ``__post_init__``, before any Trainer
exists: it builds transformers' ``HfTrainerDeepSpeedConfig`` (which requires the ``deepspeed`` package, so
without it the arguments cannot even be constructed) and accelerate's ``DeepSpeedPlugin``, and its device
setup starts accelerate's state in DeepSpeed mode (which imports DeepSpeed and initializes its
communication). A user script builds the arguments before the Trainer, so the Trainer class alone cannot
intercept this. Hence, once ``zerofit.hf`` is imported:

1. ``TrainingArguments.__post_init__`` (and so every subclass's, TRL's configs included, since they call
   ``super().__post_init__()``) runs with ``deepspeed`` set to None, then puts the user's value back into
   ``args.deepspeed`` and keeps it in ``args._zerofit_deepspeed``: no DeepSpeed import, no plugin, plain
   single-process accelerate state. zerofit's Trainer reads the value as the DeepSpeed JSON it is.
2. ``transformers.Trainer.__init__`` refuses such arguments unless the Trainer is zerofit's (it has the
   mixin), instead of silently training without DeepSpeed.

Arguments built *before* ``import zerofit.hf`` went through DeepSpeed's path (or failed without it); zerofit's
Trainer refuses them with a message saying to import zerofit.hf first. Both hooks are idempotent and
change nothing for arguments without ``deepspeed``.
"""

from __future__ import annotations

import copy
import functools

DEFERRED = "_zerofit_deepspeed"  # the attribute that holds the deferred deepspeed= value
_MARK = "__zerofit_hook__"


def deferred_deepspeed(args):
    """The ``deepspeed=`` value zerofit took over from these arguments, or None."""
    return getattr(args, DEFERRED, None)


def install() -> None:
    from transformers import Trainer, TrainingArguments

    post_init = TrainingArguments.__post_init__
    if not getattr(post_init, _MARK, False):

        @functools.wraps(post_init)
        def __post_init__(self, *a, **kw):
            value = self.deepspeed
            if not value:
                return post_init(self, *a, **kw)
            self.deepspeed = None
            try:
                post_init(self, *a, **kw)
            finally:
                self.deepspeed = value
            setattr(self, DEFERRED, copy.deepcopy(value))

        setattr(__post_init__, _MARK, True)
        TrainingArguments.__post_init__ = __post_init__

    init = Trainer.__init__
    if not getattr(init, _MARK, False):

        @functools.wraps(init)
        def __init__(self, *a, **kw):
            args = kw["args"] if "args" in kw else (a[1] if len(a) > 1 else None)
            if deferred_deepspeed(args) is not None and not getattr(type(self), "_zerofit_trainer", False):
                raise ValueError(
                    f"TrainingArguments.deepspeed={args.deepspeed!r} was taken over by zerofit (zerofit.hf is "
                    f"imported), but {type(self).__name__} is not zerofit's Trainer: use zerofit.hf.Trainer, "
                    "or zerofit.hf.with_zerofit(YourTrainerClass), or build the arguments without deepspeed"
                )
            init(self, *a, **kw)

        setattr(__init__, _MARK, True)
        Trainer.__init__ = __init__
