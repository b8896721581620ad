"""Every callable of torch, accelerate and Lightning that zerofit replaces in the process, and the hooks it registers
with torch: :data:`PATCHES` lists them (docs/fsdp.md, "What zerofit replaces in your process", prints it), and each
goes in through :func:`_install`, which records it, so that :func:`installed` is the truth the table is checked
against (tests/integration/test_userloop_patches.py).

[Note: the process-wide patches]
A loop's parameters never hold a ``.grad`` (the gradients are the engine's): code that reads ``.grad`` (torch's
clip, a GradScaler's unscale, accelerate's own norm, DDP's reducer) would find nothing, and ``optimizer.step()``
would update nothing. So the callables that code goes through are replaced, process-wide, by ones that ask the
registry of live loops (loop.py) whether their parameters are a loop's: where they are, the loop does the work on
the engine's gradients; where not (every other model in the process), the original runs with the arguments it was
given. Each replacement is installed once: the torch group at the first wrap (``UserLoop``: zerofit.fsdp's
``FullyShardedDataParallel`` and ``fully_shard``), accelerate's and Lightning's at each wrap where their modules are
imported by then (their scripts import them before they wrap), once per class. Importing zerofit replaces nothing.

``ZEROFIT_PATCHES`` (unset: every group) is a comma list of the groups to install (``torch,accelerate,lightning``)
or ``none``. A group left out is never installed. The loop cannot run without the torch group (its step and
zero_grad reach the engine through it): a wrap refuses, naming the variable. Without accelerate's or Lightning's
group, what breaks is in the table's ``without``; it cannot be seen where it happens (the original finds no
``.grad``), so it is not refused.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import threading
from typing import Any, NamedTuple

import torch

from zerofit.userloop.live import LIVE, loop_of, offering
from zerofit.userloop.loop import UserLoopError
from zerofit.userloop.optimizer import step_post_hook, step_pre_hook, zero_grad_of

ENV = "ZEROFIT_PATCHES"
GROUPS = ("torch", "accelerate", "lightning")


class Patch(NamedTuple):
    """One replaced callable (or registered hook): its ``group`` (``ZEROFIT_PATCHES``), what zerofit's replacement
    ``does``, ``when`` it is installed, and what breaks ``without`` it."""

    group: str
    does: str
    when: str
    without: str


_FIRST_WRAP = "the first wrap in the process (zerofit.fsdp's FullyShardedDataParallel or fully_shard), once"
_ACCELERATE_WRAP = "each wrap where accelerate.accelerator is imported by then (its scripts import it first), once"
_LIGHTNING_WRAP = "each wrap where Lightning is imported by then (the wrap runs in configure_model), once"
_NO_TORCH = "the loop does not run: a wrap refuses, naming ZEROFIT_PATCHES"

# owner (the replaced callable, or what a hook hooks) -> Patch; the docs' table (docs/fsdp.md) is this one
PATCHES: dict[str, Patch] = {
    "torch.optim.Optimizer.step (global pre-hook)": Patch(
        "torch",
        "before any optimizer's step: an optimizer over a loop's parameters is checked (refused by name: not AdamW, "
        "param groups that differ, two wrapped models), one built before the wrap over parameters the model no "
        "longer holds (a meta model's) is refused",
        _FIRST_WRAP,
        _NO_TORCH,
    ),
    "torch.optim.Optimizer.step (global post-hook)": Patch(
        "torch",
        "after an optimizer's step (and its closure): over a loop's parameters, the engine's step with the "
        "optimizer's settings at that moment (torch's own step found no .grad)",
        _FIRST_WRAP,
        _NO_TORCH,
    ),
    "torch.optim.Optimizer.zero_grad": Patch(
        "torch",
        "over a loop's parameters, tells the loop first (a step's end; a skipped step dropped); then torch's",
        _FIRST_WRAP,
        _NO_TORCH,
    ),
    "torch.nn.Module.zero_grad": Patch(
        "torch",
        "over a module holding a loop's parameters, tells the loop first (as the optimizer's); then torch's",
        _FIRST_WRAP,
        _NO_TORCH,
    ),
    "torch.nn.utils.clip_grad_norm_": Patch(
        "torch",
        "over a loop's parameters, the loop clips the engine's gradients with torch's arithmetic and returns the "
        "norm (also set as torch.nn.utils.clip_grad.clip_grad_norm_); other parameters: torch's",
        _FIRST_WRAP,
        _NO_TORCH,
    ),
    "torch.amp.GradScaler._unscale_grads_": Patch(
        "torch",
        "a scaler's unscale_ of a loop's optimizer unscales and checks the engine's gradients with torch's kernel "
        "(torch.cuda.amp.GradScaler inherits it); other optimizers: torch's",
        _FIRST_WRAP,
        _NO_TORCH,
    ),
    "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler._unscale_grads_": Patch(
        "torch",
        "as GradScaler's, for FSDP's ShardedGradScaler (its own _unscale_grads_)",
        _FIRST_WRAP,
        _NO_TORCH,
    ),
    "torch.utils.data.dataloader._BaseDataLoaderIter.__next__": Patch(
        "torch",
        "at the start of a loop's accumulation window of G > 1 micro-batches, a DataLoader's next batch also reads "
        "the window's other G - 1 from the same iterator (yielded in order, as before) and offers them to the loop: "
        "if its next forward is for the first of them, the G forwards run at once, each streamed block uploaded "
        "once for all of them; any other forward drops the offer (docs/fsdp.md); other times: torch's",
        _FIRST_WRAP,
        "each micro-batch's forward uploads every streamed block again (G + 1 uploads a step where train_batch "
        "makes 2)",
    ),
    "accelerate.Accelerator.prepare_model": Patch(
        "accelerate",
        "a loop's model is prepared without DDP (as accelerate prepares FSDP's: the engine averages the gradients "
        "over the ranks), its autocast and device as usual; other models: accelerate's",
        _ACCELERATE_WRAP,
        "under several processes (accelerate launch) DDP wraps the loop's model and its hooks wait for .grad that "
        "never comes; one process: nothing",
    ),
    "accelerate.Accelerator._clip_grad_norm_dtensor_aware": Patch(
        "accelerate",
        "accelerator.clip_grad_norm_ over a loop's parameters comes to the loop's clip (accelerate >= 1.16 computes "
        "the norm from p.grad itself); other parameters: accelerate's",
        _ACCELERATE_WRAP,
        "accelerate >= 1.16: accelerator.clip_grad_norm_ finds no .grad, returns a norm of 0 and clips nothing, "
        "silently",
    ),
    "lightning.pytorch.strategies.DDPStrategy.configure_ddp": Patch(
        "lightning",
        "a Trainer's DDP strategy leaves a LightningModule holding a loop's parameters unwrapped (the engine "
        "averages the gradients over the ranks); other modules: Lightning's",
        _LIGHTNING_WRAP,
        "Trainer(strategy='ddp', devices=N): DDP wraps the module and its hooks wait for .grad that never comes",
    ),
    "lightning.fabric.strategies.DDPStrategy.setup_module": Patch(
        "lightning",
        "Fabric's DDP strategy returns a module holding a loop's parameters as it is; other modules: Lightning's",
        _LIGHTNING_WRAP,
        "Fabric with DDP: as the Trainer's",
    ),
    "lightning.fabric.strategies.ddp._DDPBackwardSyncControl.no_backward_sync": Patch(
        "lightning",
        "Fabric's no_backward_sync over a loop's module is a no-op (the engine sums the micro-batches until the "
        "step anyway); other modules: Lightning's",
        _LIGHTNING_WRAP,
        "Fabric with DDP: no_backward_sync expects a DDP module",
    ),
}


class Installed(NamedTuple):
    """An installed entry of :data:`PATCHES`: the ``original`` replaced (None for a hook), the ``replacement`` (the
    hook), ``where`` it was set ((holder, attribute) pairs; none for a hook) and the hook's ``handle``."""

    patch: Patch
    original: Any
    replacement: Any
    where: tuple
    handle: Any = None


