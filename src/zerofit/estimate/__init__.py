"""``zerofit estimate``: a plan's GPU, host and disk bytes and its step time, before anything runs.

predict.py reads the model's shape (from a model, a folder's config.json or a named shape of shapes.py), asks the
planner and predicts the step from measured speeds; probes.py measures those speeds (a block's compute, the engine's own
block on a small twin of the model); nodes.py adds what crosses the nodes in a several-node layout."""

from zerofit.estimate.predict import (
    FORWARD_SHARE,
    block_seconds,
    engine_block_seconds,
    estimate,
    phase_seconds,
)
from zerofit.estimate.shapes import meta_model, with_lora

__all__ = [
    "estimate",
    "meta_model",
    "with_lora",
    "phase_seconds",
    "block_seconds",
    "engine_block_seconds",
    "FORWARD_SHARE",
]
