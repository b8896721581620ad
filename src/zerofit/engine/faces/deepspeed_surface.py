"""DeepSpeed's engine surface on zerofit's engine: the names a DeepSpeed training script calls (a face the engine
holds, ``engine.deepspeed``).

:class:`DeepSpeedFace` holds the engine and gives it DeepSpeed's loop (``engine(**batch)``, ``backward``, ``step``,
``set_gradient_accumulation_boundary``) and the rest of what scripts written for ``deepspeed.initialize`` read or
call, with DeepSpeed's meaning (deepspeed/runtime/engine.py, read at commit
38327e07f6cd39b63418f60cedd1651b0be3e7c3): the step counters, the accumulation boundary, the learning rate, the
batch sizes, the data loader, and the optimizer and scheduler objects :func:`zerofit.deepspeed.initialize`
returns (views.py's, with DeepSpeed's refusals). What the door knows is the face's :class:`DeepSpeedRecord`
(``record``); everything else it reads from the engine's parts. The engine serves the face's names as its own
(:func:`served_by_face`); every other name of DeepSpeed's engine raises :class:`UnsupportedAttribute`
(deepspeed_names.py), and a name the model has is read from the model as it is (no wait: no attribute read is a
collective).

[Note: DeepSpeed's accumulation boundary]
DeepSpeed counts ``micro_steps`` in ``step()``, which scripts call after every micro-batch, and
``is_gradient_accumulation_boundary()`` is ``(micro_steps + 1) % gradient_accumulation_steps == 0``: true
during the forward, backward and step of the *last* micro-batch of an accumulation (always, with one).
zerofit's engine counts backward()s since the optimizer step (``Window.micro_steps``, reset by the step and by a
dropped accumulation); the micro-batch being worked on is that count, less one between a backward() and
its step() (``DeepSpeedRecord.unstepped`` holds the count the last backward() left, until step() clears it).
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader

from zerofit.engine.faces import offload_states as offloading
from zerofit.engine.faces.deepspeed_names import (
    ONE_PROCESS,  # noqa: F401 (re-exported)
    DeepSpeedAssertion,  # noqa: F401 (re-exported)
    DeepSpeedUnsupported,
    UnsupportedAttribute,  # noqa: F401 (re-exported)
    deepspeed_hint,
    refuse_attribute,
)
from zerofit.engine.faces.deepspeed_views import DeepSpeedOptimizer, DeepSpeedScheduler  # noqa: F401 (their old home)
from zerofit.engine.step.batch import check_batch

if TYPE_CHECKING:
    from zerofit.engine.engine import Engine
    from zerofit.engine.faces.deepspeed_views import ThroughputTimerView

log = logging.getLogger("zerofit")


class _WindowLoader(DataLoader):
    """DeepSpeed's training loader (``deepspeed_io``, the loader ``initialize(training_data=...)`` returns).

    [Note: the loader reads the window ahead]
    The DeepSpeed tutorial loop draws its micro-batches from this loader. When the engine is at the start of an
    accumulation window (the last step() taken, nothing pending), fetching the window's first micro-batch also
    fetches the rest of the window from the underlying loader (the same batches, in the same order) and offers
    them to the engine; if the next ``engine(**batch)`` is for the first of them, the engine makes the window's
    forwards at once ([Note: a window's forwards at once], window.py), as ``forward_window`` does. The
    loop yields the batches as always; a loop that changes the batches before calling the engine gets no
    offer taken, and runs as without it."""

    zerofit_engine = None  # weakref.ref to the engine

    def __iter__(self):
        it = super().__iter__()
        ahead: collections.deque = collections.deque()
        while True:
            if not ahead:
                try:
                    ahead.append(next(it))
                except StopIteration:
                    return
                engine = self.zerofit_engine() if self.zerofit_engine is not None else None
                if engine is not None and engine.window.can_offer():
                    for _ in range(engine.config.gradient_accumulation_steps - 1):
                        try:
                            ahead.append(next(it))
                        except StopIteration:
                            break
                    engine.window.offer(list(ahead))
            yield ahead.popleft()


@dataclass
class DeepSpeedRecord:
    """What the DeepSpeed door knows beyond the engine's parts (``engine.deepspeed.record``): the marker of [Note:
    DeepSpeed's accumulation boundary], whether the last step() applied an update, the samples of the steps taken and
    whether step() runs (managed_gradient_accumulation false), and what :func:`zerofit.deepspeed.initialize`
    attached (the optimizer's groups' parameter names, the data loader's settings, the loader)."""

    unstepped: int | None = None  # Window.micro_steps after the last backward() whose step() is pending
    step_applied: bool = False
    samples: int = 0  # managed_gradient_accumulation false: samples of the steps taken
    stepping: bool = False  # managed_gradient_accumulation false: inside step() (the boundary)
    names: tuple | None = None  # each group's parameter names as initialize() got them; None: the engine's
    collate_fn: Callable | None = None
    drop_last: bool = False
    views: tuple | None = None  # (optimizer, lr_scheduler) returned, built at first use
    tput_timer: ThroughputTimerView | None = None  # engine.tput_timer (deepspeed_views.py), built at first use
    training_dataloader: object = None  # the loader initialize(training_data=...) built


def bind_inputs(model, inputs: tuple, batch: dict) -> dict:
    """Positional arguments of a forward call as the keyword arguments of ``model.forward`` they bind to (the
    engine passes its micro-batches by name): ``engine(x, y)`` of ``forward(self, x, y)`` is ``{"x": x, "y": y}``."""

    sig = inspect.signature(model.forward)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()):
        raise TypeError(
            f"engine(...) got {len(inputs)} positional argument(s) for {type(model).__name__}.forward"
            f"{sig}, which takes *args: zerofit passes a micro-batch by name; call the engine with "
            "keyword arguments"
        )
    try:
        bound = sig.bind_partial(*inputs, **batch)
    except TypeError as e:
        raise TypeError(f"engine(...): {e}, for {type(model).__name__}.forward{sig}") from None
    out = {}
    for name, value in bound.arguments.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


# ---------------------------------------------------------------------------------------------- the face


class DeepSpeedFace:
    """DeepSpeed's names over an engine it holds (``engine.deepspeed``): each a delegate to the engine's parts and
    config, under the engine's guard (``check_open``, ``guard``, ``with_fallback``: engine.py), as FSDP2's
    ``FSDPModule`` is over its state. Its own state is ``record`` (:class:`DeepSpeedRecord`). The engine serves
    these names as its own (:func:`served_by_face`), so ``engine.backward(loss)`` is
    ``engine.deepspeed.backward(loss)``; the face holds the engine weakly (the engine holds the face)."""

    # DeepSpeed's rank attributes, as one process reads them
    global_rank = 0
    world_size = 1
    dp_world_size = 1

    def __init__(self, engine: Engine) -> None:
        self._engine = weakref.ref(engine)
        self.record = DeepSpeedRecord()

    @property
    def engine(self) -> Engine:
        engine = self._engine()
        assert engine is not None  # the engine holds its face: a face in use has a live engine
        return engine

    def configure_deepspeed(self, names=None, collate_fn=None, drop_last: bool = False, training_data=None) -> None:
        """What zerofit.deepspeed.initialize knows beyond the config: each group's parameter names, collate_fn,
        dataloader_drop_last, the training data."""
        self.record.names = tuple(tuple(n) for n in names) if names else None
        self.record.collate_fn, self.record.drop_last = collate_fn, drop_last
        self.record.views = None
        if training_data is not None:
            self.record.training_dataloader = self.deepspeed_io(training_data)

    @property
    def training_dataloader(self):
        """The loader initialize(training_data=...) built (DeepSpeed's name), or None."""
        return self.record.training_dataloader

    # ----------------------------------------------------------------- the loop: engine(**batch), backward(), step()

    def __call__(self, *inputs, **batch):
        """Forward one micro-batch, with the model's own arguments (positional ones too, as DeepSpeed passes them
        on: ``engine(x, y)``); returns the model's output as the model returns it ([Note: a forward records for
        backward as autograd says], window.py). Under ``torch.no_grad()`` (or in eval mode with autograd off) it
        keeps nothing."""
        if inputs:
            batch = bind_inputs(self.engine.adapter.model, inputs, batch)
        G = self.engine.window.G  # (the user's loop: the window it learnt)
        if (
            not self.engine.config.managed_gradient_accumulation
            and self.engine.window.micro_steps >= G
            and torch.is_grad_enabled()
            and not self.engine.window.unbounded
        ):
            raise DeepSpeedUnsupported(
                f"engine(**batch): micro-batch {G + 1} before engine.step() with managed_gradient_accumulation false: "
                f"zerofit's window holds at most gradient_accumulation_steps ({G}) micro-batches (their block "
                f"checkpoints wait on the device for the blocks' backward). Call engine.step() after at most {G} "
                "backward() calls, or raise gradient_accumulation_steps"
            )
        self.engine.check_open()
        if not torch.is_grad_enabled():
            return self.engine.forward_no_grad(batch)
        check_batch(batch, self.engine.batch_spec)
        self.engine.window.refuse_past_g()
        self.engine.window.drop_unused()
        with self.engine.guard(discard_step=True):
            return self.engine.with_fallback(lambda: self.engine.window.forward(batch))

    def forward(self, *inputs, **batch):
        return self(*inputs, **batch)

    def forward_window(self, batches: list[dict]) -> None:
        """Announce the accumulation window's micro-batches: run their forwards now, together ([Note: a window's
        forwards at once], window.py); each later ``engine(**batch)`` of the window takes its forward from here.
        Only at the start of a window, in training mode; a no-op on the generic path (a model that does not
        stream) and with several ranks."""
        self.engine.check_open()
        if not self.engine.window.may_announce(batches):
            return
        with self.engine.guard(discard_step=True):
            self.engine.with_fallback(lambda: self.engine.window.announce(batches))

    def backward(self, loss, release_loss: bool = False, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate ``loss`` (from this engine's forward) through the model, accumulating gradients (the
        blocks' part at the accumulation boundary: [Note: the block backward waits for the boundary], window.py).

        The gradient is that of ``loss / gradient_accumulation_steps``; with ``scale_wrt_gas=False``
        (DeepSpeed's keyword) that of ``loss`` itself, for callers that already divided it as they want
        (Hugging Face's Trainer: by the micro-batches of the step, or by the step's token count). Returns the
        loss divided by gradient_accumulation_steps (detached), as DeepSpeed returns it; ``release_loss`` is
        ignored, as DeepSpeed does."""
        if retain_graph:
            raise DeepSpeedUnsupported(
                "engine.backward(retain_graph=True): zerofit frees each block's graph as it "
                "goes (it recomputes blocks from checkpoints), so a second backward through "
                "the same forward is not possible; run the forward again"
            )
        self.engine.check_open()
        micro = self.engine.window.take_pending()
        with self.engine.guard(discard_step=True):
            self.engine.window.backward(
                micro, loss, scale_wrt_gas, self.engine.scaler.scale if self.engine.scaler else 1.0
            )
        self.record.unstepped = self.engine.window.micro_steps
        G = self.engine.config.gradient_accumulation_steps
        out = loss.detach().float()
        return out / G if G > 1 and scale_wrt_gas else out

    def step(self, lr_kwargs=None) -> None:
        """Take the optimizer step at the gradient-accumulation boundary (a no-op before it), then the lr
        schedule's step (a client scheduler's ``step(**lr_kwargs)``, after an applied step only, as DeepSpeed
        steps it). With ``managed_gradient_accumulation`` false every call after a backward() is the boundary,
        as in DeepSpeed."""
        client = self.engine.hypers.client
        if lr_kwargs and client is None:
            raise DeepSpeedUnsupported(
                f"engine.step(lr_kwargs={lr_kwargs!r}): the config's schedule takes no "
                "arguments (it is a function of the applied steps); lr_kwargs go to a client "
                "lr_scheduler passed to initialize()"
            )
        applied_before, micro = self.engine.global_step, self.engine.window.micro_steps
        unmanaged = not self.engine.config.managed_gradient_accumulation
        if unmanaged and micro:  # the caller's boundary: DeepSpeed steps whatever the count
            self.engine.window.override(True)
            self.record.stepping = True
        try:
            self._step_at_boundary()
        finally:
            if unmanaged:
                self.engine.window.override(None)
                self.record.stepping = False
        self.record.unstepped = None
        self.record.step_applied = self.engine.global_step > applied_before
        if unmanaged and self.engine.window.micro_steps == 0:  # DeepSpeed counts the micro-batches the caller gave
            self.record.samples += micro * (self.train_batch_size() // self.engine.config.gradient_accumulation_steps)
        if self.record.step_applied and client is not None:
            client.catch_up(self.engine.hypers, lr_kwargs)

    def _step_at_boundary(self) -> None:
        self.engine.check_open()
        if not self.engine.window.at_boundary():
            return
        with self.engine.guard(discard_step=True):
            self.engine.step_end.finish()  # [Note: one end of a step]

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's override of where an accumulation window ends, set before each micro-batch's forward
        (or at least before its backward): True ends the window with this micro-batch, however many came
        before it (a short last window, as accelerate's DeepSpeed wrapper and zerofit.hf ask for at the end of
        an epoch), so its backward runs the blocks' backward and step() steps; False holds the step back
        (a window stays at most gradient_accumulation_steps long: the device keeps that many micro-batches'
        block checkpoints); None returns to counting gradient_accumulation_steps."""
        if not self.engine.config.managed_gradient_accumulation:
            raise DeepSpeedUnsupported(
                "engine.set_gradient_accumulation_boundary(): not with "
                "managed_gradient_accumulation false, where every engine.step() is the "
                "boundary (DeepSpeed refuses it too)"
            )
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"is_boundary must be True, False or None, found {is_boundary!r}")
        self.engine.window.override(is_boundary)

    # ----------------------------------------------------------------- offload_states (offload_states.py)

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False):
        """Move the engine's device state of the kinds ``include`` (all when None) into host memory (page-locked
        when ``pin_memory``) and free its device memory ([Note: offloaded device state]). Until
        ``reload_states()`` the engine refuses every other call."""
        self.engine.lifecycle.check_open()
        where, kinds = offloading.parse(include, device)
        offloading.refuse_param_offload(self.engine.report, self.engine.config)
        if where == "none":
            log.warning("No device specified for offloading states.")
            return
        offloading.refuse_window("offload_states()", self.engine.window, self.engine.streamer)
        storages = lambda kinds: offloading.device_storages(  # noqa: E731
            kinds,
            units=self.engine.units,
            streamer=self.engine.streamer,
            grads=self.engine.grads,
            sharding=self.engine.sharding,
            device_updates=self.engine.device_updates,
            model=self.engine.adapter.model,
            device=self.engine.dev.device,
        )
        with self.engine.guard(discard_step=False):
            self.engine.offloaded.offload(kinds, storages, pin_memory and self.engine.dev.is_cuda, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Put back what ``offload_states`` moved, on the device, byte for byte; training goes on as if it had
        stayed there. A no-op when nothing is offloaded."""
        self.engine.lifecycle.check_open()
        if self.engine.offloaded.current is None:
            return
        with self.engine.guard(discard_step=False):
            self.engine.offloaded.reload(non_blocking)

    # ----------------------------------------------------------------- the accumulation boundary

    def is_gradient_accumulation_boundary(self) -> bool:
        """True while the last micro-batch of an accumulation is worked on ([Note: DeepSpeed's accumulation
        boundary]): from its forward until its step(); what set_gradient_accumulation_boundary() said, when set."""
        if not self.engine.config.managed_gradient_accumulation:
            return self.record.stepping  # DeepSpeed: true only while step() runs
        if self.engine.window.boundary is not None:
            return self.engine.window.boundary
        return (self._micro_position() + 1) % self.engine.config.gradient_accumulation_steps == 0

    def _micro_position(self) -> int:
        done = self.engine.window.micro_steps
        if done and self.record.unstepped == done:  # its step() has not been called yet
            done -= 1
        return done

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the weights (False before the boundary and for a skipped fp16 step)."""
        return self.record.step_applied

    def zero_grad(self) -> None:
        """A no-op: gradients live in the engine's own buffers and the optimizer step consumes them; the
        module's parameters have none. (DeepSpeed's ZeRO engines likewise keep accumulating across it.)"""

    # ----------------------------------------------------------------- counters and settings

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken, skipped fp16 steps included (DeepSpeed counts both)."""
        return self.engine.global_step + self.engine.skipped_steps

    @property
    def global_samples(self) -> int:
        """global_steps * train_batch_size; with managed_gradient_accumulation false, the samples of the
        micro-batches each step() took (DeepSpeed's count), since this engine started."""
        if not self.engine.config.managed_gradient_accumulation:
            return self.record.samples
        return self.global_steps * self.train_batch_size()

    @property
    def micro_steps(self) -> int:
        """DeepSpeed's count of step() calls: global_steps * gradient_accumulation_steps + the current micro-batch."""
        return self.global_steps * self.engine.config.gradient_accumulation_steps + self._micro_position()

    def train_batch_size(self) -> int:
        return self.engine.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.config.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.engine.config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.engine.config.gradient_clipping

    def steps_per_print(self) -> int | None:
        return self.engine.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.engine.config.wall_clock_breakdown

    def fp16_enabled(self) -> bool:
        return self.engine.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.precision == "bf16"

    @property
    def local_rank(self) -> int:
        index = self.engine.device.index if self.engine.device.type == "cuda" else None
        return index if index is not None else int(os.environ.get("LOCAL_RANK", 0))

    def get_lr(self) -> list[float]:
        """The lr of each parameter group for the next optimizer step (DeepSpeed: after the scheduler's step)."""
        return self.optimizer.lrs()

    def get_mom(self) -> list[tuple[float, float]]:
        """Adam's betas of each group for the next optimizer step (OneCycle and a client scheduler may change them)."""
        return [(h.beta1, h.beta2) for h in self.optimizer.hypers()]

    def get_global_grad_norm(self) -> float | None:
        """The last step's global gradient norm, where the engine computed it (gradient clipping or fp16);
        None otherwise (DeepSpeed's ZeRO engines compute it always)."""
        return self.engine.last_grad_norm

    def destroy(self) -> None:
        self.engine.close()

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: frees ZeRO-3's cache of gathered parameters; without ZeRO-3 (and in zerofit, which keeps no
        parameters beyond its planned slots) there is none, and it frees the allocator's unused cache, as DeepSpeed
        does after it."""
        if self.engine.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def tput_timer(self) -> ThroughputTimerView:
        """DeepSpeed's throughput timer: its epoch and step counters (DeepSpeed-Chat calls
        ``engine.tput_timer.update_epoch_count()`` after each epoch); its timings are engine.timeline()'s."""
        from zerofit.engine.faces.deepspeed_views import ThroughputTimerView

        if self.record.tput_timer is None:
            self.record.tput_timer = ThroughputTimerView(self)
        return self.record.tput_timer

    @property
    def optimizer(self) -> DeepSpeedOptimizer:
        return self._views()[0]

    @property
    def lr_scheduler(self):
        return self._views()[1]

    def _views(self):
        views = self.record.views
        client = self.engine.hypers.client
        if views is None or (client is not None and views[1] is not client.scheduler):
            opt = DeepSpeedOptimizer(
                self.engine.hypers, self.engine.adapter.model, self.engine.scaler, self.record.names
            )
            sched = self.engine.config.scheduler
            identity = sched.type == "constant" and sched.warmup_steps == 0
            if client is not None:  # DeepSpeed returns the client's scheduler itself (None without one)
                views = (opt, client.scheduler)
            elif identity:
                views = (opt, None)
            else:  # DeepSpeed's class for its own schedules (deepspeed.runtime.lr_schedules)
                from zerofit.deepspeed.runtime.lr_schedules import view_class

                cls = view_class(sched.type)
                views = (
                    opt,
                    DeepSpeedScheduler(self.engine.hypers, opt) if cls is None else cls._of(self.engine.hypers, opt),
                )
            self.record.views = views
        return views

    # ----------------------------------------------------------------- data

    def deepspeed_io(
        self,
        dataset,
        batch_size=None,
        route="train",
        pin_memory=True,
        data_sampler=None,
        collate_fn=None,
        num_local_io_workers=None,
    ):
        """DeepSpeed's loader: micro-batches of ``train_micro_batch_size_per_gpu``, in the order of a
        ``DistributedSampler`` over one rank (shuffled with seed 0, the same order every epoch, as DeepSpeed never
        sets its epoch; unshuffled for ``route`` "eval"/"predict"), the config's ``dataloader_drop_last``.
        DeepSpeed starts 2 worker processes by default; zerofit 0 unless ``num_local_io_workers`` says so (the
        batches are the same)."""
        from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

        map_style = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
        if not (map_style or isinstance(dataset, IterableDataset)):
            raise ValueError(
                f"Training data must be a torch Dataset (map-style or iterable), got a {type(dataset).__name__}"
            )
        if data_sampler is None and not isinstance(dataset, IterableDataset):
            data_sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=route == "train")
        cls = _WindowLoader if route == "train" else DataLoader
        loader = cls(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            sampler=data_sampler,
            collate_fn=collate_fn or self.record.collate_fn,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and self.engine.device.type == "cuda",
            drop_last=self.record.drop_last,
        )
        if route == "train":
            loader.zerofit_engine = self._engine
        return loader

    # ----------------------------------------------------------------- checkpoints: DeepSpeed's extra arguments

    def check_deepspeed_load_options(
        self, load_module_strict=True, load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None
    ) -> None:
        for name, value, default, why in (
            ("load_module_strict", load_module_strict, True, "zerofit loads every tensor of the model, by name"),
            (
                "load_lr_scheduler_states",
                load_lr_scheduler_states,
                True,
                "the lr schedule's position is the engine's step count, which the checkpoint restores",
            ),
            (
                "load_module_only",
                load_module_only,
                False,
                "use load_optimizer_states=False to keep the moments "
                "out (the step count and RNG states are still restored)",
            ),
            ("custom_load_fn", custom_load_fn, None, "zerofit reads its own checkpoint format"),
        ):
            if value != default:
                raise DeepSpeedUnsupported(f"engine.load_checkpoint({name}={value!r}): {why}")

    # ----------------------------------------------------------------- everything else DeepSpeed's engine has

    def attribute(self, name: str):
        """A name the engine does not have (its ``__getattr__``): DeepSpeed's refusal by name, else the module's
        attribute, else AttributeError (``getattr(engine, x, default)`` relies on it)."""
        engine = self._engine()
        kind = type(engine).__name__
        if name.startswith("_") or engine is None:  # the engine's own (a mistyped private name is a plain error)
            raise AttributeError(f"'{kind}' object has no attribute '{name}'")
        hint = deepspeed_hint(name)
        if hint is not None:
            raise refuse_attribute("engine", name, hint)
        adapter = engine.__dict__.get("adapter")
        if adapter is not None and hasattr(adapter.model, name):
            # DeepSpeed's engine passes what it does not have itself on to its module (engine.config of a model,
            # engine.training, engine.parameters()...). A value is read as it is: no attribute read waits for the
            # engine's updates (with several ranks that wait is a collective). A method of the module is called with
            # the weights made current first, as engine.module makes them, since it may read them.
            value = getattr(adapter.model, name)
            if not inspect.ismethod(value):
                return value

            @functools.wraps(value)
            def with_current_weights(*args, **kwargs):
                _ = self.engine.module  # the pending updates applied ([Note: engine.module is a collective])
                return value(*args, **kwargs)

            return with_current_weights
        raise AttributeError(f"'{kind}' object has no attribute '{name}'")


def served_by_face(cls: type) -> type:
    """The engine class serving each of :class:`DeepSpeedFace`'s names as its own: a method calls the engine's face's
    method, a property reads the face's, a constant is the face's; ``__getattr__`` asks the face's
    :meth:`~DeepSpeedFace.attribute`. A name the class defines itself stays its own."""

    def method(name: str, fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            return getattr(self.deepspeed, name)(*args, **kwargs)

        return call

    def prop(name: str, p: property) -> property:
        return property(lambda self: getattr(self.deepspeed, name), doc=p.__doc__)

    for name, value in vars(DeepSpeedFace).items():
        own = name in ("__init__", "engine", "attribute") or (name.startswith("_") and name != "__call__")
        if own or name in vars(cls):
            continue
        if isinstance(value, property):
            setattr(cls, name, prop(name, value))
        elif callable(value):
            setattr(cls, name, method(name, value))
        else:
            setattr(cls, name, value)

    def __getattr__(self, name: str):
        # only reached when normal lookup failed; before the face exists (early in __init__) a plain AttributeError
        face = self.__dict__.get("deepspeed")
        if face is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return face.attribute(name)

    cls.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return cls


# ---------------------------------------------------------------------------------------------- optimizer, scheduler
