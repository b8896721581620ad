"""Offloaded generation: the model's own forward and Hugging Face's own ``generate``, with the blocks that do
not fit the GPU streamed through it from pinned host memory.

    gen = InferenceEngine.from_pretrained("path/to/model_dir_or_checkpoint", max_gpu_memory="24GiB")
    out = gen.generate(input_ids, attention_mask=mask, max_new_tokens=128)   # transformers' generate

Where each tensor lives: the shell (embeddings, final norm, head, rotary
tables) on the device in the weights' dtype; every block's weights in one flat
16-bit host buffer (page-locked on CUDA), which is what the block's parameters
view while it is not computing; resident blocks also in a flat device buffer
(their parameters view that instead); streamed blocks borrow one of a few
device *slots* for the duration of their forward. The KV cache is
transformers' own (on the device). The math is the model's own code in the
weights' dtype: the same kernels on the same values as the model held whole on
the device, so greedy tokens and logits are those of ``model.generate``.

[Note: same kernels]
ATen's ``matmul`` folds a batched input into one GEMM or not depending on
whether the operands require grad (even under ``no_grad``), and the two paths
round differently: the parameters here require grad, as those of a model
transformers loads do, so that the logits are bitwise those of ``generate`` on
the model itself. Generation runs under ``no_grad``; nothing is recorded.

[Note: a KV cache allocated once]
``generate`` uses transformers' static cache by default: every layer's keys and
values for ``batch x (prompt + new tokens)`` allocated once, exactly the bytes
the plan counted. A dynamic cache grows by concatenation every token (new
allocations every step); with it, the same plan decoded at less than half the
speed at batch 1 on the H200 under a 24 GiB cap (docs/benchmarks.md, offloaded generation of the 13B shape). Why
was not measured: allocator work near the cap is the suspicion. The tokens are those of ``generate`` with the
default cache too; the logits equal to the dtype's rounding (the static cache
attends over the padded length, masked), and bitwise those of ``generate(...,
cache_implementation="static")`` on the model held whole.

[Note: the model's own dtype]
Unless told otherwise (``dtype``), the weights and the KV cache are held in
the dtype the model has, as transformers' ``from_pretrained`` loads a folder:
config.json's ``dtype`` (``torch_dtype`` in older files), else the dtype most
of its stored weights have; a checkpoint's trained model's dtype; a model in
memory's parameters' own. An fp32 folder generates in fp32, so greedy tokens
are those of ``generate`` on the model transformers loads; a 16-bit dtype is
the user's choice (``dtype``), said in :meth:`InferenceEngine.summary`.

[Note: normal tensors]
The engine's buffers (host arena, resident copies, slots) and the views its
parameters take are made outside ``torch.inference_mode``, even when the first
``generate`` runs inside it: an inference tensor cannot be written in place
outside inference mode, and the slots are rewritten on every later call.

[Note: the upload cycle]
Every forward of a decoder runs its blocks once each, in order, so the streamed
blocks are needed in one fixed cyclic order, token after token. The slots are
filled with the first ``slots`` streamed blocks; when a streamed block's
forward ends, its slot is released (an event on the compute stream) and the
next block of the cycle (wrapping to the next forward's first) is uploaded into
it on the upload stream, which waits for that event. The copy stream therefore
never waits for the host's sampling between tokens: the next token's first
streamed blocks are already crossing while the current token finishes. A block
that is not where the cycle expects it (the first forward, a forward that
raised half-way) re-primes the cycle at that block after the slots drain.

[Note: slot lifetimes]
A slot's buffer lives as long as the plan; a block's parameters view a slot
only between its pre-hook and its hook, then the host buffer again, so a slot
can be overwritten by the next upload as soon as the compute stream has passed
the event recorded at the hook. The host buffers are never written while the
engine lives (weights are fixed), so uploads from them need no fences.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from zerofit.checkpoint.export import export_dtype
from zerofit.checkpoint.model_files import model_dtype
from zerofit.config.schema import parse_bytes
from zerofit.engine.device import Device
from zerofit.engine.memory.store import HostArena
from zerofit.engine.model.adapter import Adapter
from zerofit.engine.model.materialize import init_buffers, param_table
from zerofit.engine.plan.search import fmt_bytes
from zerofit.infer.plan import RESERVE, InferencePlanError, InferPlan, InferShape, plan_inference

ALIGN = 64  # elements: every parameter view starts on a 128-byte boundary in 16-bit


def as_dtype(dtype) -> torch.dtype | None:
    return None if dtype is None else export_dtype(dtype, "dtype")


@dataclass
class _Slot:
    buf: torch.Tensor
    ready: object = None  # upload done (event on the upload stream)
    free: object = None  # the last reader done (event on the compute stream)


class InferenceEngine:
    """A causal LM ready for offloaded generation (see the module docstring).

    Build it from a model directory or a zerofit checkpoint (:meth:`from_pretrained`), a live training engine
    (:meth:`from_engine`) or a model in memory (the constructor: its parameters are taken over, cast to
    ``dtype``). ``dtype``: the weights' and the KV cache's; None: ``own_dtype`` (what a source says the model's
    own is), else the model's parameters' ([Note: the model's own dtype]). ``max_gpu_memory``: the device budget
    the plan keeps to (None: the whole GPU less what other processes hold; on the CPU no limit).
    ``max_host_memory``: the host budget for the blocks' weights (None: for a model read from files the available
    memory less a tenth; for a model in memory no limit); the blocks beyond it go to a swap file under
    ``nvme_path`` (zerofit/infer/disk.py), or it is refused.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device | None = None,
        dtype=None,
        max_gpu_memory: int | str | None = None,
        slots: int = 2,
        tokenizer=None,
        fill=None,
        source_dir: Path | None = None,
        max_host_memory: int | str | None = None,
        nvme_path: str | os.PathLike | None = None,
        own_dtype: torch.dtype | None = None,
    ):
        self.device = (
            torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dev = Device.create(self.device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.source_dir = source_dir
        self.cap = parse_bytes(max_gpu_memory, "max_gpu_memory")
        self.host_budget = parse_bytes(max_host_memory, "max_host_memory")
        self.nvme_path = nvme_path
        self._disk = None  # DiskBlocks, when some blocks live on the disk
        # the blocks' host storage, made by _load: per block (name, offset, shape) and its elements, the pinned
        # arena of the blocks in host memory and each block's flat buffer there (None: on the disk), the views
        self._layout: list[list[tuple[str, int, torch.Size]]] = []
        self._sizes: list[int] = []
        self.shape = None
        self._arena: HostArena | None = None
        self._host: list[torch.Tensor | None] = []
        self._host_views: list = []
        self._disk_cycle: list[int] = []  # the streamed blocks read from the disk, in the cycle's order
        self.slots_wanted = max(1, int(slots))
        self.adapter = Adapter(model, "auto")
        if not self.adapter.streaming:
            raise ValueError(
                "the model has no list of repeated blocks holding most of its parameters: "
                "zerofit's offloaded generation streams blocks"
            )
        self.table = param_table(model, self.adapter)
        # [Note: the model's own dtype]
        self.dtype = as_dtype(dtype) or own_dtype or model_dtype(model)
        self.dtype_origin = "as asked" if dtype is not None else "the model's own"
        self.plan: InferPlan | None = None
        self._dev: dict[int, torch.Tensor] = {}
        self._slots: list[_Slot] = []
        self._holding: dict[int, _Slot] = {}
        self._cycle: list[int] = []
        self._next = 0
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._params: dict[str, nn.Parameter] = {}  # canonical name -> the parameter the model holds
        self._shell_host: dict[str, torch.Tensor] = {}  # the shell's weights while the device is released
        self.uploads = 0
        self.upload_bytes = 0
        self.primes = 0  # cycle restarts ([Note: the upload cycle]): one per plan when all goes well
        self._upload_marks: list = []  # (start, end) timing events of uploads since the last stats()
        self._upload_seconds = 0.0
        with torch.inference_mode(False):  # [Note: normal tensors]
            self._load(fill)
        self._hooks = []
        for i, blk in enumerate(self.adapter.blocks):
            self._hooks.append(blk.register_forward_pre_hook(lambda m, a, i=i: self._enter(i)))
            self._hooks.append(blk.register_forward_hook(lambda m, a, o, i=i: self._exit(i)))

    # ------------------------------------------------------------------ building

    @classmethod
    def from_source(cls, src, **kw) -> InferenceEngine:
        """A :class:`~zerofit.models.source.WeightSource`: the model built on the meta device and each tensor read
        once into place, in the source's own dtype unless ``dtype`` says otherwise; the source is closed after."""
        kw.setdefault("tokenizer", src.tokenizer())
        kw.setdefault("own_dtype", src.dtype())
        try:
            return cls(src.build_meta(), fill=src.fill, source_dir=src.path, **kw)
        finally:
            src.close()

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, adapter: str | os.PathLike | None = None, **kw
    ) -> InferenceEngine:
        """A Hugging Face model directory, or a zerofit checkpoint (a tag folder, or a save folder whose
        ``latest`` is used). ``adapter``: a PEFT adapter folder over the model directory ``path``
        (zerofit/infer/adapter_source.py)."""
        from zerofit.infer.sources import open_source

        if adapter is not None:
            from zerofit.infer.adapter_source import AdapterSource

            return cls.from_source(AdapterSource(path, adapter), **kw)
        return cls.from_source(open_source(path), **kw)

    @classmethod
    def from_engine(cls, engine, **kw) -> InferenceEngine:
        """The current weights of a live training engine, in a model of their own (the engine is not changed)."""
        from zerofit.infer.sources import EngineSource

        return cls.from_source(EngineSource(engine), **kw)

    def _load(self, fill) -> None:
        """Weights into place, one tensor at a time: shell on the device, blocks in one host arena."""
        model, adapter, table = self.model, self.adapter, self.table
        canon = dict(table.canonical)  # the model's own parameters (a real model's values are read here)
        if fill is None:

            def fill(names, dst):
                dst.copy_(canon[names[0]].detach())

        meta = any(p.is_meta for p in canon.values())
        for name in table.unit_names[0]:  # shell: parameters straight to the device
            t = torch.empty(canon[name].shape, dtype=self.dtype, device=self.device)
            fill(table.aliases[name], t)
            self._bind(name, t)
        if meta:
            init_buffers(model, adapter, 0, self.device)
        self._layout = []
        sizes = []
        for b in range(adapter.num_blocks):
            off, lay = 0, []
            for name in table.unit_names[b + 1]:
                shape = canon[name].shape
                lay.append((name, off, shape))
                off += aligned(math.prod(shape))
            self._layout.append(lay)
            sizes.append(off)
            if meta:
                init_buffers(model, adapter, b + 1, self.device)
        self._sizes = sizes
        self.shape = infer_shape(model, table, sizes, self.dtype)
        on_disk = self._disk_blocks(sizes, meta)
        in_host = [b for b in range(len(sizes)) if b not in on_disk]
        self._arena = HostArena(sum(sizes[b] for b in in_host), self.dtype, pinned=self.dev.is_cuda)
        self._host = [None] * len(sizes)
        for b in in_host:
            self._host[b] = self._arena.take(sizes[b])
        if on_disk:
            from zerofit.infer.disk import DiskBlocks

            self._disk = DiskBlocks(self.nvme_path, on_disk, sizes, self.dtype, pinned=self.dev.is_cuda)
        self._host_views = []
        for b in range(len(sizes)):
            if b in on_disk:
                self._disk.write(b, lambda flat, b=b: self._fill_block(fill, self._flat_views(flat, b)))
                views = self._flat_views(self._disk.mapped(b), b)  # idle: the file's mapping
            else:
                views = self._flat_views(self._host[b], b)
                self._fill_block(fill, views)
            self._host_views.append(views)
            for name, t in views.items():
                self._bind(name, t)
        for m in model.modules():  # buffers (rotary tables, masks) on the device
            for bn, buf in list(m._buffers.items()):
                if buf is not None and buf.device != self.device:
                    m._buffers[bn] = buf.to(self.device)

    def _fill_block(self, fill, views: dict[str, torch.Tensor]) -> None:
        for name, t in views.items():
            fill(self.table.aliases[name], t)

    def _disk_blocks(self, sizes: list[int], meta: bool) -> list[int]:
        """The blocks whose weights go to the disk: none when they all fit ``max_host_memory`` (by default, for
        a model read from files, the training engine's: the available memory less a tenth); else those
        beyond it, the blocks a batch-1 plan streams kept in host memory first (they cross every token)."""
        from zerofit.engine.plan.engine_plan import default_host_budget

        elem, n = self.shape.elem, len(sizes)
        total = sum(sizes) * elem
        if self.host_budget is None and meta:
            self.host_budget = default_host_budget()
        if self.host_budget is None or total <= self.host_budget:
            return []
        staging = 2 * max(sizes) * elem
        if self.nvme_path is None:
            raise ValueError(
                f"the blocks' 16-bit weights ({fmt_bytes(total)}) exceed max_host_memory "
                f"({fmt_bytes(self.host_budget)}): give nvme_path (--nvme) for the rest, or raise "
                "max_host_memory"
            )
        if self.host_budget < staging:
            raise ValueError(
                f"max_host_memory {fmt_bytes(self.host_budget)} cannot hold the two staging buffers "
                f"the disk needs ({fmt_bytes(staging)}): raise it"
            )
        try:
            first = plan_inference(
                self.shape, self._device_budget(), 1, 256, 128, self.slots_wanted, RESERVE if self.dev.is_cuda else 0
            ).streamed
        except InferencePlanError:
            first = []
        order = first + [b for b in range(n) if b not in set(first)]
        room, keep = self.host_budget - staging, set()
        for b in order:
            if sizes[b] * elem <= room:
                keep.add(b)
                room -= sizes[b] * elem
        return [b for b in range(n) if b not in keep]

    def _flat_views(self, flat: torch.Tensor, b: int) -> dict[str, torch.Tensor]:
        return {name: flat[off : off + math.prod(shape)].view(shape) for name, off, shape in self._layout[b]}

    def _bind(self, name: str, t: torch.Tensor) -> None:
        """A new parameter viewing ``t``, under every alias of ``name`` (tied weights stay one parameter)."""
        # requires_grad as a loaded model's: matmul picks its kernel path by it ([Note: same kernels])
        p = self._params[name] = nn.Parameter(t, requires_grad=True)
        for alias in self.table.aliases[name]:
            mod_path, _, leaf = alias.rpartition(".")
            (self.model.get_submodule(mod_path) if mod_path else self.model)._parameters[leaf] = p

    def _bind_block(self, b: int, views: dict[str, torch.Tensor]) -> None:
        """Point block ``b``'s parameters at ``views`` (host, device, or a slot): see [Note: slot lifetimes]."""
        params = self._params
        for name, t in views.items():
            params[name].data = t

    # ------------------------------------------------------------------ placement

    def prepare(self, batch: int, context: int, prefill: int | None = None, *, grow_only: bool = True) -> InferPlan:
        """Plan (and apply) the placement for ``batch`` sequences of up to ``context`` tokens, the longest
        prompt ``prefill``; refuses with :class:`~zerofit.infer.plan.InferencePlanError` before anything moves
        when it cannot fit. ``grow_only``: keep the current plan when it covers this request (else plan for
        this request alone, which may keep more blocks resident)."""
        prefill = context if prefill is None else prefill
        old = self.plan if grow_only else None
        if old is not None and old.batch >= batch and old.context >= context and old.prefill >= prefill:
            return old
        if old is not None:  # a larger plan may suit the new request: keep the larger of each dimension
            batch, context, prefill = max(batch, old.batch), max(context, old.context), max(prefill, old.prefill)
        plan = plan_inference(
            self.shape,
            self._device_budget(),
            batch,
            context,
            prefill,
            self.slots_wanted,
            RESERVE if self.dev.is_cuda else 0,
        )
        with torch.inference_mode(False):  # [Note: normal tensors]
            self._apply(plan)
        return plan

    def plan_for(self, batch: int, context: int, prefill: int | None = None) -> InferPlan:
        """The placement :meth:`prepare` would apply for this request, without applying it (refused as it would
        refuse it)."""
        prefill = context if prefill is None else prefill
        reserve = RESERVE if self.dev.is_cuda else 0
        return plan_inference(self.shape, self._device_budget(), batch, context, prefill, self.slots_wanted, reserve)

    def _device_budget(self) -> int | None:
        """``max_gpu_memory`` (or the whole GPU) less what other processes hold on it now, as the training
        engine plans; on the CPU the cap alone (None: no limit)."""
        if not self.dev.is_cuda:
            return self.cap
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)
        return min(self.cap or total, total) - max(others, 0)

    def _apply(self, plan: InferPlan) -> None:
        self._shell_back()
        self._drain()
        self._holding.clear()
        for b in list(self._dev):
            if b not in plan.resident:
                self._bind_block(b, self._host_views[b])
                del self._dev[b]
        if len(self._slots) != plan.slots:
            self._slots = []
            self._views.clear()
            if self.dev.is_cuda:
                torch.cuda.empty_cache()  # freed blocks back, so the new placement is not fragmented
            self._slots = [
                _Slot(torch.empty(plan.slot_bytes // self.shape.elem, dtype=self.dtype, device=self.device))
                for _ in range(plan.slots)
            ]
            self._views.clear()
        for b in plan.resident:
            if b not in self._dev:
                if self._host[b] is None:  # on the disk: read once, through a staging buffer
                    flat, stg = self._disk.take(b)
                    buf = torch.empty(self._sizes[b], dtype=self.dtype, device=self.device)
                    buf.copy_(flat)
                    self._disk.give_back(stg, None)
                elif self.dev.is_cuda:
                    buf = torch.empty(self._sizes[b], dtype=self.dtype, device=self.device)
                    buf.copy_(self._host[b], non_blocking=True)
                else:
                    buf = self._host[b]  # the CPU computes from the host buffer itself
                self._dev[b] = buf
                self._bind_block(b, self._flat_views(buf, b))
        self.dev.synchronize()
        self._cycle = list(plan.streamed)
        self._disk_cycle = [b for b in self._cycle if self._host[b] is None]
        self._next = 0
        self.plan = plan

    def _drain(self) -> None:
        for s in self._slots:
            if s.ready is not None:
                s.ready.synchronize()
            if s.free is not None:
                s.free.synchronize()

    # ------------------------------------------------------------------ streaming ([Note: the upload cycle])

    def _issue(self, slot: _Slot) -> None:
        b = self._cycle[self._next]
        self._next = (self._next + 1) % len(self._cycle)
        n = self._sizes[b]
        dev = self.dev
        src, stg = self._host[b], None
        if src is None:  # on the disk ([Note: staging buffers], disk.py)
            src, stg = self._disk.take(b)
        with dev.on(dev.upload):
            dev.wait(dev.upload, slot.free)
            start = dev.event(timing=True)
            if dev.is_cuda:
                start.record(dev.upload)
            slot.buf[:n].copy_(src, non_blocking=True)
            slot.ready = dev.event(timing=True)
            if dev.is_cuda:
                slot.ready.record(dev.upload)
                self._upload_marks.append((start, slot.ready))
                if len(self._upload_marks) > 256:
                    self._fold_marks(wait=False)
        if stg is not None:
            self._disk.give_back(stg, slot.ready if dev.is_cuda else None)
            dc = self._disk_cycle
            at = dc.index(b)
            for k in range(1, len(dc)):  # read the next disk blocks of the cycle into the free buffers
                if not self._disk.prefetch(dc[(at + k) % len(dc)]):
                    break
        self._holding[b] = slot
        self.uploads += 1
        self.upload_bytes += n * self.shape.elem

    def _prime(self, b: int) -> None:
        """Start the cycle at block ``b``: drain the slots, fill them with ``b`` and the blocks after it."""
        self._drain()
        self._holding.clear()
        self.primes += 1
        self._next = self._cycle.index(b)
        for s in self._slots:
            self._issue(s)

    def _enter(self, b: int) -> None:
        if b in self._dev:
            return
        if self.plan is None:
            raise RuntimeError("InferenceEngine: call prepare(batch, context) (or generate) before a forward")
        slot = self._holding.get(b)
        if slot is None:
            self._prime(b)
            slot = self._holding[b]
        self.dev.wait(self.dev.compute, slot.ready)
        key = (id(slot), b)
        views = self._views.get(key)
        if views is None:
            with torch.inference_mode(False):  # [Note: normal tensors]
                views = self._views[key] = self._flat_views(slot.buf, b)
        self._bind_block(b, views)

    def _exit(self, b: int) -> None:
        if b in self._dev:
            return
        slot = self._holding.pop(b)
        slot.free = self.dev.record(self.dev.compute)
        self._bind_block(b, self._host_views[b])
        self._issue(slot)

    # ------------------------------------------------------------------ use

    def __call__(self, *args, **kwargs):
        """The model's own forward (plan it first with :meth:`prepare`, or it is planned for this input)."""
        if self.plan is None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            B, T = (ids.shape[0], ids.shape[1]) if ids is not None else (1, 1)
            self.prepare(B, T, T)
        with torch.no_grad():
            return self.model(*args, **kwargs)

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 128,
        **kwargs,
    ):
        """transformers' ``generate`` on this model, after planning the placement for this batch and length.
        Every generation option of transformers applies (sampling, penalties, stop strings, streamers...);
        the KV cache is transformers' static one unless ``cache_implementation`` says otherwise."""
        B, T = input_ids.shape
        cfg = self.model.generation_config  # beams and returned sequences multiply the cache's batch
        copies = max(
            int(kwargs.get("num_beams") or cfg.num_beams or 1),
            int(kwargs.get("num_return_sequences") or cfg.num_return_sequences or 1),
        )
        self.prepare(B * copies, T + max_new_tokens, T)
        kwargs.setdefault("cache_implementation", "static")  # [Note: a KV cache allocated once]
        kwargs.setdefault("disable_compile", True)  # transformers compiles static-cache decoding on CUDA by default:
        #                                              the hooks swap parameters, which a compiled graph cannot see
        for m in self.model.modules():  # size the cache for this call, as planned: generate keeps the last
            m.__dict__.pop("_previous_max_cache_length", None)  # size on the model it runs (a PEFT model's base)
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.device)
        if self.tokenizer is not None and kwargs.get("stop_strings"):
            kwargs.setdefault("tokenizer", self.tokenizer)
        return self.model.generate(input_ids=input_ids, max_new_tokens=max_new_tokens, **kwargs)

    @property
    def disk_blocks(self) -> tuple[int, ...]:
        """The blocks whose weights live on the disk (read through a staging buffer at each use); () without one."""
        if self._disk is None:
            return ()
        return tuple(b for b in range(len(self._host)) if self._host[b] is None)

    def stats(self) -> dict:
        """The plan, and the uploads so far: count, bytes, busy seconds of the upload stream (CUDA events),
        cycle restarts."""
        self._fold_marks(wait=True)
        p = self.plan
        disk = self._disk
        return {
            "disk_blocks": len(disk.regions) if disk else 0,
            "disk_reads": disk.reads if disk else 0,
            "disk_read_bytes": disk.read_bytes if disk else 0,
            "primes": self.primes,
            "upload_seconds": round(self._upload_seconds, 4),
            "resident": len(p.resident) if p else None,
            "streamed": len(p.streamed) if p else None,
            "slots": p.slots if p else None,
            "streamed_bytes_per_forward": p.streamed_bytes if p else None,
            "device_bytes_planned": p.device_bytes if p else None,
            "uploads": self.uploads,
            "upload_bytes": self.upload_bytes,
            "dtype": str(self.dtype).replace("torch.", ""),
        }

    def _fold_marks(self, wait: bool) -> None:
        """Add the finished uploads' seconds to the total (all of them, after waiting, with ``wait``), so the
        timing events of a long generation do not pile up."""
        marks = self._upload_marks
        if wait and marks:
            marks[-1][1].synchronize()
        done = 0
        while done < len(marks) and (wait or marks[done][1].query()):
            done += 1
        self._upload_seconds += sum(a.elapsed_time(b) for a, b in marks[:done]) / 1000.0
        del marks[:done]

    def release_device(self) -> None:
        """[Note: an inference engine between its calls]
        Every device buffer given back, the engine usable: the resident blocks' copies and the slots go (the blocks
        view their host buffers again), the shell's weights move to host memory, and the next call plans and uploads
        again. An InferenceEngine that shares a GPU with a training engine's step (GRPO's reference model,
        zerofit/hf/rl.py) holds the device only during its own forwards so. Nothing to do on the CPU."""
        if not self.dev.is_cuda:
            return
        self._drain()
        self.dev.synchronize()
        for b in list(self._dev):
            self._bind_block(b, self._host_views[b])
        self._dev.clear()
        self._holding.clear()
        self._slots = []
        self._views.clear()
        self.plan = None
        for name in self.table.unit_names[0]:
            p = self._params[name]
            if p.device == self.device:
                host = self._shell_host.get(name)
                if host is None:
                    host = self._shell_host[name] = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                host.copy_(p.data)
                p.data = host
        torch.cuda.empty_cache()

    def _shell_back(self) -> None:
        """The shell's weights on the device again after :meth:`release_device`."""
        for name, host in self._shell_host.items():
            p = self._params[name]
            if p.device != self.device:
                p.data = host.to(self.device)

    def close(self) -> None:
        """Release the device buffers and the pinned arena (the engine is unusable afterwards)."""
        self._drain()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._slots.clear()
        self._views.clear()
        self._dev.clear()
        self._holding.clear()
        self.plan = None
        if self._arena is not None:
            self._arena.close()
        if self._disk is not None:
            self._disk.close()
            self._disk = None

    def __del__(self):
        # the swap file is removed with the engine (a process that dies leaves it to the next run, which
        # removes it: [Note: swap files are reused, never leaked], engine/disk/swapfile.py)
        disk = getattr(self, "_disk", None)
        if disk is not None:
            try:
                disk.close()
            except Exception:
                pass

    def summary(self) -> str:
        """The plan in one line, and where the blocks' weights are kept."""
        name = str(self.dtype).replace("torch.", "")
        text = f"{name} weights and KV cache ({self.dtype_origin}); "
        text += self.plan.summary() if self.plan else "not planned yet"
        if self._disk is not None:
            text += f"; {len(self._disk.regions)} blocks' weights on the disk ({self._disk.path})"
        return text


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def infer_shape(model: nn.Module, table, sizes: list[int], dtype: torch.dtype) -> InferShape:
    elem = torch.empty((), dtype=dtype).element_size()
    shell = sum(table.canonical[n].numel() for n in table.unit_names[0]) * elem
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    def get(*names, default=0):
        for n in names:
            v = getattr(text, n, None)
            if v:
                return int(v)
        return default

    hidden = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head", default=1)
    kv_heads = get("num_key_value_heads", default=heads)
    head_dim = get("head_dim", default=hidden // max(heads, 1))
    return InferShape(
        shell_bytes=shell,
        block_bytes=tuple(n * elem for n in sizes),
        layers=get("num_hidden_layers", "n_layer", default=len(sizes)),
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden=hidden,
        intermediate=get("intermediate_size", "n_inner", default=4 * hidden),
        vocab=get("vocab_size"),
        elem=elem,
    )
