"""``engine.offload_states()`` / ``engine.reload_states()`` (a part and its functions): DeepSpeed's calls that move what
the engine holds on the device into host memory between steps, and back (deepspeed/runtime/engine.py ``offload_states``,
0.19.8).

::

    engine.step()
    engine.offload_states(include=None, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False)
    ...                      # the device's memory is free for something else (generation, another model)
    engine.reload_states()   # training goes on as if nothing happened, bitwise
    loss = engine(x, y)

[Note: offloaded device state]
Between steps the engine holds on the device: each resident unit's 16-bit weights (``dev16``, and ``frozen_dev``),
its gradient buffer and, when its optimizer runs there, its fp32 master and Adam moments and step count; the
module buffers each unit computes with (``Unit.buffers``: the shell's too); the weight and gradient slot pools of
the streamed blocks; the upload stage, the assisted updates' chunk buffers and their 16-bit casts; the step's
gradient statistics (the non-finite flags, the squared norms). ``offload_states`` copies the storage of each of
these into one host buffer (page-locked when ``pin_memory`` and on CUDA) and shrinks the device storage to zero
bytes (``UntypedStorage.resize_(0)``), which gives its memory back to the caching allocator;
``reload_states`` grows each storage back to its size on the same device and copies the bytes in. Every tensor
object and every view of these storages (the units' attributes, a slot's tenant, a carved view) stays the same
object, so nothing in the engine is rebound, and every byte comes back as it was: training goes on bitwise as
without the round trip (tests/integration/test_offload_states.py). The buffers whose contents never outlive a step (the
gradient slots, a weight slot without a tenant, the upload stage, the assisted chunk buffers and casts) are freed
and grown again without a copy, as DeepSpeed does not restore its contiguous gradient buffer. A storage the module's own
parameters or buffers view (on the CPU, an fp32 resident unit's master is the module's parameter; ``b.to('cpu')`` of a
CPU buffer is the buffer itself) is host memory already and stays: on the CPU the "device" is the host, so the
round trip moves bytes but frees no memory.

The kinds of ``include`` (DeepSpeed's ``OffloadStateTypeEnum``) name, in zerofit: ``hp_params`` the fp32 masters of
the units the device optimizes; ``optim_states`` their moments and step counts, and the assisted updates'
chunk buffers; ``lp_params`` the 16-bit compute weights (``dev16``, ``frozen_dev``, the weight slots, the upload
stage and the assisted casts) and the module buffers on the device; ``lp_grads`` the resident units' gradient
buffers and the step's gradient statistics; ``contiguous_grad_buffer`` the gradient slots. One storage of two
kinds (in fp32 a resident unit's ``dev16`` is its master) moves with either. State of the host (the streamed
blocks' masters and moments, pinned staging, the 16-bit host copies) is where offloading would put it, as
DeepSpeed leaves a CPU optimizer's state: only the device's is moved.

While anything is offloaded, every other engine call (a forward, ``step``, ``save_checkpoint``, ``module``)
is refused with a message that says to call ``reload_states()`` (DeepSpeed leaves the engine unusable
without saying so); ``close()`` and ``destroy()`` reload first. ``offload_states`` is refused where activations
of an accumulation window are held on the device (between a window's first forward and its boundary's
backward); between the boundary's ``backward()`` and its ``step()`` the gradients waiting for the step move too.
Refused as DeepSpeed 0.19.8 refuses them: ``device=OffloadDeviceEnum.nvme`` (ValueError) and a DeepSpeed config
that offloads parameters (``zero_optimization.offload_param``); ``device=none`` warns and does nothing.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zerofit.engine.device import Device
    from zerofit.engine.memory.store import Unit
    from zerofit.engine.update.worker import HostWorker


log = logging.getLogger("zerofit")

KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
_SCRATCH = "scratch"  # contents that never outlive a step: freed and grown again, not copied


@dataclass
class _Moved:
    """One device storage whose bytes are in host memory (or, scratch, nowhere)."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # (nbytes,) uint8, a view of the offload's host buffer; None: scratch


@dataclass
class _Offloaded:
    """What offload_states moved, for reload_states."""

    kinds: set[str] = field(default_factory=set)
    moved: dict[int, _Moved] = field(default_factory=dict)  # storage._cdata -> _Moved
    buffers: list = field(default_factory=list)  # host buffers (HostArena or tensor) of the calls


