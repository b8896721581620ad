"""The block store: where every unit's weights, master weights, moments and gradients live.

A *unit* is the set of parameters the engine moves and updates together: one
per repeated block (``layers.3``) plus the *shell* (embeddings, final norm,
head: everything outside the blocks). Each unit keeps its parameters as one
flat buffer per kind, laid out by a :class:`FlatLayout`:

==============  ==========================  ========================================
buffer          shape, dtype                home
==============  ==========================  ========================================
``host``        (numel,) fp32               host; the module's own parameters are views
                                            of it: ``master`` itself for host-optimized
                                            units, a mirror of the device master else
``dev16``       (numel,) compute dtype      device, resident units only
``master``      (numel,) fp32               optimizer home (host, or device)
``exp_avg``     (numel,) fp32               optimizer home
``exp_avg_sq``  (numel,) fp32               optimizer home
``grad``        (numel,) fp32               device: a slot (streamed) or own buffer
``frozen_host`` (frozen numel,) compute     host, once: the frozen parameters' weights, which the module's
                dtype                       frozen parameters view ([Note: frozen parameters])
==============  ==========================  ========================================

A unit on the disk tier (``swap``, disk.py) has its moments (``"moments"``), or its master and
moments (``"all"``), in the swap file: those attributes are views of the file's mapping, and its
updates stream them through the tier's buffers ([Note: the swap file is also a mapping]). With
``"all"``, ``host16`` (pinned, compute dtype) holds its weights for the uploads.

Host-optimized units upload ``master`` (pinned) and the device casts it: see
[Note: fp32 uploads] in materialize.py.

[Note: frozen parameters]
A parameter that is not trained (``requires_grad=False``, or in no parameter group: groups.py) is *frozen*: it
is part of its unit's weights but of none of its training state. A unit keeps its frozen parameters in a second
layout, ``frozen``, with their own flat buffer ``frozen_host``; ``layout`` and every buffer sized by it
(``master``, the moments, ``grad``, the host gradients, staging, shards) hold the trained parameters only. So a
frozen parameter has no optimizer state and no gradient buffer, nothing of it is downloaded or updated, and it
stays bitwise as it was.

``frozen_host`` is the only copy of the frozen weights: host memory, once (pinned when the engine pins; shared by
the host's ranks), in the *compute dtype*: 2 B/param in bf16 or fp16 training, 4 in fp32 (fp32 training keeps
fp32, so the CPU's bitwise fp32 tests hold). It is filled tensor by tensor from the model directory (a bf16
file's tensors read into it as they are: models/safetensors.py) or from the user's tensors (cast, rounding to
nearest even), never through an fp32 copy of the base (materialize.py). A streamed unit's weight slot holds its
frozen weights after the trained ones, at ``frozen_at``, and their upload is a plain copy (no staging, no cast on
the device); a resident unit holds ``frozen_dev`` on the device (on the CPU the host copy itself). The math is
the one of the fp32 copy this replaced: the device computed with the compute-dtype rounding of the fp32 weights,
cast at each upload; now the host rounds them once at load, the same way (tests/integration/test_frozen_base.py
compares a bf16 LoRA run bitwise against the same engine training the base at lr 1e-30, whose fp32 masters are cast
on the device as the frozen weights were).

What the module views: its frozen parameters are views of ``frozen_host``, so in bf16 training ``engine.module``
has bf16 frozen parameters beside fp32 trained ones (as a PEFT model loaded in bf16 with fp32 adapters does), and
an fp32 model's frozen parameters become bf16 at ``initialize`` (the user's originals are released, as the
trained ones' are). The alternative, fp32 views, means an fp32 copy of the base in host memory (twice the bf16
base's bytes), which is what this removes. ``master_state_dict`` gives the frozen weights
in that stored dtype; a checkpoint writes them as fp32 entries (the stored values exactly; the format is as
before, so older checkpoints load, cast into the stored dtype); an export writes the stored values in the
export's dtype.

The backward: ``Compute.leaves`` gives the frozen weights as plain slot views (``requires_grad`` false), so
autograd makes no gradient for them: a frozen block's backward computes its input's gradient only. A unit may train
nothing (``numel`` 0: a frozen block, a frozen shell): it is uploaded and computed as any other, the backward
passes gradients through it to its input, and it gets no gradient slot (no gradient pool at all when no streamed
unit trains), staging buffer, host gradient or update. Block recompute makes each recomputed input a leaf that
takes a gradient (Schedule._block_backward), so a frozen embedding (or frozen earlier blocks) never leaves a
block's adapters without one. Below the lowest trained block, with nothing before block 0 trained, no backward runs
at all ([Note: no backward below the lowest trained block], schedule.py). The planner counts the same (ModelShape's
``block_numels`` are the trained parameters, ``shell_frozen``/``block_frozen`` the frozen ones: their weights at
the compute dtype's bytes in host memory, in the weight slots, and on the device for resident units on a GPU). The
disk tier holds the trained state of the last blocks of a model with frozen parameters as of any other (its master
and moments, or its moments); their frozen weights stay in host memory: streaming them from the disk, read-only, is
not done yet.

[Note: slot reuse]
A streamed unit borrows a device weight slot from the :class:`SlotPool` while
it computes. Before an upload overwrites a slot, the upload stream waits on the
slot's ``free_event``, recorded on the compute stream after the last kernel
that read the previous tenant's weights. The compute stream, before it reads a
unit, waits on the unit's ``ready_event`` recorded after the upload. Gradient
slots follow the same rule with the download stream: a gradient slot is zeroed
(reused) only after the download stream's event for its previous tenant.
Slots are allocated once, up front, so no tensor crosses streams through the
caching allocator (no ``record_stream`` needed).
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import torch

from zerofit.engine.device import Device, Event, fresh_pinned, pin

if TYPE_CHECKING:
    from zerofit.engine.distributed.ranks import Ranks
    from zerofit.engine.model.nf4 import UnitNF4
    from zerofit.optim.hyper import Hyper


@dataclass(frozen=True)
class Segment:
    """A run of a unit's flat buffers whose parameters all belong to one parameter group."""

    offset: int
    numel: int
    group: int  # index into the engine's param_groups (0 when there are no groups)


