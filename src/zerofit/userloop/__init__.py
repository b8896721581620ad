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
- the engine runs deferred updates (the host's updates wait for the step's norm, then run during the next forward),
  without speculation (a user's clip is known only when it is called) and without assisted updates.
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
``zerofit_config``'s optimizer), an optimizer built over the model's parameters before it was wrapped (they are
not the ones trained), an autocast of another dtype over a 16-bit wrapper (of its own dtype: FSDP's fp16 recipe, run).
The optimizer's ``state_dict()`` is torch's AdamW format filled from the engine's moments (and ``load_state_dict``
writes them back): accelerate's ``save_state``/``load_state`` and Lightning's checkpoints work as written.

A loop's ``clip_order`` (the engine's units and names in the model's order) is taken at wrap time: a rebuild of the
engine's units (the generic fallback) would leave it stale (not handled).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import weakref

import torch
import torch.utils._pytree as pytree
from torch import nn

from zerofit.engine.plan.plan import PlanError

log = logging.getLogger("zerofit")

_LIVE: weakref.WeakSet[UserLoop] = weakref.WeakSet()
_HOOKED = []
_LOCK = threading.Lock()


def _autocast_state() -> tuple:
    """The autocast in force: ((device type, dtype), ...) of each device type where it is enabled."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


def _autocast(state: tuple):
    """``state`` (``_autocast_state()``) entered again: the forward's autocast for its recompute and backward, as
    torch.utils.checkpoint restores it."""
    stack = contextlib.ExitStack()
    for device, dtype in state:
        stack.enter_context(torch.autocast(device, dtype=dtype))
    return stack


class UserLoopError(ValueError):
    """A user loop zerofit cannot run as written; the message says what to change."""


class _Seed(torch.autograd.Function):
    """Identity on the output's tensors (from a dummy leaf): its backward hands their gradients to the engine
    ([Note: the user's loop drives the engine])."""

    @staticmethod
    def forward(ctx, loop, anchor, outputs):
        # ``outputs`` come in a tuple, which autograd does not look into: as tensor inputs it would also walk their
        # graph after this backward, which the engine's own backward has freed
        ctx.loop, ctx.outputs = loop, outputs
        ctx.set_materialize_grads(False)
        return tuple(t.detach().clone() for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.loop._backward(ctx.outputs, grads)
        ctx.outputs = None
        return None, None, None


class UserLoop:
    """The engine under the user's loop. ``module``: the model (its parameters become the engine's views);
    ``config``: zerofit's config (any form ``zerofit.initialize`` takes)."""

    def __init__(self, module: nn.Module, config: dict):
        from zerofit.engine.engine import Engine

        cfg = {**dict(config), "managed_gradient_accumulation": False}
        if cfg.get("precision") == "fp16":  # the user's GradScaler scales the loss: the engine's scale stays 1
            cfg["fp16"] = {**cfg.get("fp16", {}), "loss_scale": 1.0}
        cfg.setdefault("offload", {})
        # no speculation (a clip is known when it is called), no assisted updates (their settings would be read
        # before the optimizer is known): [Note: the user's loop drives the engine]
        cfg["offload"] = {**cfg["offload"], "speculative_updates": False, "assisted_updates": False}
        self._originals = weakref.WeakSet(module.parameters())
        self.engine = Engine.create(module, cfg, user_loop=True)
        # any number of micro-batches per step with a window of one (each micro-batch's blocks backward at its own
        # backward(): the sums come in plain autograd's order); a window of G > 1 holds exactly the loop's G
        self.engine.window.any_number_of_micro_batches(self.engine.config.gradient_accumulation_steps == 1)
        # [Note: the window learns the loop's G]: with the default window, from the first step's micro-batches
        self.learn_window = self.engine.config.gradient_accumulation_steps == 1 and self.engine.adapter.streaming
        self.engine.stepper.torch_clip.follow(self._clip_order())
        self.params = {id(p) for p in self.engine.module.parameters()}
        self.prepared = None  # the step prepared by a clip, applied at optimizer.step()
        self.uncleared = False  # a step ran and no zero_grad() since: [Note: zero_grad]
        self.optimizer = None
        self.inside = False  # the engine is running the model's own forward
        self.amp = ()  # the last forward's autocast: (device type, dtype), ...
        self.cast_inputs = None  # a dtype the floating inputs take (FSDP's mixed precision)
        _install_hooks()
        _patch_accelerate()
        _patch_lightning()
        _LIVE.add(self)

    def _trained(self) -> dict:
        """The model's name of every trained parameter -> (its unit, its name in the unit)."""
        eng = self.engine
        where = {}
        for u in eng.units:
            prefix = "" if u.index < 0 else eng.adapter.block_prefix(u.index) + "."
            where.update({prefix + n: (u, n) for n in u.layout.names})
        return where

    def _clip_order(self) -> list:
        """(unit, its name of the parameter) of every trained parameter, in the model's order (torch's clip)."""
        where = self._trained()
        return [where[n] for n, p in self.engine.module.named_parameters() if p.requires_grad and n in where]

    # ------------------------------------------------------------------ forward and backward

    def forward(self, *args, **kwargs):
        eng = self.engine
        G = eng.config.gradient_accumulation_steps
        if G > 1 and eng.window.micro_steps >= G and torch.is_grad_enabled():
            raise UserLoopError(
                f"micro-batch {G + 1} of a step with zerofit_config gradient_accumulation_steps {G}: "
                "the window holds that many micro-batches before their blocks' backward, and "
                "summing a second window onto the first changes the order of the sums; set it to "
                "the loop's accumulation steps, or to 1 (any number, each micro-batch's blocks "
                "backward at its own backward())"
            )
        amp = _autocast_state()
        wrapper_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(eng.config.precision)
        if amp and wrapper_dtype is not None and any(dtype != wrapper_dtype for _, dtype in amp):
            raise UserLoopError(
                f"the wrapped model called under torch.autocast({amp[0][1]}) and a wrapper in "
                f"{eng.config.precision}: one of them sets the compute dtype; give them the same "
                "dtype (FSDP's recipe: MixedPrecision(param_dtype=torch.float16) under "
                "autocast(dtype=torch.float16)), or keep the autocast (Lightning's 'bf16-mixed', "
                "accelerate's mixed_precision) over an fp32 wrapper"
            )
        if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
            for t in pytree.tree_leaves((args, kwargs))
        ):
            raise UserLoopError(
                "an input of the wrapped model requires grad (the output of another module, or a "
                "leaf made to): the engine's backward reaches the wrapped model's parameters, not "
                "its inputs, so what made the input would get no gradient; wrap one module that "
                "holds every trained part and call it ([Note: one wrapped model per optimizer])"
            )
        self.amp = amp  # the blocks' recompute and backward run under the forward's autocast
        if self.cast_inputs is not None:  # as FSDP's MixedPrecision casts the root's floating inputs
            args, kwargs = pytree.tree_map(
                lambda t: t.to(self.cast_inputs) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                (args, kwargs),
            )
        if self.prepared is not None and torch.is_grad_enabled():
            self._skipped()
            self.uncleared = True
        self.inside = True
        try:
            out = self.engine(*args, **kwargs)
        finally:
            self.inside = False
        if not torch.is_grad_enabled():
            return out
        # every tensor of the output the backward can reach (a loss, logits, a reconstruction, a tuple or dict of
        # them), handed back as it is: the user's objective may be any function of them
        leaves, spec = pytree.tree_flatten(out)
        seeded = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not seeded:
            raise UserLoopError(
                f"the model's output ({type(out).__name__}) holds no tensor that requires grad: "
                "zerofit's loop backpropagates from the tensors the model returns (a loss, logits, "
                "any output) "
            )
        anchor = torch.zeros((), requires_grad=True)
        for i, t in zip(seeded, _Seed.apply(self, anchor, tuple(leaves[i] for i in seeded))):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, spec)

    def _backward(self, outputs: tuple, grads: tuple) -> None:
        """The engine's backward of ``sum((t * g).sum())`` over the output tensors ``t`` the user's objective
        reached (``g`` its gradient of each): that objective's gradient exactly, as plain autograd gives it."""
        if self.uncleared:
            raise UserLoopError(
                "a backward after optimizer.step() without optimizer.zero_grad() (or "
                "model.zero_grad()) between them: torch would add this step's gradients to the last "
                "step's, and zerofit starts each step from zero; call optimizer.zero_grad() once per "
                "step, after optimizer.step() or before the step's first backward ([Note: zero_grad])"
            )
        with torch.enable_grad(), _autocast(self.amp):  # (autograd runs a Function's backward with grad off)
            objective = None
            for t, g in zip(outputs, grads):
                if g is None:
                    continue
                part = (t * g).sum()
                objective = part if objective is None else objective + part
            if objective is not None:
                self.engine.backward(objective, scale_wrt_gas=False)

    # ------------------------------------------------------------------ the step

    def _prepare(self) -> None:
        """The step up to its updates (Step.prepare): the held micro-batches' blocks backward, every gradient
        complete, the global norm (fp16: the overflow check)."""
        eng = self.engine
        if eng.window.micro_steps == 0:
            raise UserLoopError(
                "optimizer.step() (or clip_grad_norm_, unscale_) without a backward since the last "
                "step: the engine has no gradient to apply (a loop that steps twice, or whose loss "
                "did not come from the wrapped model's output)"
            )
        with eng.guard(discard_step=True), _autocast(self.amp):
            eng.window.before_step()
            self.prepared = eng.stepper.prepare()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """This step's gradients clipped to ``max_norm`` in place, as torch's ``clip_grad_norm_`` clips them
        (Step.clip_as_torch); their global norm."""
        if float(norm_type) != 2.0:
            raise UserLoopError(f"clip_grad_norm_(norm_type={norm_type}): zerofit clips by the L2 norm")
        if self.prepared is None:
            self._prepare()
        return torch.tensor(self.engine.stepper.clip_as_torch(float(max_norm), self.prepared), dtype=torch.float32)

    def unscale(self, optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> dict:
        """A ``GradScaler``'s ``unscale_`` of ``optimizer``: the engine's gradients unscaled in place and checked,
        with torch's own kernel (``_amp_foreach_non_finite_check_and_unscale_``), per device: what the scaler's
        ``_unscale_grads_`` returns."""
        self._follow(optimizer)
        if self.prepared is None:
            self._prepare()
        by_device: dict = {}
        for g in self.engine.stepper.grad_views(self.prepared):
            by_device.setdefault(g.device, []).append(g)
        out = {}
        ranks = self.engine.ranks
        with torch.no_grad():
            for dev, grads in by_device.items():
                fi = found_inf.to(dev, copy=True)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, fi, inv_scale.to(dev, copy=True))
                out[dev] = fi
            if ranks.many:  # each rank holds its shards: an overflow on one skips the step on every rank
                total = ranks.all_reduce_world(
                    torch.stack([f.to(self.engine.dev.device).reshape(()) for f in out.values()]).sum().reshape(1)
                )
                for dev, fi in out.items():
                    fi.copy_((total > 0).to(fi.dtype).to(dev).reshape(fi.shape))
        return out

    def _skipped(self) -> None:
        """A prepared step whose ``optimizer.step()`` never came (a GradScaler found an overflow): not applied."""
        prepared, self.prepared = self.prepared, None
        eng = self.engine
        n = eng.window.micro_steps
        with eng.guard(discard_step=True):
            eng.stepper.discard_grads()
            eng.window.stepped()
            eng.end_step(False, prepared.norm)
        self._learn_window(n)

    def on_step(self, optimizer) -> None:
        """The user's ``optimizer.step()``: the engine's updates, with the optimizer's settings now. A GradScaler
        stepping a fused optimizer leaves the unscaling and the overflow skip to it (``optimizer.grad_scale``,
        ``optimizer.found_inf``, as torch's fused kernel reads them): the engine does the same."""
        self._follow(optimizer)
        if self.prepared is None:
            self._prepare()
        self.uncleared = True
        found_inf, grad_scale = getattr(optimizer, "found_inf", None), getattr(optimizer, "grad_scale", None)
        if found_inf is not None and float(found_inf) > 0:
            self._skipped()
            return
        prepared, self.prepared = self.prepared, None
        if grad_scale is not None:  # the fused kernel's own unscaling: grad / grad_scale
            prepared = prepared._replace(factor=prepared.factor / float(grad_scale))
        eng = self.engine
        n = eng.window.micro_steps
        with eng.guard(discard_step=True):
            applied, norm = eng.stepper.apply(prepared)
            eng.window.stepped()
            eng.end_step(applied, norm)
        self._learn_window(n)

    def zero_grad(self) -> None:
        """[Note: zero_grad]
        Torch's gradients stay in ``.grad`` until ``zero_grad()``: a loop that steps without it adds the next step's
        gradients to the last's, and one that calls it between a backward and its step drops that backward's. The
        engine's gradients live from a step's first backward to its ``optimizer.step()``, so the loop's
        ``optimizer.zero_grad()`` and ``module.zero_grad()`` (over a loop's parameters; they hold no ``.grad``) come
        here: after a step, the next backward is refused until one comes; a step prepared (a GradScaler's unscale)
        whose ``optimizer.step()`` never came (an overflow) is dropped, as torch's zero_grad drops its gradients;
        between a backward and its step, refused (the engine has added them already). Clearing ``.grad`` by hand
        (``p.grad = None``) is not seen: the parameters never hold one."""
        if self.prepared is not None:
            self._skipped()
        elif self.engine.window.micro_steps:
            raise UserLoopError(
                f"zero_grad() after {self.engine.window.micro_steps} backward() of a step and "
                "before its optimizer.step(): torch would drop their gradients, and zerofit's engine "
                "has summed them; call zero_grad() after optimizer.step() or before the step's "
                "first backward ([Note: zero_grad])"
            )
        self.uncleared = False

    def _learn_window(self, n: int) -> None:
        """[Note: the window learns the loop's G]
        With the default window (``gradient_accumulation_steps`` 1: each micro-batch's blocks backward at its own
        ``backward()``, the gradients summed on the host), every micro-batch of a step uploads every streamed block for
        its backward and downloads its gradient: a 3B model's loop of 4 micro-batches ran at well under half the speed
        it reached with the window of the loop's 4 held (docs/benchmarks.md, the user's own loop). The loop's G is not
        known when it is wrapped, but its first step shows it: from the second step on the window holds the first k of
        each step's micro-batches and runs each block's backward over them at once, k the loop's G or, where the plan
        cannot keep that many checkpoints, the most it can (Planning.hold_for, k >= 2; else it stays as it is, said
        once); the micro-batches after the k-th (a longer step, or k < G) each run their blocks' backward at their own
        ``backward()``. The sums are the same: the window's block backward adds the held micro-batches' gradients in
        their order into the block's gradient, which the host then takes or adds, and each later one is added on the
        host after them, as plain autograd adds them (bitwise plain PyTorch's for untied models; with a tied head every
        window adds the head's part elsewhere, to rounding: docs/fsdp.md). (Holding a second group of k would sum it on
        the device before adding it to the first: another order.) The plan made at wrap-up leaves room for the
        checkpoints of LEARN_WINDOW micro-batches where blocks stream anyway (a resident block or two fewer: Planning,
        [Note: room for a learnt window]): without it, that loop's plan at a 24 GiB cap kept 3 resident blocks for one
        micro-batch and could not hold 4, several times slower per step than the window of 4 (docs/benchmarks.md, the
        user's own loop)."""
        if not self.learn_window:
            return
        self.learn_window = False
        if n < 2:
            return
        eng = self.engine
        for k in range(n, 1, -1):
            try:
                eng.planning.hold_for(k)
                break
            except PlanError as e:
                why = str(e).split("\n")[0]
        else:
            log.info(
                "zerofit: the loop's %d micro-batches per step do not fit the checkpoints of 2 of them in the "
                "plan; each micro-batch's blocks run their backward at its own backward() (%s)",
                n,
                why,
            )
            return
        eng.window.hold_micro_batches(k)
        log.info(
            "zerofit: the loop takes %d micro-batches per step: from its second step the window holds %s and "
            "runs each block's backward over them at once ([Note: the window learns the loop's G])",
            n,
            "them" if k == n else f"the first {k} (the most whose checkpoints fit), the rest one at a time",
        )

    def follow(self, optimizer) -> None:
        """``optimizer`` is this loop's (checked; refused by name otherwise): its steps, settings and state dicts
        are the engine's from here (FSDP's ``optim_state_dict`` names it before any step)."""
        self._follow(optimizer)

    def _follow(self, optimizer) -> None:
        if optimizer is self.optimizer:
            return
        from zerofit.optim.client_schedule import ClientSchedule

        check_optimizer(optimizer, self)
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if any(ids & loop.params for loop in list(_LIVE) if loop is not self):
            raise UserLoopError(
                f"{type(optimizer).__name__} holds the parameters of two wrapped models: each "
                "wrapper's engine steps its own model at optimizer.step(); wrap one module that "
                "holds them both and call it ([Note: one wrapped model per optimizer])"
            )
        carrier = _OneGroup(optimizer)
        self.engine.hypers.attach(ClientSchedule(carrier, None, self.engine.config.train_batch_size))
        optimizer.register_state_dict_post_hook(self._optimizer_state)
        optimizer.register_load_state_dict_post_hook(self._optimizer_loaded)
        self.optimizer = optimizer
        if optimizer.state:  # loaded before its first step (accelerate's load_state): the engine's now
            self._optimizer_loaded(optimizer)

    # ------------------------------------------------------------------ state dicts (accelerate's save_state)

    def _where(self) -> dict:
        """id(parameter) -> (unit, its name in the unit) of every trained parameter."""
        where = self._trained()
        return {id(p): where[n] for n, p in self.engine.module.named_parameters() if n in where}

    def _optimizer_state(self, optimizer, state: dict) -> dict:
        """``optimizer.state_dict()``: torch's AdamW format, its ``state`` filled from the engine's moments and
        step counts (the optimizer holds none itself), by the parameters' positions in its groups."""
        eng = self.engine
        eng.wait()
        where = self._where()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        out = {}
        with eng.sharding.full_state(eng.units, write_back=False):  # the full layout: every node's slices
            for i, p in enumerate(params):
                if id(p) not in where:
                    continue
                u, n = where[id(p)]
                out[i] = {
                    "step": torch.tensor(float(u.step.item()), dtype=torch.float32),
                    "exp_avg": u.layout.views(u.exp_avg)[n].detach().to("cpu", copy=True),
                    "exp_avg_sq": u.layout.views(u.exp_avg_sq)[n].detach().to("cpu", copy=True),
                }
        state["state"] = out
        return state

    def _optimizer_loaded(self, optimizer) -> None:
        """``optimizer.load_state_dict()``: the moments and step counts into the engine (the optimizer keeps
        none)."""
        eng = self.engine
        eng.wait()
        where = self._where()
        with eng.sharding.full_state(eng.units, write_back=True):  # the full layout: the node's slices kept
            for p, st in list(optimizer.state.items()):
                if id(p) not in where or "exp_avg" not in st:
                    continue
                u, n = where[id(p)]
                with torch.no_grad():
                    u.layout.views(u.exp_avg)[n].copy_(st["exp_avg"])
                    u.layout.views(u.exp_avg_sq)[n].copy_(st["exp_avg_sq"])
                    u.step.fill_(float(st["step"]))
        optimizer.state.clear()  # (moments have no derived copies: the gradients of a step in progress stay)

    def module_loaded(self) -> None:
        """The module's parameters were written in place (``load_state_dict``): the host optimizer's masters are
        those views; a device-optimized unit's master takes its host mirror; every copy follows."""
        eng = self.engine
        with torch.no_grad():
            for u in eng.units:
                if u.optimizer_on_device and u.host is not None and u.host is not u.master and not u.shard_state:
                    u.master.copy_(u.host)
        eng.sharding.slices.written_whole()  # the full layout: the other nodes' slices handed back at the next upload
        eng.weights_loaded()


class _OneGroup:
    """The user's optimizer as ClientSchedule's carrier: its groups (the same settings each) as the engine's one."""

    def __init__(self, optimizer):
        self.inner = optimizer

    @property
    def param_groups(self):
        return self.inner.param_groups[:1]


def check_optimizer(opt, loop: UserLoop) -> None:
    """Refuse (:class:`UserLoopError`) an optimizer the engine cannot stand in for, by name."""
    name = type(opt).__name__
    if not isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)):
        raise UserLoopError(
            f"{name}: zerofit's engine steps AdamW (torch.optim.AdamW, or Adam without weight decay); use one of them"
        )
    groups = opt.param_groups
    for i, g in enumerate(groups):
        if g.get("amsgrad") or g.get("maximize"):
            raise UserLoopError(f"{name}.param_groups[{i}]: amsgrad / maximize are not zerofit's AdamW")
        if isinstance(opt, torch.optim.Adam) and not isinstance(opt, torch.optim.AdamW) and g["weight_decay"]:
            raise UserLoopError(
                f"torch.optim.Adam with weight_decay {g['weight_decay']} (L2 added to the gradient) "
                "is not AdamW's decoupled decay: use torch.optim.AdamW"
            )
    keys = ("lr", "betas", "eps", "weight_decay")
    if any(tuple(g[k] for k in keys) != tuple(groups[0][k] for k in keys) for g in groups[1:]):
        raise UserLoopError(
            f"{name}: param groups with different settings; the engine's groups are fixed when it "
            "is built: give them in zerofit_config (optimizer) or train with one group"
        )
    ids = {id(p) for g in groups for p in g["params"]}
    if ids & {id(p) for p in loop._originals}:
        raise UserLoopError(
            f"{name} was built over the model's parameters before it was wrapped: those are not "
            "the ones trained now; build the optimizer over the wrapped model's parameters "
            "(FSDP asks the same)"
        )
    trained = {id(p) for p in loop.engine.module.parameters() if p.requires_grad}
    if not trained <= ids:
        raise UserLoopError(
            f"{name} holds {len(ids & trained)} of the model's {len(trained)} trained parameters: "
            "zerofit trains every parameter with requires_grad; freeze the others"
        )