def _as_value(x, what: str, valid) -> str:
    value = getattr(x, "value", x)
    if not isinstance(value, str) or value not in valid:
        raise ValueError(
            f"offload_states({what}={x!r}): expected one of {sorted(valid)} (DeepSpeed's "
            f"{'OffloadDeviceEnum' if what == 'device' else 'OffloadStateTypeEnum'}, "
            "deepspeed.runtime.zero.offload_config)"
        )
    return value


class OffloadStates:
    """What ``offload_states`` moved (a part): ``current`` (the offload in effect, None when nothing is offloaded)
    and the page-locked host buffers kept for the next offload (``pinned``, by size). The engine's calls
    (``Engine.offload_states``, ``reload_states``) check and guard; :meth:`check` refuses every other call while
    state is offloaded."""

    def __init__(self, dev: Device, worker: HostWorker, arenas: list) -> None:
        self.dev, self.worker, self.arenas = dev, worker, arenas
        self.current: _Offloaded | None = None
        self.pinned: dict[int, object] = {}  # nbytes -> a pinned HostArena kept for the next offload

    def check(self) -> None:
        """Refuse a call while the engine's device state is offloaded, saying what to do."""
        if self.current is not None:
            raise RuntimeError(
                f"the engine's device state is offloaded (engine.offload_states(): {sorted(self.current.kinds)}): "
                "call engine.reload_states() before using the engine again"
            )

    def offload(self, kinds: set[str], storages, pin: bool, non_blocking: bool) -> None:
        """Move the storages of ``kinds`` (``storages(kinds)``: device_storages) into host memory and free them."""
        self.worker.drain()  # no CPU update still reads a buffer of this step
        self.dev.synchronize()  # nor a copy or kernel on any stream
        off = self.current if self.current is not None else _Offloaded()
        todo = [
            (s, scratch)
            for s, scratch in storages(kinds - off.kinds).values()
            if s._cdata not in off.moved and s.nbytes() > 0
        ]
        host = self._buffer(sum(_padded(s.nbytes()) for s, scratch in todo if not scratch), pin)
        off.buffers.append(host)
        flat = host.tensor if hasattr(host, "tensor") else host
        at = 0
        try:
            for s, scratch in todo:
                n, dst = s.nbytes(), None
                if not scratch:
                    dst = flat[at : at + n]
                    at += _padded(n)
                    dst.copy_(_bytes(s), non_blocking=non_blocking)
                off.moved[s._cdata] = _Moved(s, n, dst)
                s.resize_(0)
        except BaseException:
            self._restore(off, non_blocking=False)  # every storage back, an earlier call's too
            self.current = None
            raise
        off.kinds |= kinds
        self.current = off
        if not non_blocking:
            self.dev.synchronize()
        gc.collect()
        if self.dev.is_cuda:
            torch.cuda.empty_cache()

    def reload(self, non_blocking: bool) -> None:
        """Put back what offload moved, on the device, byte for byte. A no-op when nothing is offloaded."""
        off = self.current
        if off is None:
            return
        self._restore(off, non_blocking)
        self.current = None
        gc.collect()

    def _restore(self, off: _Offloaded, non_blocking: bool) -> None:
        """Every moved storage grown back to its size on the device, its bytes copied in (scratch: grown only)."""
        for m in off.moved.values():
            if m.storage.nbytes() == 0:
                m.storage.resize_(m.nbytes)
                if m.host is not None:
                    _bytes(m.storage).copy_(m.host, non_blocking=non_blocking)
        self.dev.synchronize()  # the engine's other streams read these buffers next
        for buf in off.buffers:  # page-locked buffers are kept for the next offload, as DeepSpeed keeps them
            if getattr(buf, "pinned", False):
                self.pinned.setdefault(buf.tensor.numel(), buf)
        off.moved.clear()
        off.buffers.clear()

    def _buffer(self, nbytes: int, pinned: bool):
        """One host buffer of ``nbytes`` for an offload's copies: a page-locked HostArena (reused from an earlier
        offload of the same size), or pageable memory."""
        from zerofit.engine.memory.store import HostArena

        if not pinned:
            return torch.empty(max(nbytes, 1), dtype=torch.uint8)
        arena = self.pinned.pop(max(nbytes, 1), None)
        if arena is None:
            arena = HostArena(nbytes, torch.uint8, True)
            self.arenas.append(arena)  # unpinned when the engine releases its resources
        return arena


