"""The training engine: one optimizer step over many micro-batches, block-major, composed of parts.

:class:`Engine` builds the parts, keeps the lifecycle (lifecycle.py) and the public surface; each part owns its
state and its ``reset()`` (docs/engine.md has the table). A step (``train_batch``) reads as its own summary::

    planning.ensure(micro_batches); speculator.begin(); clock.start()
    micros = schedule.forward(micro_batches)        # pre pass, then block-major: each block runs every micro-batch
    losses = schedule.post_all(micros)              # head and loss, and their backward
    schedule.backward_blocks(micros)                # in reverse; each block's gradient to stepper.unit_done
    applied, norm = stepper.finish()                # the norm, clipping, the device's updates, deferred updates

Every block's weights cross PCIe at most twice (forward, backward) however many micro-batches there are. The
DeepSpeed-shaped loop (``engine(**batch)``, ``backward``, ``step``) runs the same passes one micro-batch at a
time, the blocks' backward waiting for the accumulation boundary (window.py).

Lifecycle and errors (lifecycle.py): an :class:`EngineState` says whether an error would leave the
weights as before the step (OPEN) or torn (APPLYING, then FAILED); see [Note: engine lifecycle],
[Note: failure semantics] and [Note: Ctrl-C inside a step].
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerofit.config.schema import ZerofitConfig
from zerofit.engine import recovery
from zerofit.engine.device import Device, rank_device, requested_device
from zerofit.engine.disk.tier import DiskTier
from zerofit.engine.distributed.ranks import Ranks
from zerofit.engine.distributed.rendezvous import named_barrier, wait_s
from zerofit.engine.faces.deepspeed_surface import DeepSpeedFace, served_by_face
from zerofit.engine.faces.offload_states import OffloadStates
from zerofit.engine.faces.user_model import current_for_reads
from zerofit.engine.lifecycle import EngineState, Lifecycle
from zerofit.engine.memory.store import recast_from_masters
from zerofit.engine.model import tiling
from zerofit.engine.model.adapter import Adapter
from zerofit.engine.model.groups import resolve_groups
from zerofit.engine.model.materialize import (
    model_shape,
    param_table,
    warn_low_precision_trained,
)
from zerofit.engine.model.nf4 import BaseNF4
from zerofit.engine.parts import PartsInputs, build_parts, end_step_of
from zerofit.engine.plan.engine_plan import (
    DTYPES,
    LEARN_WINDOW,
    Planning,
    check_ranks,
    update_policy,
    world_size,
)
from zerofit.engine.plan.plan import Plan
from zerofit.engine.step.batch import BatchSpec, check_batch, check_micro_batches, scores_tokens, vocab_of
from zerofit.engine.step.hypers import Hypers
from zerofit.engine.step.timeline import Timeline
from zerofit.engine.step.torch_clip import module_order
from zerofit.engine.step.window import Window
from zerofit.engine.update.speculation import Speculator
from zerofit.engine.update.worker import HostWorker

if TYPE_CHECKING:
    from zerofit.config.deepspeed_keys import KeyReport
    from zerofit.models.source import WeightSource

log = logging.getLogger("zerofit")


@served_by_face
class Engine:
    """See the module docstring. Build with :func:`zerofit.initialize`. DeepSpeed's names (``engine(**batch)``,
    ``backward``, ``step``, ``get_lr``...) are its face's (``deepspeed``: faces/deepspeed_surface.py), served as its
    own."""

    # the parts over the units (units, shell, blocks and parts.py's Parts): assigned by _build_parts, at __init__
    # and again for the generic fallback

    @classmethod
    def create(cls, model, config=None, *, param_groups=None, user_loop: bool = False, **overrides) -> Engine:
        """``model``: an ``nn.Module`` (real or on the meta device) or the path of a Hugging Face model
        directory, built on the meta device and filled from its safetensors files (zerofit.models).
        ``param_groups``: torch.optim-style groups ([Note: parameter groups], groups.py)."""
        from zerofit.config import load_config

        if "world_size" not in overrides:  # several ranks (torchrun): the batch triple counts them
            world = world_size()
            if world > 1:
                overrides["world_size"] = world
        loaded = load_config(config, **overrides)  # a bad config fails before any file is read
        source = None
        if isinstance(model, (str, os.PathLike)):
            from zerofit.models import ModelDir

            source = ModelDir.open(model)
            model = source.build_meta()
        if loaded.notices:
            from zerofit.config import format_report

            logging.getLogger("zerofit").warning("configuration notes:\n%s", format_report(loaded.notices))
        return cls(
            model, loaded.config, report=loaded.report, source=source, param_groups=param_groups, user_loop=user_loop
        )

    def __init__(
        self,
        model: nn.Module,
        config: ZerofitConfig,
        report: Iterable[KeyReport] = (),
        device: torch.device | str | None = None,
        adapter: str | None = None,
        source: WeightSource | None = None,
        param_groups: Iterable[dict[str, Any]] | Iterable[torch.Tensor] | None = None,
        user_loop: bool = False,
        untrained: bool = False,  # every parameter frozen: forwards and generate only ([Note: frozen parameters])
    ) -> None:
        self.deepspeed = DeepSpeedFace(self)  # DeepSpeed's names, and what the DeepSpeed door knows
        self.config = config
        self.source_dir = source.path if source is not None else None  # the model directory it was loaded from
        self._source = source
        self.report = list(report)
        self.dtype = DTYPES[config.precision]
        dev = requested_device(str(device) if device is not None else config.device)
        # [Note: sharded units] (ranks.py): the process group torchrun describes, one GPU per rank
        self.ranks = Ranks.setup(dev.type, config.distributed_timeout_s)
        if self.ranks.many:
            check_ranks(config, self.ranks)
        self.dev = Device.create(rank_device(dev, self.ranks))
        self._adapter_kind = adapter or config.adapter
        self.adapter = Adapter(model, self._adapter_kind, config.hooked_units, config.hooked_share)
        if (self.adapter.streaming or self.adapter.hooked) and getattr(model, "is_gradient_checkpointing", False):
            # the engine checkpoints every block it streams: the model's own checkpointing would recompute each
            # block a second time, and its reentrant form (prepare_model_for_kbit_training's) cannot run under
            # the engine's backward ([Note: the model's own checkpointing], step/compute.py)
            model.gradient_checkpointing_disable()  # type: ignore[operator]  # (a transformers model's method)
            log.info("zerofit: the model's gradient checkpointing is off; zerofit checkpoints every block itself")
        # [Note: an NF4 base] (nf4.py): bitsandbytes' 4-bit layers, or quantize_base, swapped before the table
        self.nf4 = BaseNF4.prepare(
            model,
            self.adapter,
            self.dtype,
            config.quantize_base == "nf4",
            self.ranks.many,
            device=self.dev.device,
            source=source,
        )
        self._model = model
        from zerofit.checkpoint.model_files import model_dtype

        self.model_dtype = model_dtype(model, source)  # the user's model's dtype, before fp32 masters: exports keep it
        self._table = param_table(model, self.adapter)
        # [Note: parameter groups] (groups.py): refused here, before anything is allocated
        groups = resolve_groups(param_groups, self._table, config.optimizer, untrained)
        self._group_of = {n: i for i, g in enumerate(groups) for n in g.names}
        # [Note: frozen parameters] (store.py): what no group trains (requires_grad=False, or in no group)
        self.frozen = frozenset(self._table.canonical) - set(self._group_of)
        if self._adapter_kind == "auto" and not self.adapter.streaming:  # no chain of blocks: one unit, or hooked
            self.adapter = recovery.resident_or_hooked(
                model, self.adapter, config=config, dev=self.dev, ranks=self.ranks, frozen=self.frozen, nf4=self.nf4
            )
            self._table = param_table(model, self.adapter)
        # deferred, speculated, known before the backward, in two passes, cast first: plan/engine_plan.py
        policy = update_policy(config, self.dtype, self.dev.is_cuda, groups, user_loop, self.adapter.hooked)
        self.deferred = policy.deferred
        self.speculator = Speculator(
            config.gradient_clipping, policy.speculate, known=policy.known, cast=policy.cast_early
        )
        self.hypers = Hypers(config, groups, speculating=policy.speculate)
        self._split, self._cast_first = policy.split, policy.cast_first
        self.scaler = _loss_scaler(config) if config.precision == "fp16" else None
        self.last_grad_norm: float | None = None  # the last step's global gradient norm, where one was taken
        self._shape = model_shape(model, self.adapter, self._table, self.frozen, self.nf4)
        warn_low_precision_trained(self._table, self.frozen)  # (fp32 masters of 16-bit trained parameters)
        self.batch_spec = BatchSpec.of(model, vocab_of(model, self._shape.vocab), self.dev.device)
        # may refuse (PlanError): nothing allocated yet
        self.planning = Planning(
            config,
            self.adapter,
            self._shape,
            on_cuda=self.dev.is_cuda,
            device=self.dev.device,
            ranks=self.ranks,
            seq_len=config.seq_len,  # [Note: room for a learnt window]
            window_room=LEARN_WINDOW if user_loop and config.gradient_accumulation_steps == 1 else 1,
        )
        self.ranks.use_layout(
            self.planning.layout, config.nodes_layout
        )  # [Note: the nodes' layout] (plan/engine_plan.py)
        # [Note: engine lifecycle]: from here on, released exactly once
        self.lifecycle = Lifecycle(self, self.dev, self.ranks)
        self._arenas = self.lifecycle.resources.arenas
        if self.dev.is_cuda and config.max_gpu_memory:
            self.lifecycle.resources.cap_gpu(config.max_gpu_memory)  # the plan fits: the allocator is held to it
        self.worker = self.lifecycle.resources.worker = HostWorker()
        self.clock = Timeline(self.dev, self.worker)
        self.offloaded = OffloadStates(self.dev, self.worker, self._arenas)  # [Note: offloaded device state]
        self.tier: DiskTier | None = None
        try:
            self.tier = self.lifecycle.resources.tier = self.planning.open_tier(self.deferred)
            self._build_parts(carry=None)
            if self.plan.loss_chunks > 1:  # [Note: a smaller GPU floor]: does this model's loss take chunks?
                self.planning.probed_chunked_loss(self.schedule.chunked_loss_works(self._shape.hidden, self.dtype))
        except BaseException:
            self.lifecycle.resources.release()
            raise
        if self.adapter.hooked:  # [Note: the hooked mode] (model/hooked.py): its units are any modules
            log.info("zerofit: %s", self.adapter.describe_units())
        else:
            # [Note: MLP over sequence tiles] (model/tiling.py): each block's MLP over the plan's tiles, when it has one
            tiling.install(self.adapter.blocks, tiling.tile_of(weakref.ref(self)))
            # [Note: documents without a mask] (model/tiling.py): packed documents over tiles with no T x T mask
            self.adapter.inputs_hook = tiling.documents_hook(self.adapter.blocks, tiling.tile_of(weakref.ref(self)))
        self.planning.log_placement(self.adapter.num_blocks, self.dev.is_cuda, self.dev.device)
        log.info("zerofit: %s", "; ".join(p.describe() for p in (self.kernels, self.compute.attention) if p))
        # [Note: a read of the user's model]
        current = current_for_reads(weakref.ref(self))
        self._reads = (model.register_forward_pre_hook(current), model.register_state_dict_pre_hook(current))
        if self.dev.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.dev.device)

    def _build_parts(self, carry: Window | None) -> None:
        """Materialize the units (materialize.py) where the plan puts them, then the parts built over them: the
        same code at initialize and for the generic fallback ([Note: generic fallback], recovery.py). ``carry``:
        the window the new one takes over (the fallback's), None at initialize. [Note: the parts as a value]:
        the engine assigns what parts.py builds."""
        parts = build_parts(
            PartsInputs(
                config=self.config,
                dev=self.dev,
                ranks=self.ranks,
                dtype=self.dtype,
                model=self._model,
                adapter=self.adapter,
                table=self._table,
                source=self._source,
                group_of=self._group_of,
                frozen=self.frozen,
                nf4=self.nf4,
                tier=self.tier,
                planning=self.planning,
                lifecycle=self.lifecycle,
                worker=self.worker,
                clock=self.clock,
                speculator=self.speculator,
                hypers=self.hypers,
                scaler=self.scaler,
                batch_spec=self.batch_spec,
                deferred=self.deferred,
                split=self._split,
                cast_first=self._cast_first,
                arenas=self._arenas,
                tile_of=tiling.tile_of(weakref.ref(self)),
                end_step=end_step_of(weakref.ref(self)),
                carry=carry,
            )
        )
        self._source = None  # the files are read: keep only their folder (source_dir)
        self._table = parts.table
        self.startup, self.sharding, self.units = parts.startup, parts.sharding, parts.units
        self.shell, self.blocks = parts.units[0], parts.units[1:]
        self.grads, self.copies16, self.device_updates = parts.grads, parts.copies16, parts.device_updates
        self.host_updates, self.streamer, self.activations = parts.host_updates, parts.streamer, parts.activations
        self.kernels, self.compute, self.stepper = parts.kernels, parts.compute, parts.stepper
        self.schedule, self.window, self.step_end = parts.schedule, parts.window, parts.step_end

    # ------------------------------------------------------------------ what the parts hold, by name

    @property
    def plan(self) -> Plan:
        """Where each unit lives and what it costs (plan/search.py): the placement the buffers were allocated for."""
        return self.planning.plan

    @property
    def global_step(self) -> int:
        """Optimizer steps applied (the lr schedule's position; checkpoints restore it)."""
        return self.hypers.global_step

    @global_step.setter
    def global_step(self, n: int) -> None:
        self.hypers.global_step = n

    @property
    def skipped_steps(self) -> int:
        """fp16 steps skipped for an overflow."""
        return self.hypers.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, n: int) -> None:
        self.hypers.skipped_steps = n

    @property
    def param_groups(self) -> tuple:
        """The resolved parameter groups ([Note: parameter groups], groups.py)."""
        return self.hypers.groups

    @property
    def speculation_stats(self) -> dict:
        """Steps by speculation outcome: held, rolled back, waited ([Note: speculative updates])."""
        return self.speculator.stats

    @property
    def window_stats(self) -> dict:
        """forward_window() calls, and calls that dropped an announced window ([Note: a window's forwards at
        once])."""
        return self.window.stats

    @property
    def disk_speed(self) -> dict:
        """The disk tier's write and read speed measured on its swap file at initialize ({} without a tier)."""
        return self.planning.disk_speed(self.tier)

    # ------------------------------------------------------------------ lifecycle (lifecycle.py)

    @property
    def state(self) -> EngineState:
        """OPEN, APPLYING, FAILED or CLOSED: what an error would do to the weights ([Note: engine lifecycle])."""
        return self.lifecycle.state

    def check_open(self) -> None:
        """Refuse a call on a closed or failed engine, or while its device state is offloaded."""
        self.lifecycle.check_open()
        self.offloaded.check()

    def guard(self, *, discard_step: bool):
        """A public call under the lifecycle's guard: an error drops the step in progress (training calls,
        ``discard_step``) or only the transfers in flight (evaluation, reads), [Note: failure semantics]."""
        return self.lifecycle.call(
            self._discard_step if discard_step else self._reset_transfers,
            self._drop_device_state,
            dropped_step=discard_step,
        )

    def _fail(self, err: BaseException) -> None:
        """-> FAILED: everything released; every later call raises EngineFailedError naming ``err``."""
        self.lifecycle.fail(err, self._drop_device_state)

    def _discard_step(self) -> None:
        """Drop everything of the step in progress, none of which was applied ([Note: failure semantics]): each
        part's reset(), in the order the work was queued."""
        self.worker.drain()  # earlier steps' updates and this step's adds finish (or WorkerError)
        self._reset_transfers()
        self.stepper.discard()  # its speculative updates undone, its gradients forgotten
        self.window.reset()
        self.copies16.weights_changed()  # a rollback restores the masters to rounding only
        if self.tier is not None:
            self.tier.reset()  # chunks read ahead for updates that will not come
        self.grads.reset()
        self.activations.reset()

    def _reset_transfers(self) -> None:
        """Wait for the device, then empty every slot: no copy or kernel of the failed call is in flight, and
        every streamed unit is ON_HOST, to be uploaded again when next needed (see [Note: slot reuse])."""
        self.dev.synchronize()
        self.streamer.reset()
        self.grads.reset_transfers(self.blocks)
        self.device_updates.reset()
        self.dev.forget_intervals()

    def _drop_device_state(self) -> None:
        """Let go of every device buffer (the memory goes back to the allocator, for a next engine).
        The module's parameters keep viewing the host weights."""
        self.window.reset()
        for u in self.units:
            u.drop_device()
        self.streamer.drop()
        self.grads.drop()
        self.device_updates.drop()

    def _apply_pending(self, collective: str | None = None) -> None:
        """Every pending update (host, or assisted on the device) applied, and on the disk (tier writes done).
        ``collective``: the public call this is, for a barrier that names it and fails when a rank does not
        come ([Note: engine.module is a collective], rendezvous.py)."""
        self.worker.drain()
        self.device_updates.flush(self.units)
        if self.tier is not None:
            self.tier.drain()
        if self.sharding.writing_alone:
            return
        if collective is None:
            self.ranks.barrier()  # the other ranks' shards too ([Note: sharded units]): a collective
        else:
            named_barrier(self.ranks, collective, wait_s(self.config.distributed_timeout_s))

    def _sync_host_weights(self) -> None:
        """The module's parameters (host views) take the current weights of device-optimized units (and, in the full
        layout, of the other nodes' slices: [Note: nodes hold a slice of the state], node_slices.py)."""
        self.stepper.sync_mirrors()
        if self.sharding.slices.on:
            self.sharding.slices.module_gathered(self.units)

    def release(self) -> None:
        """Let go of what the engine holds outside Python's objects (the CPU worker, pinned memory, the GPU cap,
        the disk tier's swap file), applying nothing: for a process about to leave without finalizers."""
        self.lifecycle.resources.release()

    def close(self) -> None:
        """Apply the updates of completed steps, copy the final weights into the module's parameters, and
        release the CPU worker, pinned host memory, the GPU memory cap and the device buffers. Idempotent,
        and a no-op on a failed engine (already released). Gradients of an unfinished DeepSpeed-style
        accumulation are dropped. Every later call raises EngineClosedError; ``module`` stays readable.
        See [Note: engine lifecycle]."""
        if self.offloaded.current is not None and self.state is EngineState.OPEN:
            self.deepspeed.reload_states()  # the final weights are read from the device state

        def finish():
            self._apply_pending()
            self._sync_host_weights()
            recovery.leave_disk(self.tier, self.blocks, self._model, self.adapter, self._table)

        self.lifecycle.close(finish, self._reset_transfers, self._drop_device_state)
        for handle in self._reads:  # the final weights are in the module's parameters: nothing is pending any more
            handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # the error that ended the block is the one to see
            log.warning("zerofit: closing the engine after %s failed too: %r", exc_type.__name__, e)

    def with_fallback(self, run):
        """``run()``, and once more on the generic path if it finds the model not block-sequential ([Note:
        generic fallback], recovery.py)."""
        # no window open (after steps too, a loaded checkpoint's: the moments go over to the generic unit)
        w = self.window
        possible = self._adapter_kind == "auto" and self.adapter.streaming and not (w.in_progress() or w.held)
        return recovery.run_with_fallback(run, possible, self.dev, self._discard_step, self._become_generic)

    def _become_generic(self, err) -> None:
        """[Note: generic fallback]: rebuild the units and their parts as one generic unit, from the current
        weights, with the optimizer state they hold (recovery.py gives the inputs; the engine assigns)."""
        generic, table, shape, planning, carried = recovery.generic_inputs(
            err,
            model=self._model,
            config=self.config,
            dev=self.dev,
            ranks=self.ranks,
            frozen=self.frozen,
            tier=self.tier,
            units=self.units,
            adapter=self.adapter,
            sharding=self.sharding,
        )
        following = self.stepper.torch_clip.order is not None  # the user's loop clips in the module's order
        self.stepper.mirrors_behind()
        self._sync_host_weights()  # the module's parameters hold the current weights: the new unit copies them
        self.worker.drain()
        self.dev.synchronize()
        self._drop_device_state()  # the streaming parts' device buffers go before the generic ones are made
        for a in self._arenas:
            a.close()
        self._arenas.clear()
        self.adapter, self._table, self._shape, self.planning = generic, table, shape, planning
        # the hooked mode's units hand their gradients over once per micro-batch: deferred updates (engine_plan.py)
        self.deferred = self.deferred or self.adapter.hooked
        try:
            self._build_parts(carry=self.window)
            recovery.restore_optimizer_state(self.units, carried)
            if following:  # over the new unit (the module's parameters are the same objects: materialize.py)
                self.stepper.torch_clip.follow(module_order(self.units, self.adapter, self._model))
        except BaseException as e:
            self._fail(e)
            raise
        self.planning.log_placement(self.adapter.num_blocks, self.dev.is_cuda, self.dev.device)

    # ------------------------------------------------------------------ train_batch

    def train_batch(self, micro_batches: list[dict]) -> float:
        """One optimizer step over ``micro_batches`` (dicts of input_ids, labels, optional attention_mask).

        Gradients are averaged over the micro-batches (each micro-batch loss / G), as plain
        PyTorch gradient accumulation. Returns the mean loss (a float; one device sync).
        An error leaves the engine as [Note: failure semantics] (lifecycle.py) says."""
        self.check_open()
        self.window.drop_unused()
        if self.window.in_progress():
            raise RuntimeError(
                "train_batch called in the middle of a DeepSpeed-style accumulation "
                "(a forward without backward(), or micro-batches without step()); finish it first"
            )
        try:
            check_micro_batches(micro_batches, self.batch_spec)
        except Exception as e:
            self.ranks.fail(e)  # [Note: a failing rank]: the others would wait for this one's collectives
            raise
        with self.guard(discard_step=True):
            return self.with_fallback(lambda: self._train_batch(micro_batches))

    def _train_batch(self, micro_batches: list[dict]) -> float:
        self.planning.ensure(micro_batches)
        self.speculator.begin(self.adapter.streaming)
        self.clock.start()
        G = len(micro_batches) * self.ranks.world  # the gradient is the mean over every rank's micro-batches
        scale = self.scaler.scale if self.scaler else 1.0
        self.activations.reset()
        streaming = self.adapter.streaming
        micros = self.schedule.forward(micro_batches, shell_grad=True, **self.planning.checkpoint_args(streaming))
        losses = self.schedule.post_all(micros, scale / G, self.planning.loss_chunks(streaming))
        if streaming:
            self.schedule.backward_blocks(micros)
        del micros
        # the reported loss is over the micro-batches that score tokens: one whose labels are all -100 has a loss of
        # 0/0 (NaN) and no gradient (a prompt longer than the window); its zero gradient still counts in the 1/G
        scored = [loss for loss, mb in zip(losses, micro_batches) if scores_tokens(mb)]
        mean = torch.stack(scored).float().mean() if scored else torch.full((), math.nan, device=self.dev.device)
        if self.ranks.many:  # the loss of the global batch, the same on every rank
            part = torch.stack(
                [mean.nan_to_num(0.0) * len(scored), torch.tensor(float(len(scored)), device=self.dev.device)]
            )
            total, count = self.ranks.all_reduce_world(part).tolist()
            mean = torch.tensor(total / count if count else math.nan)
        # the loss read is a device sync: after the step's updates are queued ([Note: events, not device syncs])
        read: list[float] = []
        self.step_end.finish(windowed=False, before_end=lambda: read.append(mean.item()))
        return read[0]

    def end_step(self, applied: bool, norm: float | None) -> None:
        """The optimizer step's end, applied or not (train_batch, the DeepSpeed-shaped loop's boundary, the user's
        loop's ``optimizer.step()``): its norm kept, the step counted, the timeline closed, the updates done."""
        if norm is not None:
            self.last_grad_norm = norm
        self.hypers.counted(applied)
        self.clock.end(self.tier)
        self.lifecycle.end_applying()

    # ------------------------------------------------------------------ evaluation and generation

    def generate(self, *args, **kwargs):
        """The model's ``generate`` on the device over the current weights, each streamed unit uploaded at its call
        ([Note: generation over the engine's weights], [Note: generation in the hooked mode], step/hooked.py)."""
        self.check_open()
        with self.guard(discard_step=False):
            self._apply_pending()  # the last step's updates are in the masters the uploads read
            return self.schedule.generate(*args, **kwargs)

    def forward_no_grad(self, batch: dict):
        """The model's output for ``batch`` without autograd; no state of a step is touched or kept."""
        check_batch(batch, self.batch_spec)
        n = len(self.dev.intervals)
        with self.guard(discard_step=False), torch.no_grad():
            out = self.with_fallback(lambda: self.schedule.post(self.schedule.forward([batch], shell_grad=False)[0])[0])
        self.dev.forget_intervals(n)  # not part of any step's timeline
        return out

    # ------------------------------------------------------------------ reading the engine

    def trace(self) -> list[dict]:
        """The last step's timeline interval by interval, {lane, label, start, end} (Timeline.trace)."""
        return self.clock.trace()

    def timeline(self) -> dict[str, float]:
        """Seconds per phase of the last step (Timeline.timeline)."""
        return self.clock.timeline()

    def wait(self) -> None:
        """Block until every pending update (host, or assisted on the device) is applied."""
        self.check_open()
        with self.guard(discard_step=False):
            self._apply_pending()

    @property
    def module(self) -> nn.Module:
        """The model, with its current weights (fp32, on the host; usable for eval and export).
        Still readable after close(), which left the final weights there."""
        if self.state is EngineState.CLOSED:
            return self._model
        self.check_open()
        with self.guard(discard_step=False):
            self._apply_pending("engine.module")  # [Note: engine.module is a collective]
            self._sync_host_weights()
        return self._model

    @property
    def device(self) -> torch.device:
        return self.dev.device

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by parameter name (host copies); frozen parameters as they are."""
        self.check_open()
        with self.guard(discard_step=False):
            self._apply_pending()
            out = {}
            with self.sharding.full_state(self.units, write_back=False):  # [Note: sharded device state]
                for u in self.units:
                    prefix = "" if u.index < 0 else self.adapter.block_prefix(u.index) + "."
                    assert u.master is not None  # an open engine's (the whole one, in full_state)
                    views = u.layout.views(u.master)
                    views.update(u.frozen_host_views())  # [Note: frozen parameters]: as they were
                    for n, v in views.items():
                        out[prefix + n] = v.detach().to("cpu", copy=True)
        return out

    def memory_stats(self) -> dict[str, int]:
        """Device and host bytes now, at their peak and as planned (Timeline.memory_stats)."""
        return self.clock.memory_stats(self.planning.current.device_total, self.plan.host_total)

    def train(self, mode: bool = True):
        self._model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # ------------------------------------------------------------------ checkpoints and export (zerofit.checkpoint)

    def save_checkpoint(
        self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False
    ) -> str:
        """DeepSpeed's save_checkpoint: the whole training state in ``save_dir/<tag>`` (default
        ``global_step{N}``), written atomically, then ``latest`` names it. Returns the folder.
        ``exclude_frozen_parameters``: leave out the weights of the frozen parameters (DeepSpeed's meaning)."""
        from zerofit.checkpoint.state import save

        if not save_dir:  # as DeepSpeed 0.19.8
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        return str(
            self.sharding.on_rank0(
                self.units,
                self.wait,
                lambda: save(self, save_dir, tag, client_state, save_latest, exclude_frozen=exclude_frozen_parameters),
            )
        )

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
        custom_load_fn=None,
    ):
        """DeepSpeed's load_checkpoint (its arguments, in its order): ``(path, client_state)``; ``(None, None)``
        with a warning when ``tag`` is None and ``load_dir`` has no ``latest``. DeepSpeed's options that would
        load less than the whole state are refused by name (deepspeed_surface.py). A load that fails after it
        began copying leaves the engine FAILED ([Note: a failed load fails the engine], checkpoint/state.py)."""
        from zerofit.checkpoint.errors import EngineStateLostError
        from zerofit.checkpoint.state import load

        self.deepspeed.check_deepspeed_load_options(
            load_module_strict, load_lr_scheduler_states, load_module_only, custom_load_fn
        )
        self.wait()
        try:
            with self.sharding.full_state(self.units, write_back=True):  # [Note: sharded device state]
                out = load(self, load_dir, tag, load_optimizer_states)
        except EngineStateLostError as lost:
            self._fail(lost)
            raise
        # several ranks: each wrote the same checkpoint into the shared host state; none trains on before all did
        self.ranks.barrier()
        return out

    def weights_loaded(self) -> None:
        """The masters (and moments, step counts) were written from outside (a checkpoint load): every copy
        derived from them follows ([Note: engine consistency after a load], store.py), the slots hold nothing, the
        step's partial norms and the 16-bit host copies are dropped. The caller ran ``wait()`` first."""
        recast_from_masters(self.units, self.shell)
        if self.tier is not None:
            self.tier.file.flush_mapping()
        self.grads.restart_all(self.units)
        self.device_updates.weights_loaded(self.units)
        self.dev.synchronize()  # the copies and the zeroing done: no slot is read or written
        for part in (self.streamer, self.grads, self.stepper, self.copies16):
            part.weights_loaded()

    def save_pretrained(self, out_dir, dtype=None, max_shard_size="5GB", merge=False) -> str:
        """The current weights as a Hugging Face model directory, streamed tensor by tensor; in ``dtype``
        (bf16, fp16, fp32), by default the model's own (``self.model_dtype``). A PEFT model: its adapter
        folder (adapter_config.json, adapter_model.safetensors), or with ``merge`` the adapters merged into the
        base, a Hugging Face model directory (docs/lora.md)."""
        from zerofit.checkpoint.export import save_pretrained

        if merge:
            _ = self.module  # the module's host weights current: the merge reads the PEFT layers' own
        return str(
            self.sharding.on_rank0(
                self.units, self.wait, lambda: save_pretrained(self, out_dir, dtype, max_shard_size, merge=merge)
            )
        )


def _loss_scaler(config: ZerofitConfig):
    from zerofit.optim.loss_scaler import make_loss_scaler

    return make_loss_scaler(config.fp16)