_INSTALLED: dict[str, Installed] = {}
_LOCK = threading.Lock()


def enabled() -> frozenset:
    """The groups ``ZEROFIT_PATCHES`` names (unset, empty or ``all``: every group; ``none``: no group)."""
    raw = os.environ.get(ENV)
    if raw is None or raw.strip().lower() in ("", "all"):
        return frozenset(GROUPS)
    names = {n.strip().lower() for n in raw.split(",") if n.strip()}
    if names == {"none"}:
        return frozenset()
    unknown = names - set(GROUPS)
    if unknown:
        raise UserLoopError(
            f"{ENV}={raw!r}: no group {', '.join(sorted(unknown))}; give a comma list of {', '.join(GROUPS)} "
            "(the groups of callables zerofit replaces, docs/fsdp.md), or none"
        )
    return frozenset(names)


def installed() -> dict[str, Installed]:
    """The patches installed in this process so far: owner (a key of :data:`PATCHES`) -> :class:`Installed`."""
    return dict(_INSTALLED)


def _install(owner: str, make, *where: tuple, register=None):
    """The one way zerofit replaces a third-party callable or registers a process-wide hook, recorded under ``owner``
    (a key of :data:`PATCHES`: a replacement missing from the table is a KeyError, so the table stays the truth).
    Replaced: ``make(original)`` set as the attribute of each (holder, name) in ``where``, the original taken from
    the first holder's own namespace; registered: ``make(None)`` handed to ``register`` (torch's hook API). Nothing
    where ``ZEROFIT_PATCHES`` leaves the owner's group out; returns the replacement (or None)."""
    patch = PATCHES[owner]
    if patch.group not in enabled():
        return None
    if register is not None:
        hook = make(None)
        _INSTALLED[owner] = Installed(patch, None, hook, (), register(hook))
        return hook
    holder, name = where[0]
    original = vars(holder)[name]
    replacement = make(original)
    for holder, name in where:
        setattr(holder, name, replacement)
    _INSTALLED[owner] = Installed(patch, original, replacement, tuple(where))
    return replacement


