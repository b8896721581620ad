"""Fine-tuning runs: a model directory and the user's data in; checkpoints, metrics and a model out.

See :mod:`zerofit.train.run` (the run), :mod:`zerofit.train.options` (what it takes),
:mod:`zerofit.train.resume` (the run folder: who holds it, where ``--resume`` continues) and
:mod:`zerofit.train.signals` (Ctrl-C and SIGTERM). The run (and torch) is imported on first use, so that
``zerofit train`` can take its run folder before anything heavy loads.
"""

from zerofit.train.options import TrainOptions

__all__ = ["TrainOptions", "TrainResult", "run_training"]


def __getattr__(name: str):
    if name in ("TrainResult", "run_training"):
        from zerofit.train import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
