"""The user's own training loop drives the engine: ``out = model(**batch)``, ``loss.backward()``,
``optimizer.step()`` on zerofit, as FSDP-shaped code writes them (zerofit/fsdp: the one import that changes).

[Note: the user's loop drives the engine]
A :class:`UserLoop` holds an engine over the user's model and stands where the loop expects the model:

- the forward is the engine's DeepSpeed-shaped forward (the blocks streamed, checkpointed; the post pass with
  autograd). Every tensor of its output that requires grad (a loss, logits, a reconstruction, in a tensor, a
  tuple, a dict or a model output) is handed back through :class:`_Seed`, an autograd Function whose input is a
  dummy leaf: ``loss.backward()`` (of whatever the user computed from them: ``loss / G``, a criterion of the
  logits) reaches ``_Seed.backward`` with the gradient of each, and that calls the engine's own backward of
  ``sum((t * g_t).sum())`` without rescaling (``scale_wrt_gas=False``): the gradient of the user's objective
  exactly, as plain autograd gives it (``x * g`` backpropagates ``g``
  bitwise). With a window of 1 (``gradient_accumulation_steps`` of the engine's config, the default) each
  micro-batch's blocks backward runs at its own ``backward()``, so a loop may accumulate over any number of
  micro-batches, the sums in autograd's order; a window of the loop's G holds them and runs each block's
  backward over all G at the step (fewer uploads), and a G+1-th micro-batch is refused.
- the step is the user's optimizer's: a global ``torch.optim`` step post-hook (after the closure a step may run:
  Lightning's) finds the loop whose parameters the optimizer holds and takes the engine's optimizer step there
  (``Step.prepare`` then ``Step.apply``), with the AdamW settings read from the optimizer's ``param_groups`` at
  that moment (an lr scheduler moves them between steps: ``ClientSchedule`` with no scheduler,
  optim/client_schedule.py). The module's parameters never get a ``.grad`` (the gradients are the engine's), so
  torch's own step updates nothing; ``zero_grad`` has nothing to clear.
- clipping: ``model.clip_grad_norm_(max_norm)`` (FSDP's) and ``torch.nn.utils.clip_grad_norm_`` over the loop's
  parameters (patched to come here) prepare the step (every gradient complete) and clip the engine's gradients in
  place with torch's own arithmetic (``Step.clip_as_torch``), returning the norm; ``optimizer.step()`` applies.
- fp16: a GradScaler's (or ShardedGradScaler's) ``_unscale_grads_`` of the loop's optimizer unscales and checks
  the engine's gradients with torch's own kernel; a fused optimizer's step takes the scaler's ``grad_scale`` and
  ``found_inf`` as torch's fused kernel does; a skipped step is dropped at the next forward.
- the engine runs deferred updates (the host's updates wait for the step's norm, then run during the next forward,
  each waited for by its block's upload), without speculating against a clip (a rollback differs by rounding),
  the device taking a share of them where the plan has room (assisted updates); with the learnt window, a step
  whose ``optimizer.step()`` comes with no clip or unscale before it updates each block in its blocks' backward
  ([Note: updates in the backward of the user's loop], engine/update/speculation.py).
- under ``torch.autocast`` (Lightning's and accelerate's mixed precision, over an fp32 engine) the forward's
  autocast is entered again around the engine's recompute and backward, as ``torch.utils.checkpoint`` does.

[Note: one wrapped model per optimizer]
A wrapper's engine owns its model's gradients: its backward reaches the model's parameters, not its inputs, and
its clip, unscale and step see those gradients only. So a step holds one wrapped model: a forward whose input
requires grad (a wrapped decoder fed by a wrapped encoder) is refused, as are an optimizer over two wrapped models
and a clip or a GradScaler's unscale over the wrapped model's parameters and others. Plain trained parameters in
the same optimizer after the wrapped model (a head over its output) train by torch's own step. Wrap one module
that holds every trained part and call it (a LightningModule with an encoder and a decoder: a module holding both).

Refused by name, before anything trains: an optimizer other than AdamW (or Adam without weight decay), AMSGrad,
``maximize``, param groups whose settings differ (the engine's groups are fixed when it is built: give them as
``zerofit_config``'s optimizer), an optimizer built before the wrap over parameters the model no longer holds (a
model built on the meta device gets new ones; a real model's are kept: [Note: the model's parameter objects],
engine/model/materialize.py), an autocast of another dtype over a 16-bit wrapper (of its own dtype: FSDP's fp16
recipe, run).
The optimizer's ``state_dict()`` is torch's AdamW format filled from the engine's moments (and ``load_state_dict``
writes them back): accelerate's ``save_state``/``load_state`` and Lightning's checkpoints work as written.

The clip's order (the engine's units and names in the module's order) is taken at wrap time, and again after a
rebuild of the engine's units (the generic fallback: recovery.py).

The package: live.py (the registry of live loops: the state the modules share), loop.py (:class:`UserLoop`),
optimizer.py (the optimizer's checks, its step hooks and zero_grad), patches.py (every callable of torch,
accelerate and Lightning replaced in the process: its table ``PATCHES``, ``installed()``, the ``ZEROFIT_PATCHES``
opt-out; [Note: the process-wide patches]).
"""

from zerofit.userloop import live, loop, optimizer, patches
from zerofit.userloop.loop import UserLoop, UserLoopError
from zerofit.userloop.optimizer import check_optimizer
from zerofit.userloop.patches import PATCHES, installed

__all__ = [
    "PATCHES",
    "UserLoop",
    "UserLoopError",
    "check_optimizer",
    "installed",
    "live",
    "loop",
    "optimizer",
    "patches",
]