def require_torch() -> None:
    """Refuse a wrap (:class:`UserLoopError`, naming ``ZEROFIT_PATCHES``) where the torch group is neither installed
    nor to be: the loop's step, zero_grad, clip and unscale reach the engine through it."""
    if _TORCH or "torch" in enabled():
        return
    raise UserLoopError(
        f"{ENV}={os.environ.get(ENV)!r} leaves out the torch group, and the user's loop runs through it: "
        "optimizer.step() takes the engine's step in torch's step hooks, zero_grad() ends the step, "
        "torch.nn.utils.clip_grad_norm_ and a GradScaler's unscale_ reach the engine's gradients (the model's "
        "parameters hold no .grad); without it optimizer.step() would update nothing. Add torch to "
        f"{ENV} (or unset it) to wrap a model with zerofit.fsdp (docs/fsdp.md, 'What zerofit replaces in your process')"
    )


def install() -> None:
    """A wrap's patches: the torch group's (once), accelerate's and Lightning's where imported (once per class)."""
    _install_hooks()
    _patch_accelerate()
    _patch_lightning()


def _one_loop(params, what: str):
    """The loop whose parameters ``params`` are, for ``what`` (a clip, an unscale) that the loop does over its own
    gradients only: refused by name where ``params`` also hold another loop's or plain trained parameters, whose
    gradients it would leave out ([Note: one wrapped model per optimizer])."""
    params = list(params)
    loop = loop_of(params)
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


_TORCH: list = []  # non-empty once the torch group is installed: once per process


def _install_hooks() -> None:
    """The torch group, once per process (none of it where ``ZEROFIT_PATCHES`` leaves it out)."""
    with _LOCK:
        if _TORCH or "torch" not in enabled():
            return
        _install(
            "torch.optim.Optimizer.zero_grad",
            lambda original: zero_grad_of(original, lambda opt: (p for g in opt.param_groups for p in g["params"])),
            (torch.optim.Optimizer, "zero_grad"),
        )
        _install(
            "torch.nn.Module.zero_grad",
            lambda original: zero_grad_of(original, lambda module: module.parameters()),
            (torch.nn.Module, "zero_grad"),
        )
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _install(
            "torch.optim.Optimizer.step (global pre-hook)",
            lambda _: step_pre_hook,
            register=register_optimizer_step_pre_hook,
        )
        _install(
            "torch.optim.Optimizer.step (global post-hook)",
            lambda _: step_post_hook,
            register=register_optimizer_step_post_hook,
        )
        import torch.nn.utils.clip_grad as clip_mod

        _install(
            "torch.nn.utils.clip_grad_norm_",
            _clip_grad_norm_of,
            (clip_mod, "clip_grad_norm_"),
            (torch.nn.utils, "clip_grad_norm_"),
        )
        from torch.amp.grad_scaler import GradScaler
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # fp16: a scaler's unscale_ of a loop's optimizer
        _install("torch.amp.GradScaler._unscale_grads_", _unscale_grads_of, (GradScaler, "_unscale_grads_"))
        _install(
            "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler._unscale_grads_",
            _unscale_grads_of,
            (ShardedGradScaler, "_unscale_grads_"),
        )
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        # [Note: the loop's loader reads the window ahead] (loop.py)
        _install(
            "torch.utils.data.dataloader._BaseDataLoaderIter.__next__",
            _loader_next_of,
            (_BaseDataLoaderIter, "__next__"),
        )
        _TORCH.append(True)


AHEAD = "_zerofit_ahead"  # an iterator's batches read ahead for a loop's window, yielded first


def _loader_next_of(original):
    @functools.wraps(original)
    def __next__(self):
        ahead = self.__dict__.get(AHEAD)
        if ahead:
            return ahead.popleft()
        item = original(self)
        loop = offering() if LIVE else None
        if loop is not None:
            loop.read_ahead(item, lambda: original(self), self.__dict__.setdefault(AHEAD, collections.deque()))
        return item

    return __next__


def _clip_grad_norm_of(original):
    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        loop = _one_loop(params, "clip_grad_norm_")
        if loop is None:
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return loop.clip_grad_norm_(max_norm, norm_type)

    return clip_grad_norm_