def parse(include, device) -> tuple[str, set[str]]:
    """offload_states' arguments: (where, kinds); ValueError as DeepSpeed 0.19.8 for NVMe."""
    where = _as_value(device, "device", ("none", "cpu", "nvme"))
    if where == "nvme":
        raise ValueError(
            "NVMe offload is not supported for offloading states. (offload_states(device=nvme), "
            "as DeepSpeed 0.19.8 refuses it; pass device=OffloadDeviceEnum.cpu)"
        )
    return where, set(KINDS) if include is None else {_as_value(k, "include", KINDS) for k in include}


def refuse_param_offload(report, config) -> None:
    """DeepSpeed 0.19.8: ``assert param_offload_config is None or ... device == none, "Moving states across
    devices is not supported for offloaded parameters."``"""
    asked = [
        r.key
        for r in report
        if r.key.startswith(("zero_optimization.offload_param", "zero_optimization.cpu_offload_param"))
    ]
    if asked and config.offload.param_device != "none":
        raise AssertionError(
            "Moving states across devices is not supported for offloaded parameters. (engine.offload_states() "
            f"with the config's {asked[0]} = {config.offload.param_device!r}, as DeepSpeed 0.19.8 refuses "
            "it: those parameters live in host memory already; leave offload_param out of the config to keep "
            "them on the device and offload them on demand)"
        )


def refuse_window(call: str, window, streamer) -> None:
    if window.pending is not None or window.held or streamer.kept or window.announced:
        raise RuntimeError(
            f"{call} in the middle of an accumulation window: its micro-batches' activations are held on the "
            "device (a forward without its backward, or a window before its boundary). Call it after "
            "engine.step(), or between the boundary's engine.backward() and its engine.step()"
        )


def device_storages(
    kinds: set[str], *, units: list[Unit], streamer, grads, sharding, device_updates, model, device
) -> dict[int, tuple[torch.UntypedStorage, bool]]:
    """The distinct device storages of ``kinds`` ([Note: offloaded device state]), by ``_cdata``: (storage,
    scratch). Storages the module's parameters and buffers view are host memory and left out. The parts' public
    buffers: the units', the streamer's slots and stage, the gradients' slots and statistics, the shards', the
    device updates' chunks and casts."""
    by_kind: dict[str, list] = {k: [] for k in KINDS}
    for u in units:
        by_kind["lp_params"] += [u.dev16, u.frozen_dev, *u.buffers.values()]
        if u.grads.slot is None:
            by_kind["lp_grads"].append(u.grads.tensor)
        if u.optimizer_on_device:
            by_kind["hp_params"].append(u.master)
            by_kind["optim_states"] += [u.exp_avg, u.exp_avg_sq, u.step]
    # a weight slot's bytes matter while it has a tenant (a streamed unit's weights, uploaded); a gradient
    # slot's never outlive the backward that filled it
    slots = streamer.pool.slots if streamer.pool is not None else []
    by_kind["lp_params"] += [s.tensor for s in slots if s.tenant is not None]
    free = [s.tensor for s in slots if s.tenant is None]
    grad_slots = [s.tensor for s in grads.pool.slots] if grads.pool is not None else []
    by_kind["lp_grads"] += [
        grads.bad_run,
        grads.bad_dev,
        *grads.sq_norms.values(),
        *sharding.padded_grad.values(),
        *sharding.shard_grad.values(),
    ]
    chunks = [t for s in (device_updates.buffers or ()) for t in s]
    casts = list(device_updates.cast or ())
    scratch_of = {
        "contiguous_grad_buffer": grad_slots,
        "lp_params": [streamer.stage, *casts, *free],
        "optim_states": chunks,
    }
    host = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    host |= {t.untyped_storage()._cdata for u in units for t in (u.host, u.frozen_host, u.host16) if t is not None}
    out: dict[int, tuple[torch.UntypedStorage, bool]] = {}
    for kind in KINDS:
        if kind not in kinds:
            continue
        for tensors, is_scratch in ((by_kind[kind], False), (scratch_of.get(kind, []), True)):
            for t in tensors:
                if t is None or not isinstance(t, torch.Tensor):
                    continue
                s = t.untyped_storage()
                if s._cdata in host or s.device.type != device.type:
                    continue
                if s._cdata in out:  # in two kinds: copied if either holds it as state
                    is_scratch = is_scratch and out[s._cdata][1]
                out[s._cdata] = (s, is_scratch)
    return out


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's bytes as a (nbytes,) uint8 tensor (a view: no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _padded(n: int) -> int:
    return -(-n // 64) * 64