@dataclass(frozen=True)
class FlatLayout:
    """Names, shapes and offsets of a unit's parameters inside its flat buffers.

    [Note: segments per unit]
    With parameter groups (groups.py) a unit's parameters are placed group by group: each group's
    parameters are contiguous, in model order within the group, so AdamW runs once per ``segments``
    entry with that group's hyperparameters (update/unit_adamw.py). ``names`` stay in model order, so
    everything that goes by name (gradient accumulation, checkpoints, export) does not see the
    reordering; only ``offsets`` do. Without groups there is one segment and the layout is the model's
    order, as it always was."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int
    segments: tuple[Segment, ...] = ()

    @classmethod
    def of(cls, named_shapes: list[tuple[str, torch.Size]], groups: list[int] | None = None) -> FlatLayout:
        """``groups``: each parameter's group index (all 0 when None). Parameters are placed by group, then
        in the order given (see [Note: segments per unit])."""
        names = [n for n, _ in named_shapes]
        shapes = [torch.Size(s) for _, s in named_shapes]
        groups = list(groups) if groups is not None else [0] * len(names)
        offsets, segments, n = [0] * len(names), [], 0
        for g in sorted(set(groups)):
            start = n
            for i in (i for i in range(len(names)) if groups[i] == g):
                offsets[i] = n
                n += math.prod(shapes[i])
            if n > start:
                segments.append(Segment(start, n - start, g))
        return cls(tuple(names), tuple(shapes), tuple(offsets), n, tuple(segments) or (Segment(0, 0, 0),))

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter-shaped views of ``flat`` (no copy)."""
        return {n: flat[o : o + math.prod(s)].view(s) for n, s, o in zip(self.names, self.shapes, self.offsets)}