def _loop_of(params) -> UserLoop | None:
    ids = {id(p) for p in params}
    for loop in list(_LIVE):
        if ids & loop.params:
            return loop
    return None


def _one_loop(params, what: str) -> UserLoop | None:
    """The loop whose parameters ``params`` are, for ``what`` (a clip, an unscale) that the loop does over its own
    gradients only: refused by name where ``params`` also hold another loop's or plain trained parameters, whose
    gradients it would leave out ([Note: one wrapped model per optimizer])."""
    params = list(params)
    loop = _loop_of(params)
    if loop is None:
        return None
    others = [p for p in params if id(p) not in loop.params and p.requires_grad]
    if others:
        raise UserLoopError(
            f"{what} over the wrapped model's parameters and {len(others)} trained parameters "
            "outside it: zerofit's clip and unscale see the wrapped model's gradients only; wrap "
            "one module that holds every trained part (and call it, not its parts) "
            "([Note: one wrapped model per optimizer])"
        )
    return loop


def _step_post_hook(optimizer, args, kwargs):
    """After ``optimizer.step()`` (and the closure it ran: Lightning's forward and backward): the engine's step.
    Torch's own step before it found no ``.grad`` to apply."""
    loop = _loop_of(p for g in optimizer.param_groups for p in g["params"])
    if loop is not None:
        loop.on_step(optimizer)


