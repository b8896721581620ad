"""The step's side of the engine's failure semantics, and the generic fallback.

The state machine is :class:`~zerofit.engine.lifecycle.EngineLifecycle`'s (lifecycle.py: [Note: failure
semantics], [Note: Ctrl-C inside a step]); these are the hooks it calls on the :class:`~zerofit.engine.engine.Engine`
(a mixin of it: the methods read and reset the step's own state, units, slots and staging buffers), and the
rebuild of a model whose blocks turn out not to be chained ([Note: generic fallback]).
"""

from __future__ import annotations

import logging

import torch

from zerofit.engine.adapter import Adapter, NonSequentialModel
from zerofit.engine.materialize import model_shape, param_table
from zerofit.engine.planner import PlanError, placement_warnings
from zerofit.engine.rendezvous import named_barrier, wait_s
from zerofit.engine.store import Home, WeightState

log = logging.getLogger("zerofit")


class StepRecovery:
    """Mixed into :class:`~zerofit.engine.engine.Engine`: dropping a failed step, failing, the generic fallback."""

    # The state machine is EngineLifecycle's (lifecycle.py); these are the hooks it calls.

    def _discard_step(self) -> None:
        """Drop everything of the step in progress, none of which was applied ([Note: failure semantics])."""
        self.worker.drain()          # earlier steps' updates and this step's adds finish (or WorkerError)
        self._reset_transfers()
        spec, self._spec = self._spec, None
        if spec is not None:         # [Note: speculative updates]: undo what the worker updated early
            self._settle(spec, [u for u in self.units if not u.optimizer_on_device and u.trains], self._hyper(), None)
            self.worker.drain()
        self._pending = None
        self._micro_steps = 0
        self._held = []
        self._announced, self._offered = [], None
        self._weights_changed()       # a rollback restores the masters to rounding only
        if self._tier is not None:
            self._tier.reset()        # chunks read ahead for updates that will not come
        self._discard_grads([u for u in self.units if not u.optimizer_on_device])
        with self._staging_cv:       # a buffer taken by the failed step may never have been handed on
            self._staging_free = list(range(len(self._staging)))

    def _reset_transfers(self) -> None:
        """Wait for the device, then empty every slot: no copy or kernel of the failed call is in flight, and
        every streamed unit is ON_HOST, to be uploaded again when next needed (see [Note: slot reuse])."""
        self.dev.synchronize()
        self._kept = {}      # [Note: a window keeps some blocks]: its slots were carved from the gradient buffers
        for pool in (self.weight_pool, self.grad_pool):
            for slot in (pool.slots if pool is not None else ()):
                slot.tenant = slot.free_event = slot.read_event = None
        for u in self.blocks:
            if u.home is Home.STREAMED:
                u.slot, u.state, u.ready_event, u.grad_slot, u.grad = None, WeightState.ON_HOST, None, None, None
        if self._assist is not None:
            self._assist_free = [None] * len(self._assist)
        self.dev.intervals.clear()

    def _drop_device_state(self) -> None:
        """Let go of every device buffer (the memory goes back to the allocator, for a next engine).
        The module's parameters keep viewing the host weights."""
        self._pending, self._micro_steps, self._held, self._announced, self._offered = None, 0, [], [], None
        for u in self.units:
            u.dev16 = u.grad = u.slot = u.grad_slot = u.ready_event = u.master_event = u.pending_update = None
            u.frozen_dev = None
            u.buffers = {}
            if u.optimizer_on_device:
                u.master = u.exp_avg = u.exp_avg_sq = u.step = None
        self.weight_pool = self.grad_pool = None
        self._kept = {}
        self._upload_stage = self._assist = self._assist_free = self._assist16 = None

    def _apply_pending(self, collective: str | None = None) -> None:
        """Every pending update (host, or assisted on the device) applied, and on the disk (tier writes done).
        ``collective``: the public call this is, for a barrier that names it and fails when a rank does not
        come ([Note: engine.module is a collective], rendezvous.py)."""
        self.worker.drain()
        self._flush_assisted()
        if self._tier is not None:
            self._tier.drain()
        if getattr(self, "_solo", False):
            return
        if collective is None:
            self.ranks.barrier()    # the other ranks' shards too ([Note: sharded units]): a collective
        else:
            named_barrier(self.ranks, collective, wait_s(self.config.distributed_timeout_s))

    def _sync_host_weights(self) -> None:
        """The module's parameters (host views) take the current weights of device-optimized units."""
        if self._mirror_stale and (self.dev.is_cuda or any(u.shard_state for u in self.units)):
            for u in self.units:
                if u.shard_state:     # [Note: sharded device state]: gathered from every rank (a collective)
                    u.host.copy_(self._gather_full(u, u.master))
                elif u.optimizer_on_device and u.host is not u.master:
                    u.host.copy_(u.master)
        self._mirror_stale = False

    def _leave_disk(self) -> None:
        """Before close removes the swap file: the master weights kept there are copied into host memory and
        the module's parameters pointed at them, so ``engine.module`` keeps the final weights (as fp32 host
        tensors, like every other unit's)."""
        if self._tier is None:
            return
        from zerofit.engine.materialize import rebind_params

        for u in self.blocks:
            if u.swap == "all":
                host = torch.empty(u.numel, dtype=torch.float32)
                host.copy_(u.master)
                rebind_params(self._model, self.adapter, self._table, u, host)
                u.master = host
        self._tier.file.flush_mapping()

    def _log_placement(self) -> None:
        """Say where the optimizer state is under the plan, and where that is not what the config asked for."""
        blocks, off = self.adapter.num_blocks, self.config.offload
        log.info("zerofit %s", self.plan.optimizer_homes(blocks, "the GPU" if self.dev.is_cuda else
                                                        f"the device ({self.dev.device})"))
        for warning in placement_warnings(self.plan, blocks, optimizer_device=off.optimizer_device,
                                          param_device=off.param_device, on_cuda=self.dev.is_cuda):
            log.warning("zerofit: %s", warning)

    # [Note: generic fallback]
    # Whether a model chains its blocks output-to-input shows only when its forward runs (the pre and post
    # passes check it, see [Note: sequential blocks]), and a probe at initialize would need an input the engine
    # cannot make up. So with adapter="auto" the first forward decides: if it raises NonSequentialModel
    # (before anything of its step was applied), the step's transient state is dropped, the units are rebuilt
    # as one generic unit (the whole model) from the module's current weights, with the optimizer state they
    # hold (a checkpoint loaded into a fresh engine: moments by name, the common step count), the RNG state
    # the aborted forward consumed is restored, and the same call runs again, with a logged notice. Memory:
    # the old host weights and moments live until the new unit has copied them. adapter="blocks" refuses
    # instead; adapter="generic" skips it.

    def _fallback_possible(self) -> bool:
        # (after steps too, a loaded checkpoint's: the moments go over to the generic unit)
        return (self._adapter_kind == "auto" and self.adapter.streaming and self._micro_steps == 0
                and self._pending is None and not self._held and not self._announced)

    def _with_fallback(self, run):
        """``run()``, and once more on the generic path if it finds the model not block-sequential."""
        if not self._fallback_possible():
            return run()
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(self.dev.device) if self.dev.is_cuda else None)
        try:
            return run()
        except NonSequentialModel as err:
            self._discard_step()
            self._become_generic(err)
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], self.dev.device)
            return run()

    def _become_generic(self, err: NonSequentialModel) -> None:
        """[Note: generic fallback]: rebuild the units as one generic unit from the current weights."""
        if self._tier is not None:
            raise NonSequentialModel(f"{err.reason}; the generic path (the whole model as one unit) cannot use the "
                                     "disk tier this plan needs") from err
        carried = self._optimizer_state_by_name()     # a loaded checkpoint's moments go over to the new unit
        generic = Adapter(self._model, "generic")
        table = param_table(self._model, generic)
        shape = model_shape(self._model, generic, table)
        adapter, self.adapter = self.adapter, generic
        try:
            plan = self._plan(shape, self.config.seq_len)     # refused here, the streaming engine is intact
        except PlanError as e:
            self.adapter = adapter
            raise NonSequentialModel(f"{err.reason}; and the generic path (the whole model resident on the device) "
                                     f"does not fit either: {e}") from err
        log.warning("zerofit: %s, so this model cannot stream block by block: it trains on the generic path "
                    "instead (the whole model as one unit). Pass adapter='generic' to skip this check, or "
                    "adapter='blocks' to refuse.", err.reason)
        self._mirror_stale = True
        self._sync_host_weights()      # the module's parameters hold the current weights: the new unit copies them
        self.worker.drain()
        self.dev.synchronize()
        for a in self._arenas:
            a.close()
        self._arenas.clear()
        self._host_grads.clear()
        self._sq_norms.clear()
        self.units, self.shell, self.blocks = [], None, []
        self.weight_pool = self.grad_pool = None
        self._upload_stage = self._assist = self._assist_free = self._assist16 = None
        self._staging, self._staging_free = [], []
        self._table, self._shape, self.plan = table, shape, plan
        self.deferred = self._needs_norm
        self._checked_shape = None
        try:
            self._build_buffers()
            self._restore_optimizer_state(carried)
        except BaseException as e:
            self._fail(e)
            raise
        self._log_placement()

    def _optimizer_state_by_name(self) -> tuple[float, dict] | None:
        """(the step count, {canonical name: (exp_avg, exp_avg_sq) host copies}) of a unit set that took optimizer
        state (a loaded checkpoint), for _become_generic; None before any."""
        trained = [u for u in self.units if u.trains]
        steps = {float(u.step) for u in trained}
        if steps == {0.0}:
            return None
        if len(steps) != 1:
            raise RuntimeError(f"the units took different numbers of optimizer steps ({sorted(steps)}): cannot "
                               "fall back to the generic path with their state")
        moments = {}
        with self._full_state(write_back=False):      # [Note: sharded device state]
            for u in trained:
                prefix = "" if u.index < 0 else self.adapter.block_prefix(u.index) + "."
                m, v = u.layout.views(u.exp_avg), u.layout.views(u.exp_avg_sq)
                for n in u.layout.names:
                    moments[prefix + n] = (m[n].detach().to("cpu", copy=True), v[n].detach().to("cpu", copy=True))
        return steps.pop(), moments

    def _restore_optimizer_state(self, carried: tuple[float, dict] | None) -> None:
        """The moments and step count _optimizer_state_by_name took, into the rebuilt units, by name."""
        if carried is None:
            return
        step, moments = carried
        for u in self.units:
            if not u.trains:
                continue
            m, v = u.layout.views(u.exp_avg), u.layout.views(u.exp_avg_sq)
            for n in u.layout.names:
                m[n].copy_(moments[n][0])
                v[n].copy_(moments[n][1])
            u.step.fill_(step)

