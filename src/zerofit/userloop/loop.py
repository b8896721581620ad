"""The loop's engine: :class:`UserLoop` (forward, the autograd seed of the backward, clip, a GradScaler's unscale,
the step, zero_grad, the learnt window, the followed optimizer's state dicts), registered in the live loops
(live.py) that the optimizer's hooks (optimizer.py) and the patched callables (patches.py) look a parameter's loop
up in ([Note: the user's loop drives the engine], zerofit/userloop/__init__.py)."""

from __future__ import annotations

import collections
import contextlib
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from zerofit.engine.faces.user_loop import UserLoopFace
from zerofit.errors import InputError
from zerofit.userloop.live import LIVE

log = logging.getLogger("zerofit")


def autocast_state() -> tuple:
    """The autocast in force: ((device type, dtype), ...) of each device type where it is enabled."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


def autocast(state: tuple):
    """``state`` (``autocast_state()``) entered again: the forward's autocast for its recompute and backward, as
    torch.utils.checkpoint restores it."""
    stack = contextlib.ExitStack()
    for device, dtype in state:
        stack.enter_context(torch.autocast(device, dtype=dtype))
    return stack


class UserLoopError(InputError, ValueError):
    """A user loop zerofit cannot run as written; the message says what to change."""


class Seed(torch.autograd.Function):
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
        from zerofit.userloop import patches

        # the loop reaches the engine through the torch group's hooks and patches: refused by name where
        # ZEROFIT_PATCHES leaves them out (patches.py)
        patches.require_torch()
        cfg = {**dict(config), "managed_gradient_accumulation": False}
        if cfg.get("precision") == "fp16":  # the user's GradScaler scales the loss: the engine's scale stays 1
            cfg["fp16"] = {**cfg.get("fp16", {}), "loss_scale": 1.0}
        cfg.setdefault("offload", {})
        # assisted updates as the plan has room for them (the device's AdamW takes each update's settings when it
        # runs: the step's, from the user's optimizer); updates in the backward where a step's factor is known
        # before it ([Note: updates in the backward of the user's loop])
        self._originals = weakref.WeakSet(module.parameters())
        self.engine = Engine.create(module, cfg, user_loop=True)
        self.face = UserLoopFace(self.engine)  # every call on the engine's parts goes through it
        # any number of micro-batches per step with a window of one (each micro-batch's blocks backward at its own
        # backward(): the sums come in plain autograd's order); a window of G > 1 holds exactly the loop's G
        self.face.start()
        # [Note: the window learns the loop's G]: with the default window, from the first step's micro-batches
        self.learn_window = self.engine.config.gradient_accumulation_steps == 1 and self.face.streaming
        self.params = {id(p) for p in self.engine.module.parameters()}
        self.prepared = None  # the step prepared by a clip, applied at optimizer.step()
        self.uncleared = False  # a step ran and no zero_grad() since: [Note: zero_grad]
        self.optimizer = None
        self.inside = False  # the engine is running the model's own forward
        self.amp = ()  # the last forward's autocast: (device type, dtype), ...
        self.cast_inputs = None  # a dtype the floating inputs take (FSDP's mixed precision)
        patches.install()
        LIVE.add(self)

    def read_ahead(self, first, more: Callable[[], Any], into: collections.deque) -> None:
        """[Note: the loop's loader reads the window ahead]
        A loop's micro-batches come one at a time (``model(**batch)``, ``loss.backward()``, the next), so each
        forward would upload every streamed block again: G + 1 uploads a step where ``train_batch`` makes 2. Where
        they come from a DataLoader (patches.py), the loader's next batch at the start of a window of G > 1 (after
        the step, nothing pending) also reads the window's other G - 1 from the same iterator, into ``into`` (the
        loop gets them from there, in order, as it would have), and the window is offered copies of them: if the
        window's first forward is for the first of them, its G forwards run at once, block-major, each streamed
        block uploaded once for all of them ([Note: a window's forwards at once], step/window.py), and each later
        forward whose inputs equal the next one's takes its forward made; the losses are those of the forwards
        the loop runs, computed from the same inputs with the same weights. A forward with other inputs (a loop
        that changes a batch first, a loader of another use) drops what is left, made again one at a time: at
        worst wasted work, never another number. Only batches that are mappings (``model(**batch)``) are offered;
        the copies are the offer's own, so a batch the loop changes in place is seen as changed."""
        if not isinstance(first, Mapping):
            return
        for _ in range(self.face.window_size - 1):
            try:
                into.append(more())
            except StopIteration:
                break
        batches = [first, *into]
        if all(isinstance(b, Mapping) for b in batches):  # (the window takes no offer of one batch)
            own = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]
            self.face.offer(own)

    def replaced(self) -> set[int]:
        """The ids of the model's parameters before the wrap that it no longer holds: an optimizer over them trains
        nothing. The engine keeps the parameter objects it can ([Note: the model's parameter objects],
        materialize.py): those of a model built on the meta device are new."""
        return {id(p) for p in self._originals} - self.params

    # ------------------------------------------------------------------ forward and backward

    def forward(self, *args, **kwargs):
        eng = self.engine
        G = eng.config.gradient_accumulation_steps
        if G > 1 and self.face.micro_steps >= G and torch.is_grad_enabled():
            raise UserLoopError(
                f"micro-batch {G + 1} of a step with zerofit_config gradient_accumulation_steps {G}: "
                "the window holds that many micro-batches before their blocks' backward, and "
                "summing a second window onto the first changes the order of the sums; set it to "
                "the loop's accumulation steps, or to 1 (any number, each micro-batch's blocks "
                "backward at its own backward())"
            )
        amp = autocast_state()
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
        # a forward after the held micro-batches (a tail, or one without grad): their blocks' backward comes first
        if self.face.holding:  # (``_autocast`` enters its contexts as it is made)
            self.face.backward_held(autocast(self.amp))
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
            out = self.face.forward(*args, **kwargs)
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
        for i, t in zip(seeded, Seed.apply(self, anchor, tuple(leaves[i] for i in seeded))):
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
        with torch.enable_grad(), autocast(self.amp):  # (autograd runs a Function's backward with grad off)
            objective = None
            for t, g in zip(outputs, grads):
                if g is None:
                    continue
                part = (t * g).sum()
                objective = part if objective is None else objective + part
            if objective is not None:
                self.face.backward(objective)

    # ------------------------------------------------------------------ the step

    def _prepare(self, factor_known: bool = False, clip: float | None = None) -> None:
        """The step up to its updates (Step.prepare): the held micro-batches' blocks backward, every gradient
        complete, the global norm (fp16: the overflow check). ``factor_known``: from ``optimizer.step()`` with no
        clip or unscale before it ([Note: updates in the backward of the user's loop], update/speculation.py);
        ``clip``: from a clip to that norm ([Note: a speculated cast])."""
        if self.face.micro_steps == 0:
            raise UserLoopError(
                "optimizer.step() (or clip_grad_norm_, unscale_) without a backward since the last "
                "step: the engine has no gradient to apply (a loop that steps twice, or whose loss "
                "did not come from the wrapped model's output)"
            )
        self.prepared = self.face.prepare(autocast(self.amp), factor_known, clip)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """This step's gradients clipped to ``max_norm`` in place, as torch's ``clip_grad_norm_`` clips them
        (Step.clip_as_torch); their global norm."""
        if float(norm_type) != 2.0:
            raise UserLoopError(f"clip_grad_norm_(norm_type={norm_type}): zerofit clips by the L2 norm")
        if self.prepared is None:
            self._prepare(clip=float(max_norm))
        return torch.tensor(self.face.clip_as_torch(float(max_norm), self.prepared), dtype=torch.float32)

    def unscale(self, optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> dict:
        """A ``GradScaler``'s ``unscale_`` of ``optimizer``: the engine's gradients unscaled in place and checked,
        with torch's own kernel (``_amp_foreach_non_finite_check_and_unscale_``), per device: what the scaler's
        ``_unscale_grads_`` returns."""
        self._follow(optimizer)
        if self.prepared is None:
            self._prepare()
        by_device: dict = {}
        for g in self.face.grad_views(self.prepared):
            by_device.setdefault(g.device, []).append(g)
        out = {}
        with torch.no_grad():
            for dev, grads in by_device.items():
                fi = found_inf.to(dev, copy=True)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, fi, inv_scale.to(dev, copy=True))
                out[dev] = fi
            if self.face.many_ranks:  # each rank holds its shards: an overflow on one skips the step on every rank
                anywhere = self.face.any_rank(list(out.values()))
                for dev, fi in out.items():
                    fi.copy_(anywhere.to(fi.dtype).to(dev).reshape(fi.shape))
        return out

    def _skipped(self) -> None:
        """A prepared step whose ``optimizer.step()`` never came (a GradScaler found an overflow): not applied."""
        prepared, self.prepared = self.prepared, None
        n = self.face.micro_steps
        self.face.skip(prepared)
        self._learn_window(n)

    def on_step(self, optimizer) -> None:
        """The user's ``optimizer.step()``: the engine's updates, with the optimizer's settings now. A GradScaler
        stepping a fused optimizer leaves the unscaling and the overflow skip to it (``optimizer.grad_scale``,
        ``optimizer.found_inf``, as torch's fused kernel reads them): the engine does the same."""
        self._follow(optimizer)
        found_inf, grad_scale = getattr(optimizer, "found_inf", None), getattr(optimizer, "grad_scale", None)
        if self.prepared is None:
            self._prepare(factor_known=found_inf is None and grad_scale is None)
        self.uncleared = True
        if found_inf is not None and float(found_inf) > 0:
            self._skipped()
            return
        prepared, self.prepared = self.prepared, None
        if grad_scale is not None:  # the fused kernel's own unscaling: grad / grad_scale
            prepared = prepared._replace(factor=prepared.factor / float(grad_scale))
        n = self.face.micro_steps
        self.face.apply(prepared)
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
        elif self.face.micro_steps:
            raise UserLoopError(
                f"zero_grad() after {self.face.micro_steps} backward() of a step and "
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
        k, why = self.face.hold(n)
        if not k:
            log.info(
                "zerofit: the loop's %d micro-batches per step do not fit the checkpoints of 2 of them in the "
                "plan; each micro-batch's blocks run their backward at its own backward() (%s)",
                n,
                why,
            )
            return
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
        from zerofit.userloop.optimizer import OneGroup, check_optimizer

        check_optimizer(optimizer, self)
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if any(ids & loop.params for loop in list(LIVE) if loop is not self):
            raise UserLoopError(
                f"{type(optimizer).__name__} holds the parameters of two wrapped models: each "
                "wrapper's engine steps its own model at optimizer.step(); wrap one module that "
                "holds them both and call it ([Note: one wrapped model per optimizer])"
            )
        carrier = OneGroup(optimizer)
        self.face.follow_schedule(ClientSchedule(carrier, None, self.engine.config.train_batch_size))
        optimizer.register_state_dict_post_hook(self._optimizer_state)
        optimizer.register_load_state_dict_post_hook(self._optimizer_loaded)
        self.optimizer = optimizer
        if optimizer.state:  # loaded before its first step (accelerate's load_state): the engine's now
            self._optimizer_loaded(optimizer)

    # ------------------------------------------------------------------ state dicts (accelerate's save_state)

    def _where(self) -> dict:
        """id(parameter) -> (unit, its name in the unit) of every trained parameter."""
        where = self.face.trained()
        return {id(p): where[n] for n, p in self.engine.module.named_parameters() if n in where}

    def _optimizer_state(self, optimizer, state: dict) -> dict:
        """``optimizer.state_dict()``: torch's AdamW format, its ``state`` filled from the engine's moments and
        step counts (the optimizer holds none itself), by the parameters' positions in its groups."""
        where = self._where()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        out = {}
        with self.face.full_state(write_back=False):  # the full layout: every node's slices
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
        where = self._where()
        with self.face.full_state(write_back=True):  # the full layout: the node's slices kept
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
        self.face.module_loaded()