class Home(enum.Enum):
    """Where a unit's compute weights live between uses."""

    RESIDENT = "kept on the compute device in dev16 for the whole run"
    STREAMED = "the fp32 master in pinned host memory; uploaded (and cast) into a device slot before each use"


class WeightState(enum.Enum):
    """Where a streamed unit's usable compute weights are right now."""

    ON_HOST = "only the host master is valid; the unit holds no device slot"
    UPLOADING = "a copy master -> slot is enqueued on the upload stream; compute must wait on ready_event"
    ON_DEVICE = "the slot holds the weights and the compute stream has waited on ready_event"


# a 16-bit host copy's label (memory/copies16.py): the weights epoch it was taken in, or ("after", E) for one made
# right after an update of epoch E
CopyLabel: TypeAlias = "int | tuple[str, int]"


def _set_event() -> threading.Event:
    """A unit's ``updated`` and ``moments_done`` as a new unit has them: nothing is pending."""
    ev = threading.Event()
    ev.set()
    return ev


@dataclass
class Streamed:
    """A unit's device weights as the streamer keeps them (memory/streamer.py; store.WeightState). Only the streamer
    changes them (tests/unit/test_part_records.py)."""

    state: WeightState = WeightState.ON_HOST
    slot: Slot | None = None
    ready_event: Event | None = None  # upload done (STREAMED)
    dirty: bool = False  # RESIDENT with host optimizer: dev16 older than master

    def drop(self) -> None:
        """No device handle (a closed or failed engine)."""
        self.slot = self.ready_event = None


@dataclass
class GradState:
    """A unit's gradient as Grads keeps it (memory/grads.py). Only Grads changes it."""

    tensor: torch.Tensor | None = None  # (numel,) fp32, device: own (RESIDENT) or a slot (STREAMED)
    slot: Slot | None = None
    fresh: bool = True  # next gradient write is a copy, not an add
    host_fresh: bool = True  # deferred updates: the host gradient buffer holds nothing yet
    # (FULL_SHARD on the GPUs: the device gradient shard, likewise)

    def own(self, buffer: torch.Tensor) -> None:
        """``buffer`` is a resident unit's own gradient buffer, as it is built (materialize.py; a padded one with
        several ranks: [Note: sharded units])."""
        self.tensor = buffer

    def drop(self) -> None:
        """No device handle (a closed or failed engine)."""
        self.tensor = self.slot = None


@dataclass
class Updates:
    """A unit's updates in flight, as the updates keep them (update/host.py on the worker thread, update/assisted.py
    on the device; step/optimizer_step.py hands them out). Only those three change it."""

    updated: threading.Event = field(default_factory=_set_event)  # master holds the latest update
    moments_done: threading.Event = field(default_factory=_set_event)  # no moments pass pending ([Note: moments
    # after the forward], update/split_adamw.py)
    master_behind: bool = False  # the last update's first pass wrote only host16: master is current
    # once moments_done ([Note: the master behind its cast])
    pending: tuple[float, tuple[Hyper, ...]] | None = None  # deferred: (grad factor, hypers) of an update the
    # device applies
    master_event: Event | None = None  # the download of a device-applied update into master

    def drop(self) -> None:
        """No device handle (a closed or failed engine)."""
        self.pending = self.master_event = None


@dataclass
class Copy16:
    """Which weights a unit's 16-bit host copy ``Unit.host16`` holds, as Copies16 keeps it (memory/copies16.py): the
    copy is made by the streamer's downloads and the updates' casts, through Copies16's methods. Only Copies16
    changes it."""

    epoch: CopyLabel = -1  # the engine's weights epoch host16 was taken in (valid while equal)
    event: Event | None = None  # the download that filled host16

    def made(self, label: CopyLabel, event: Event | None = None) -> None:
        """An update's cast (update/: ``label`` from Copies16.label) or a forward's download (Copies16.filled) wrote
        host16: it holds the weights ``label`` names, complete after ``event`` where it is a download."""
        self.epoch = label
        if event is not None:
            self.event = event


