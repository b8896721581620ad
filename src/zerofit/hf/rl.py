"""TRL's GRPOTrainer on zerofit's engine: ``from zerofit.hf import GRPOTrainer`` (or ``with_zerofit(GRPOTrainer)``);
TRL's RLOOTrainer, which makes the same calls, likewise.

[Note: GRPO on the engine]
GRPOTrainer makes four kinds of model calls per generation round, and each goes where the engine holds the weights:

* **Completions** (``unwrap_model_for_generation(model_wrapped).generate``): the engine's ``generate``, on the device
  over the engine's own host weights, each streamed block uploaded at its call ([Note: generation over the
  engine's weights], engine/step/hooked.py). They are the current step's weights (the last updates are applied
  first), and no second copy of the model exists, nor a gather of it onto the GPU; one whose key/value cache cannot
  fit is refused by name first ([Note: generation keeps blocks], engine/plan/generation.py).
* **The policy's log-probabilities** in the loss (``_compute_loss``'s ``model(..., fused_lm_head=True)`` on the
  Trainer's wrapped model): the engine's training forward, whose post pass runs the model's own forward after the
  last block, TRL's fused head included, so the per-token log-probabilities come from TRL's own tiles and the
  ``[batch, length, vocab]`` logits never exist; ``backward(loss)`` is the engine's.
* **The old policy's** (``num_iterations`` > 1) and, for PEFT, **the reference's** (the same model with its adapters
  disabled, TRL's ``use_adapter``): TRL calls the bare model under ``no_grad``; here they are the engine's evaluation
  forwards (the adapters' switch is the user's modules' own, which the engine's blocks run).
* **A full fine-tuning's reference** (TRL's ``ref_model``, a second model of the initial weights): never moved to
  the device whole (the accelerator's ``prepare_model`` for evaluation leaves it in host memory); its forwards run in
  an :class:`~zerofit.infer.engine.InferenceEngine` over it, its blocks streamed within what the training plan's
  placement leaves of the GPU budget between steps, and the device given back after each scoring pass.

The math is TRL's: its sampling, rewards, advantages, KL and loss run unchanged; only where each forward computes
differs.
"""

from __future__ import annotations


class GRPOMixin:
    """Put before :class:`~zerofit.hf.trainer.ZerofitTrainerMixin` over TRL's ``GRPOTrainer`` (``with_zerofit`` does):
    [Note: GRPO on the engine]."""

    _zerofit_ref = None  # the reference model's InferenceEngine, built at its first forward

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        prepare = self.accelerator.prepare_model  # type: ignore[attr-defined]

        def prepare_model(model, device_placement=None, evaluation_mode: bool = False):
            if evaluation_mode:  # TRL's reference model: it stays in host memory, streamed at its forwards
                return model
            return prepare(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

        self.accelerator.prepare_model = prepare_model  # type: ignore[attr-defined]

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        if model is self.model:  # type: ignore[attr-defined]  # the policy under no_grad: old, or PEFT's reference
            model = self._zerofit_facade()  # type: ignore[attr-defined]
        elif model is not None and model is getattr(self, "ref_model", None):
            reference = self._zerofit_reference()
            try:
                return super()._get_per_token_logps_and_entropies(reference, *args, **kwargs)  # type: ignore[misc]
            finally:  # the step's room back to the training engine ([Note: an inference engine between its calls])
                reference.release_device()
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)  # type: ignore[misc]

    def _zerofit_reference(self):
        """The reference model's forwards: an InferenceEngine over it, on the training engine's device, in its compute
        dtype, within the GPU bytes the training plan's placement leaves between steps (the step's activations and
        gradient slots are not in use then); it gives the device back after each scoring pass."""
        if self._zerofit_ref is None:
            from zerofit.infer.engine import InferenceEngine

            engine = self._zerofit_current()  # type: ignore[attr-defined]
            budget = None
            if engine.dev.is_cuda:  # what the placement leaves between steps: the step's own room is unused then
                from zerofit.engine.plan.generation import kept_bytes

                budget = max(0, engine.plan.device_budget - kept_bytes(engine.plan))
            # in the policy's compute dtype: the KL compares two forwards of the same rounding (stock TRL runs both
            # under one autocast)
            self._zerofit_ref = InferenceEngine(
                self.ref_model, device=engine.dev.device, dtype=engine.dtype, max_gpu_memory=budget
            )
        return self._zerofit_ref


def is_grpo_trainer(trainer_cls: type) -> bool:
    """Whether ``trainer_cls`` is TRL's GRPOTrainer or RLOOTrainer (the same calls: generation, scoring, the fused
    head's loss) or a subclass of one (TRL is imported only if it is loaded)."""
    import sys

    trl = sys.modules.get("trl")
    rl = [getattr(trl, name, None) for name in ("GRPOTrainer", "RLOOTrainer")] if trl is not None else []
    return any(isinstance(c, type) and issubclass(trainer_cls, c) for c in rl)
