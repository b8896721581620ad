"""Offloaded generation (docs/inference.md): ``InferenceEngine`` streams the blocks that do not fit the GPU
through it, under transformers' own ``generate``; :func:`zerofit.generate` is the text-in, text-out layer."""

from zerofit.infer.engine import InferenceEngine
from zerofit.infer.plan import InferencePlanError, InferPlan

__all__ = ["InferenceEngine", "InferencePlanError", "InferPlan"]