@dataclass
class Shard:
    """A unit's shard with several ranks, as Sharding keeps it (distributed/sharding.py): this rank's
    [lo, hi) of the flat buffers ([Note: sharded units], ranks.py); one rank: [0, numel). Only Sharding changes it;
    materialize makes it."""

    lo: int = 0
    hi: int = 0
    state: bool = False  # device-optimized on several ranks: master and moments hold only [lo, hi) (dev16 and
    # the host mirror stay whole)


@dataclass
class Unit:
    """One block (or the shell) in the store: what materialize makes (its name, place and layout, its home, its
    host tensors and resident device tensors), and one record per part that keeps per-unit state, each changed
    only by its owner: ``streamed`` (the streamer), ``grads`` (Grads), ``updates`` (the updates), ``copy16``
    (Copies16), ``shard`` (Sharding). Checkpoints, export and inference read them (docs/engine.md)."""

    # what it is and where it lives: materialize.py, as the plan places it
    name: str
    index: int  # execution order of blocks; -1 for the shell
    layout: FlatLayout
    home: Home
    optimizer_on_device: bool  # master and moments on the device (else host, CPU worker)
    frozen: FlatLayout | None = None  # its parameters that are not trained ([Note: frozen parameters])
    nf4: UnitNF4 | None = None  # its frozen weights held in 4 bits (nf4.UnitNF4), after those of
    # frozen_host in the frozen layout ([Note: an NF4 base], nf4.py)
    swap: str | None = None  # on the disk tier (disk.py): "moments", or "all" (master too;
    # host16 then holds its compute weights, the upload source)
    frozen_disk: bool = False  # frozen_host is a view of the disk tier's mapping, uploaded from the
    # tier ([Note: a frozen base on the disk], disk.py)
    frozen_at: int = 0  # STREAMED: where the frozen weights start in a weight slot

    # its host state (materialize.py; the updates write it: update/)
    host: torch.Tensor | None = None  # (numel,) fp32, host; module params view it
    master: torch.Tensor | None = None  # (numel,) fp32, optimizer home
    exp_avg: torch.Tensor | None = None  # (numel,) fp32, optimizer home
    exp_avg_sq: torch.Tensor | None = None  # (numel,) fp32, optimizer home
    step: torch.Tensor | None = None  # () fp32, optimizer home: AdamW steps taken
    frozen_host: torch.Tensor | None = None  # (frozen.numel,) compute dtype, host (pinned); module params view it
    host16: torch.Tensor | None = None  # (numel,) compute dtype, pinned host: [Note: 16-bit copies for extra
    # forwards]; which weights it holds: ``copy16``

    # its resident device tensors (materialize.py)
    dev16: torch.Tensor | None = None  # (numel,) compute dtype, device; RESIDENT only
    frozen_dev: torch.Tensor | None = None  # (frozen.numel,) compute dtype, device; RESIDENT only
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # module buffers on the compute device

    # the parts' records
    streamed: Streamed = field(default_factory=Streamed)
    grads: GradState = field(default_factory=GradState)
    updates: Updates = field(default_factory=Updates)
    copy16: Copy16 = field(default_factory=Copy16)
    shard: Shard = field(default_factory=Shard)

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def frozen_numel(self) -> int:
        return self.frozen.numel if self.frozen is not None else 0

    def drop_device(self) -> None:
        """Let go of every device tensor and event of the unit (a closed or failed engine): its weights, gradient,
        slots, buffers, and the optimizer state it keeps on the device. Its host state stays."""
        self.dev16 = self.frozen_dev = None
        self.buffers = {}
        for record in (self.streamed, self.grads, self.updates):
            record.drop()
        if self.optimizer_on_device:
            self.master = self.exp_avg = self.exp_avg_sq = self.step = None

    @property
    def trains(self) -> bool:
        """Whether the unit has trained parameters (else it has no gradient and no update)."""
        return self.layout.numel > 0

    @property
    def segments(self) -> tuple[Segment, ...]:
        """Runs of the flat buffers by parameter group: see [Note: segments per unit]."""
        return self.layout.segments

    def device_weights(self) -> torch.Tensor:
        """The flat compute weights on the device; valid only while RESIDENT or ON_DEVICE."""
        if self.home is Home.RESIDENT:
            assert self.dev16 is not None  # a resident unit's, from materialize until drop_device
            return self.dev16
        if self.streamed.state is not WeightState.ON_DEVICE:
            raise RuntimeError(f"{self.name}: weights used while {self.streamed.state.name}")
        assert self.streamed.slot is not None  # ON_DEVICE: the streamed unit holds a slot
        return self.streamed.slot.tensor[: self.numel]

    def frozen_host_views(self) -> dict[str, torch.Tensor]:
        """The frozen parameters' host values by name: views of ``frozen_host``, the NF4 ones dequantized now."""
        if self.frozen is None:
            return {}
        assert self.frozen_host is not None  # made with the frozen layout (materialize.py)
        n16 = self.frozen_host.numel()
        out = {
            n: self.frozen_host[o : o + math.prod(s)].view(s)
            for n, s, o in zip(self.frozen.names, self.frozen.shapes, self.frozen.offsets)
            if o < n16
        }
        if self.nf4 is not None:
            out.update({n: self.nf4.value(n, self.frozen_host.dtype) for n in self.nf4.names})
        return out

    def frozen_weights(self) -> dict[str, torch.Tensor]:
        """The frozen parameters' device tensors by name ([Note: frozen parameters]); valid as device_weights."""
        if self.frozen is None:
            return {}
        if self.home is Home.RESIDENT:
            assert self.frozen_dev is not None  # a resident unit's, as dev16
            return self.frozen.views(self.frozen_dev)
        self.device_weights()  # raises unless ON_DEVICE
        assert self.streamed.slot is not None
        return self.frozen.views(self.streamed.slot.tensor[self.frozen_at : self.frozen_at + self.frozen.numel])