def _step_pre_hook(optimizer, args, kwargs):
    loop = _loop_of(p for g in optimizer.param_groups for p in g["params"])
    if loop is not None:
        loop._follow(optimizer)  # refused (by name) before anything runs
    elif _LIVE:
        stale = [
            lp
            for lp in list(_LIVE)
            if any(id(p) in {id(o) for o in lp._originals} for g in optimizer.param_groups for p in g["params"])
        ]
        if stale:
            check_optimizer(optimizer, stale[0])  # raises: built before the wrap


def _zero_grad_of(original, params_of):
    """``original`` (Optimizer.zero_grad or Module.zero_grad), first telling the loop whose parameters its
    object holds ([Note: zero_grad])."""

    @functools.wraps(original)
    def zero_grad(self, *args, **kwargs):
        loop = _loop_of(params_of(self)) if _LIVE else None
        if loop is not None:
            loop.zero_grad()
        return original(self, *args, **kwargs)

    return zero_grad


def _install_hooks() -> None:
    with _LOCK:
        if _HOOKED:
            return
        torch.optim.Optimizer.zero_grad = _zero_grad_of(
            torch.optim.Optimizer.zero_grad, lambda opt: (p for g in opt.param_groups for p in g["params"])
        )
        nn.Module.zero_grad = _zero_grad_of(nn.Module.zero_grad, lambda module: module.parameters())
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _HOOKED.append(register_optimizer_step_pre_hook(_step_pre_hook))
        _HOOKED.append(register_optimizer_step_post_hook(_step_post_hook))
        import torch.nn.utils.clip_grad as clip_mod

        original = clip_mod.clip_grad_norm_

        @functools.wraps(original)
        def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            loop = _one_loop(params, "clip_grad_norm_")
            if loop is None:
                return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
            return loop.clip_grad_norm_(max_norm, norm_type)

        clip_mod.clip_grad_norm_ = clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
        _HOOKED.append(original)
        from torch.amp.grad_scaler import GradScaler
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        for cls in (GradScaler, ShardedGradScaler):  # fp16: a scaler's unscale_ of a loop's optimizer
            _patch_unscale(cls)