def _unscale_grads_of(original):
    @functools.wraps(original)
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        loop = _one_loop((p for g in optimizer.param_groups for p in g["params"]), "a GradScaler's unscale_")
        if loop is None:
            return original(self, optimizer, inv_scale, found_inf, allow_fp16)
        return loop.unscale(optimizer, inv_scale, found_inf)

    return _unscale_grads_


def _fresh(cls, name: str) -> bool:
    """``cls`` holds ``name`` itself and it is not zerofit's replacement already (a class patched once; a module
    imported again has a new class, patched again)."""
    original = cls.__dict__.get(name) if cls is not None else None
    return original is not None and not getattr(original, "_zerofit", False)


def _marked(fn):
    fn._zerofit = True
    return fn


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
    if "accelerate" not in enabled():
        return
    mod = sys.modules.get("accelerate.accelerator")
    cls = getattr(mod, "Accelerator", None) if mod is not None else None
    if cls is None:
        return
    if _fresh(cls, "prepare_model"):

        def make(prepare):
            @functools.wraps(prepare)
            def prepare_model(self, model, device_placement=None, evaluation_mode=False):
                if loop_of(model.parameters()) is not None:
                    evaluation_mode = True  # (accelerate: no DDP, no FSDP; the autocast and device as usual)
                return prepare(self, model, device_placement=device_placement, evaluation_mode=evaluation_mode)

            return _marked(prepare_model)

        _install("accelerate.Accelerator.prepare_model", make, (cls, "prepare_model"))
    if not _fresh(cls, "_clip_grad_norm_dtensor_aware"):
        return

    def make(original):
        @functools.wraps(original)
        def _clip_grad_norm_dtensor_aware(self, parameters, max_norm, norm_type=2, foreach=None):
            params = list(parameters)
            loop = _one_loop(params, "clip_grad_norm_")
            if loop is None:
                return original(self, params, max_norm, norm_type=norm_type, foreach=foreach)
            return loop.clip_grad_norm_(max_norm, norm_type)

        return _marked(_clip_grad_norm_dtensor_aware)

    _install("accelerate.Accelerator._clip_grad_norm_dtensor_aware", make, (cls, "_clip_grad_norm_dtensor_aware"))


def _patch_lightning() -> None:
    """Lightning's DDP strategies (``Trainer(strategy="ddp", devices=N)``, Fabric's ``DDPStrategy``) wrap the module
    in DDP, whose hooks wait for ``.grad`` that the engine never writes: a module holding a loop's parameters is
    left unwrapped (the engine averages the gradients over the ranks itself, as FSDP does), and Fabric's
    ``no_backward_sync`` over it is a no-op (the engine sums the micro-batches until the step in any case); every
    other module as Lightning wraps it. Patched once Lightning is imported (the wrap runs in ``configure_model``, before
    the strategy's setup): called at each wrap."""
    if "lightning" not in enabled():
        return
    trainer_ddp = sys.modules.get("lightning.pytorch.strategies.ddp")
    cls = getattr(trainer_ddp, "DDPStrategy", None) if trainer_ddp is not None else None
    if _fresh(cls, "configure_ddp"):

        def make(original):
            @functools.wraps(original)
            def configure_ddp(self):
                if loop_of(self.model.parameters()) is None:
                    return original(self)  # (no DDP, no DDP hooks: the model stays the LightningModule)

            return _marked(configure_ddp)

        _install("lightning.pytorch.strategies.DDPStrategy.configure_ddp", make, (cls, "configure_ddp"))
    fabric_ddp = sys.modules.get("lightning.fabric.strategies.ddp")
    cls = getattr(fabric_ddp, "DDPStrategy", None) if fabric_ddp is not None else None
    if _fresh(cls, "setup_module"):

        def make(original):
            @functools.wraps(original)
            def setup_module(self, module):
                return module if loop_of(module.parameters()) is not None else original(self, module)

            return _marked(setup_module)

        _install("lightning.fabric.strategies.DDPStrategy.setup_module", make, (cls, "setup_module"))
    control = getattr(fabric_ddp, "_DDPBackwardSyncControl", None) if fabric_ddp is not None else None
    if _fresh(control, "no_backward_sync"):

        def make(original):
            @functools.wraps(original)
            def no_backward_sync(self, module, enabled):
                if loop_of(module.parameters()) is not None:  # the engine sums until the step anyway
                    return contextlib.nullcontext()
                return original(self, module, enabled)

            return _marked(no_backward_sync)

        _install(
            "lightning.fabric.strategies.ddp._DDPBackwardSyncControl.no_backward_sync",
            make,
            (control, "no_backward_sync"),
        )