@dataclass
class Slot:
    """A preallocated device buffer that streamed units borrow. See [Note: slot reuse]."""

    tensor: torch.Tensor  # (capacity,) on the device
    free_event: Event | None = None  # last reader (or writer) of the previous tenant is done
    read_event: Event | None = None  # a download reading the slot (into a host16 copy) is done
    tenant: Unit | None = None


class SlotPool:
    """A fixed set of device slots handed out round-robin to streamed units. ``evict(unit)``: what the pool's owner
    does to a tenant whose slot is taken from it (the streamer's: its weights are on the host only again)."""

    def __init__(self, dev: Device, count: int, capacity: int, dtype: torch.dtype, evict: Callable[[Unit], None]):
        self.dev = dev
        self.slots = [Slot(torch.empty(capacity, dtype=dtype, device=dev.device)) for _ in range(count)]
        self._next = 0
        self._evict = evict

    @property
    def nbytes(self) -> int:
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self.slots)

    def empty(self) -> None:
        """Every slot holds nothing and waits for nothing. The caller waited for the device first: no copy or kernel
        that reads or writes a slot is in flight ([Note: slot reuse]); the units that held one are set ON_HOST by
        their owner (Streamer.reset, Grads.reset_transfers, the parts' weights_loaded)."""
        for slot in self.slots:
            slot.tenant = slot.free_event = slot.read_event = None

    def take(self, protect: tuple = ()) -> Slot:
        """The least recently taken slot whose tenant is not in ``protect`` (the units in use or needed
        sooner); that tenant, if any, is evicted."""
        for _ in range(len(self.slots)):
            slot = self.slots[self._next]
            self._next = (self._next + 1) % len(self.slots)
            if slot.tenant is None or not any(slot.tenant is u for u in protect):
                break
        else:
            raise RuntimeError(f"all {len(self.slots)} device slots hold units still needed; raise the slot count")
        if slot.tenant is not None:
            self._evict(slot.tenant)
            slot.tenant = None
        return slot