def _patch_accelerate() -> None:
    """Two of accelerate's methods, over a loop's model or parameters (patched once accelerate is imported, before
    the wrap, as its scripts import it: called at each wrap):

    - accelerate >= 1.16 computes a norm itself from ``p.grad`` (``Accelerator._clip_grad_norm_dtensor_aware``)
      instead of calling torch's ``clip_grad_norm_``: a loop's parameters hold no ``.grad`` (the gradients are the
      engine's), so it would find a norm of 0 and clip nothing. It comes to the loop's clip (accelerate's
      ``unscale_gradients`` has run before).
    - ``prepare_model`` under several processes (``accelerate launch``) wraps the model in DDP, whose hooks wait
      for ``.grad`` that never comes: a loop's model is prepared without it (as accelerate prepares FSDP's, which
      reduces its gradients itself), its autocast and the rest as usual; the engine averages the gradients over
      the ranks ([Note: sharded units])."""
    mod = sys.modules.get("accelerate.accelerator")
    cls = getattr(mod, "Accelerator", None) if mod is not None else None
    if cls is None:
        return
    prepare = cls.__dict__.get("prepare_model")
    if prepare is not None and not getattr(prepare, "_zerofit", False):

        @functools.wraps(prepare)
        def prepare_model(self, model, device_placement=None, evaluation_mode=False):
            if _loop_of(model.parameters()) is not None:
                evaluation_mode = True  # (accelerate: no DDP, no FSDP; the autocast and device as usual)
            return prepare(self, model, device_placement=device_placement, evaluation_mode=evaluation_mode)

        prepare_model._zerofit = True
        cls.prepare_model = prepare_model
    original = cls.__dict__.get("_clip_grad_norm_dtensor_aware")
    if original is None or getattr(original, "_zerofit", False):
        return

    @functools.wraps(original)
    def _clip_grad_norm_dtensor_aware(self, parameters, max_norm, norm_type=2, foreach=None):
        params = list(parameters)
        loop = _one_loop(params, "clip_grad_norm_")
        if loop is None:
            return original(self, params, max_norm, norm_type=norm_type, foreach=foreach)
        return loop.clip_grad_norm_(max_norm, norm_type)

    _clip_grad_norm_dtensor_aware._zerofit = True
    cls._clip_grad_norm_dtensor_aware = _clip_grad_norm_dtensor_aware


