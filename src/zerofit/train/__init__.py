"""Fine-tuning runs: a model directory and the user's data in; checkpoints, metrics and a model out.

See :mod:`zerofit.train.run` (the run) and :mod:`zerofit.train.options` (what it takes).
"""

from zerofit.train.options import TrainOptions
from zerofit.train.run import TrainResult, run_training

__all__ = ["TrainOptions", "TrainResult", "run_training"]