class HostArena:
    """One large host allocation carved into per-unit views, page-locked once.

    One registration per arena avoids the caching host allocator's rounding of
    every pinned block up to a power of two (up to 2x the memory)."""

    def __init__(self, numel: int, dtype: torch.dtype, pinned: bool, ranks: Ranks | None = None) -> None:
        # ``ranks`` with several ranks: memory every rank of the host maps ([Note: sharded units], ranks.py)
        if ranks is not None and ranks.many:
            self.tensor = ranks.shared(max(numel, 1), dtype)
            if pinned:
                pin(self.tensor)
        else:  # [Note: page-locking fresh memory] (device.py)
            self.tensor = fresh_pinned(max(numel, 1), dtype) if pinned else torch.empty(max(numel, 1), dtype=dtype)
        self.pinned = pinned
        self._used = 0

    def take(self, numel: int) -> torch.Tensor:
        t = self.tensor[self._used : self._used + numel]
        self._used += numel
        return t

    def close(self) -> None:
        """Undo the page-locking (views of the memory stay valid, as pageable memory)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False

    def __del__(self):
        # Unregister before the memory can go back to the allocator: a later registration of the
        # same addresses would otherwise fail as "already registered".
        try:
            self.close()
        except Exception:
            pass


def recast_from_masters(units: list[Unit], shell: Unit) -> None:
    """[Note: engine consistency after a load]
    A load writes only ``master``, ``exp_avg``, ``exp_avg_sq`` (and ``step``). Every other copy of the
    weights is derived from ``master`` and must follow, or the next step computes with the old weights. This
    function re-derives the unit's own copies; each part then restarts its own record (its ``weights_loaded``):
    - device-optimized units: ``dev16`` is re-cast from ``master`` (unless it *is* master, fp32 on the
      device), and the host mirror ``host`` re-copied (unless it is master, on the CPU): the mirrors are then
      current (Step.mirror_stale false);
    - any resident host-optimized unit but the shell is re-cast at once; the shell is marked ``dirty`` by the
      streamer (Streamer.weights_loaded): the next forward uploads it (Streamer.refresh_shell);
    - streamed units drop their device slot (state ON_HOST; the streamer empties the slots): the next forward
      uploads them from ``master`` (16-bit host copies are dropped: Copies16.weights_changed); a resident unit's
      frozen weights are re-cast from ``frozen_host``;
    - gradient state restarts (Grads.restart_all, Grads.weights_loaded): the next write copies, resident
      gradients zeroed, partial squared norms dropped; no assisted update is pending
      (DeviceUpdates.weights_loaded);
    - units on the disk tier: the load wrote their state through the swap file's mapping; a master kept
      there is re-cast into its 16-bit host copy (the upload source), and the mapping is flushed before
      the tier's next direct read ([Note: the swap file is also a mapping], disk.py).
    The caller (Engine.weights_loaded) ran ``engine.wait()`` before the load wrote (no update in flight)."""
    for u in units:
        assert u.master is not None  # an open engine's units hold their masters (drop_device runs at close)
        if u.optimizer_on_device:
            if u.dev16 is not None and u.dev16 is not u.master:
                u.dev16.copy_(u.master)
            if u.host is not None and u.host is not u.master:
                u.host.copy_(u.master)
        elif u.home is Home.RESIDENT and u is not shell:
            assert u.dev16 is not None  # resident
            u.dev16.copy_(u.master)
        if u.frozen_dev is not None and u.frozen_dev is not u.frozen_host:  # [Note: frozen parameters]
            assert u.frozen_host is not None  # made with the frozen layout, before frozen_dev
            u.frozen_dev[: u.frozen_host.numel()].copy_(u.frozen_host)  # (NF4 ones never change)
        if u.swap == "all":
            assert u.host16 is not None  # its upload source ([Note: the swap file is also a mapping])
            u.host16.copy_(u.master)