def _patch_lightning() -> None:
    """Lightning's DDP strategies (``Trainer(strategy="ddp", devices=N)``, Fabric's ``DDPStrategy``) wrap the module
    in DDP, whose hooks wait for ``.grad`` that the engine never writes: a module holding a loop's parameters is
    left unwrapped (the engine averages the gradients over the ranks itself, as FSDP does), and Fabric's
    ``no_backward_sync`` over it is a no-op (the engine sums the micro-batches until the step in any case); every
    other module as Lightning wraps it. Patched once Lightning is imported (the wrap runs in ``configure_model``, before
    the strategy's setup): called at each wrap."""
    trainer_ddp = sys.modules.get("lightning.pytorch.strategies.ddp")
    cls = getattr(trainer_ddp, "DDPStrategy", None) if trainer_ddp is not None else None
    original = cls.__dict__.get("configure_ddp") if cls is not None else None
    if original is not None and not getattr(original, "_zerofit", False):

        @functools.wraps(original)
        def configure_ddp(self):
            if _loop_of(self.model.parameters()) is None:
                return original(self)  # (no DDP, no DDP hooks: the model stays the LightningModule)

        configure_ddp._zerofit = True
        cls.configure_ddp = configure_ddp
    fabric_ddp = sys.modules.get("lightning.fabric.strategies.ddp")
    cls = getattr(fabric_ddp, "DDPStrategy", None) if fabric_ddp is not None else None
    original = cls.__dict__.get("setup_module") if cls is not None else None
    if original is not None and not getattr(original, "_zerofit", False):

        @functools.wraps(original)
        def setup_module(self, module):
            return module if _loop_of(module.parameters()) is not None else original(self, module)

        setup_module._zerofit = True
        cls.setup_module = setup_module
    control = getattr(fabric_ddp, "_DDPBackwardSyncControl", None) if fabric_ddp is not None else None
    original = control.__dict__.get("no_backward_sync") if control is not None else None
    if original is not None and not getattr(original, "_zerofit", False):

        @functools.wraps(original)
        def no_backward_sync(self, module, enabled):
            if _loop_of(module.parameters()) is not None:  # the engine sums until the step anyway
                return contextlib.nullcontext()
            return original(self, module, enabled)

        no_backward_sync._zerofit = True
        control.no_backward_sync = no_backward_sync


def _patch_unscale(cls) -> None:
    original = cls.__dict__["_unscale_grads_"]

    @functools.wraps(original)
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        loop = _one_loop((p for g in optimizer.param_groups for p in g["params"]), "a GradScaler's unscale_")
        if loop is None:
            return original(self, optimizer, inv_scale, found_inf, allow_fp16)
        return loop.unscale(optimizer, inv_scale, found_inf)

    cls._unscale_grads_ = _unscale_grads_
