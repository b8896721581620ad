"""Shared pieces of the benchmark engines: workloads, model build, data, timing, results.

Not run directly; each ``bench/engine_<name>.py`` imports it, e.g.::

    python bench/engine_plain.py --workload smoke --device cpu --result /tmp/plain.json

The workloads are those of ``bench/WORKLOADS.md``: a Llama-architecture
model built from its ``LlamaConfig`` (sdpa attention, random initialisation),
uniform random tokens with ``labels = input_ids``, bf16 compute, AdamW (lr 1e-4,
weight decay 0.01), activation checkpointing on every decoder layer, 1 warm-up
step then timed steps. Every engine script writes one JSON result (schema:
:class:`Result`), rewritten after each step so a run killed by the harness's
timeout still leaves what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

# The process start, as early as this module can see it: psutil gives the real
# start (interpreter start-up and imports included); this is the fallback.
_IMPORT_TIME = time.time()

GiB = 2**30


# --------------------------------------------------------------------------- workloads


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark shape: the model's config fields and the batch."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    micro_batch: int = 2  # sequences per micro-batch
    seq: int = 2048  # tokens per sequence
    grad_accum: int = 4  # micro-batches per optimizer step
    cap: str | None = "24GiB"  # GPU memory cap for the offloading engines
    rope_theta: float = 10000.0
    max_positions: int = 4096
    lora: bool = False  # W6: LoRA (LORA below) over the frozen base, through peft.get_peft_model
    qlora: bool = False  # W6c: the base's linears in NF4 with double quantization (bitsandbytes' format)
    # llama: LlamaForCausalLM; t5: T5ForConditionalGeneration (seq input tokens, target_seq label tokens);
    # unet: anymodels.UNetLlama (Llama's layers with a U-Net's long skips: not a chain of blocks)
    family: str = "llama"
    target_seq: int = 0  # t5: label tokens per sequence

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * (self.seq + self.target_seq) * self.grad_accum


WORKLOADS: dict[str, Workload] = {
    # Llama-3.2-3B shape: 3.21 B parameters.
    "W1": Workload(
        "W1",
        hidden=3072,
        intermediate=8192,
        layers=28,
        heads=24,
        kv_heads=8,
        vocab=128256,
        tied=True,
        rope_theta=500000.0,
        max_positions=8192,
    ),
    # Llama-2-7B shape: 6.74 B parameters.
    "W2": Workload(
        "W2",
        hidden=4096,
        intermediate=11008,
        layers=32,
        heads=32,
        kv_heads=32,
        vocab=32000,
        tied=False,
        max_positions=4096,
    ),
    # Llama-2-13B shape (needs NVMe or a larger host; listed for completeness).
    "W3": Workload(
        "W3",
        hidden=5120,
        intermediate=13824,
        layers=40,
        heads=40,
        kv_heads=40,
        vocab=32000,
        tied=False,
        max_positions=4096,
    ),
    # The 13B shape with the same tokens per step in micro-batches of one (what fits an 8 GiB cap).
    "W3-mb1": Workload(
        "W3-mb1",
        hidden=5120,
        intermediate=13824,
        layers=40,
        heads=40,
        kv_heads=40,
        vocab=32000,
        tied=False,
        max_positions=4096,
        micro_batch=1,
        grad_accum=8,
    ),
    # W5: the 13B shape on two GPUs (run with --gpus 2), micro-batch 2 x 2048, 4 micro-batches per GPU.
    "W5": Workload(
        "W5",
        hidden=5120,
        intermediate=13824,
        layers=40,
        heads=40,
        kv_heads=40,
        vocab=32000,
        tied=False,
        max_positions=4096,
    ),
    # W1 and W3a with 32 micro-batches per step (WORKLOADS.md's disk-tier comparison at 32: the disk's traffic is
    # per optimizer step for zerofit, per micro-batch for DeepSpeed's parameters on the NVMe)
    # A toy for dry runs of the harness on CPU or GPU (seconds).
    "smoke": Workload(
        "smoke",
        hidden=256,
        intermediate=512,
        layers=4,
        heads=4,
        kv_heads=2,
        vocab=1024,
        tied=True,
        micro_batch=2,
        seq=128,
        grad_accum=4,
        cap=None,
        max_positions=512,
    ),
}

# W1 and W3a with 32 micro-batches per step (WORKLOADS.md's disk-tier comparison at 32: the disk's traffic is per
# optimizer step for zerofit, per micro-batch for DeepSpeed's parameters on the NVMe)
for _base in ("W1", "W2"):
    WORKLOADS[f"{_base}-ga32"] = dataclasses.replace(WORKLOADS[_base], name=f"{_base}-ga32", grad_accum=32)

# W6 (WORKLOADS.md): LoRA over a frozen bf16 base, batch as W1. W6a: the 13B shape at 24 GiB; W6b: at 8 GiB; W6c: a
# Llama-3-70B shape in QLoRA (NF4 base in host memory for zerofit; PEFT + bitsandbytes in the GPU for plain).
WORKLOADS["W6a"] = dataclasses.replace(WORKLOADS["W3"], name="W6a", lora=True)
WORKLOADS["W6b"] = dataclasses.replace(WORKLOADS["W3"], name="W6b", lora=True, cap="8GiB")
WORKLOADS["W6c"] = Workload(
    "W6c",
    hidden=8192,
    intermediate=28672,
    layers=80,
    heads=64,
    kv_heads=8,
    vocab=128256,
    tied=False,
    rope_theta=500000.0,
    max_positions=8192,
    lora=True,
    qlora=True,
)


# W6c cut to 8 of its 80 blocks (same widths, vocabulary and batch): its runs, and PEFT + bitsandbytes in the GPU
# beside them, fit a device call
WORKLOADS["W6c8"] = dataclasses.replace(WORKLOADS["W6c"], name="W6c8", layers=8)


# Long context (WORKLOADS.md has no such row; docs/long-context.md): one sequence per step, no accumulation, the
# sequence's length set with --seq. L8: the Llama-3.1-8B shape in LoRA, L8-full: in full fine-tuning; L13: the 13B
# shape (W3's) in LoRA.
WORKLOADS["L8"] = Workload(
    "L8",
    hidden=4096,
    intermediate=14336,
    layers=32,
    heads=32,
    kv_heads=8,
    vocab=128256,
    tied=False,
    rope_theta=500000.0,
    max_positions=131072,
    micro_batch=1,
    seq=32768,
    grad_accum=1,
    lora=True,
)
WORKLOADS["L8-full"] = dataclasses.replace(WORKLOADS["L8"], name="L8-full", lora=False)
WORKLOADS["L13"] = dataclasses.replace(WORKLOADS["W3"], name="L13", micro_batch=1, seq=65536, grad_accum=1, lora=True)


# Models that are not one chain of decoder blocks (bench/anymodels.py; docs/benchmarks.md, "Any model"). T5-XL and
# T5-XXL: Flan-T5's shapes (2.85 B and 11.3 B parameters), 8 sequences of 512 input and 128 target tokens per
# micro-batch, 4 micro-batches; U7: W2's Llama-2-7B shape as a U-Net, W2's batch.
WORKLOADS["T5-XL"] = Workload(
    "T5-XL",
    hidden=2048,
    intermediate=5120,
    layers=24,
    heads=32,
    kv_heads=32,
    vocab=32128,
    tied=False,
    micro_batch=8,
    seq=512,
    target_seq=128,
    family="t5",
)
WORKLOADS["T5-XXL"] = dataclasses.replace(WORKLOADS["T5-XL"], name="T5-XXL", hidden=4096, intermediate=10240, heads=64)
WORKLOADS["T5-smoke"] = dataclasses.replace(
    WORKLOADS["T5-XL"],
    name="T5-smoke",
    hidden=128,
    intermediate=256,
    layers=2,
    heads=2,
    micro_batch=2,
    seq=32,
    target_seq=8,
    vocab=512,
    cap=None,
)
WORKLOADS["U7"] = dataclasses.replace(WORKLOADS["W2"], name="U7", family="unet")
WORKLOADS["U-smoke"] = dataclasses.replace(WORKLOADS["smoke"], name="U-smoke", family="unet", tied=False)


def with_seq(w: Workload, seq: int | None) -> Workload:
    """``w`` with sequences of ``seq`` tokens (None: ``w``); its context at least that long."""
    if not seq or seq == w.seq:
        return w
    return dataclasses.replace(w, seq=seq, max_positions=max(w.max_positions, seq))


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """W6's adapters: PEFT LoRA r 16, alpha 32, dropout 0 on the seven linear layers of every block; AdamW lr 2e-4
    over the adapters (weight decay 0.01, as every workload)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lr: float = 2e-4


LORA = LoraSpec()


class Refused(Exception):
    """An engine that cannot run this workload as asked (the result's status "refused", exit code 2)."""


def lora_wanted(args, w: Workload) -> bool:
    """Whether this engine run trains LoRA (``--lora``, ``--qlora``, or a W6 workload)."""
    return bool(getattr(args, "lora", False) or w.lora or qlora_wanted(args, w))


def qlora_wanted(args, w: Workload) -> bool:
    """Whether the base's linears are in NF4 (``--qlora``, or W6c)."""
    return bool(getattr(args, "qlora", False) or w.qlora)


def build_qlora_model(w: Workload, device: str):
    """W6c's in-GPU peer, as bitsandbytes' users build it: :func:`build_nf4_model`, then PEFT's
    ``prepare_model_for_kbit_training`` (its fp32 cast of the rest, gradient checkpointing, input gradients), as
    QLoRA recipes call it."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(
        build_nf4_model(w, device),
        use_gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )


def nf4_config():
    """The ``BitsAndBytesConfig`` of W6c's base: NF4, double quantization, bf16 compute, uint8 storage."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def build_nf4_model(w: Workload, device: str):
    """The workload's model in bf16 with every linear layer of the blocks a ``bitsandbytes.nn.Linear4bit`` (NF4,
    double quantization, bf16 compute), quantized on ``device``. Built on the meta device,
    then one module at a time materialized and initialized there (Hugging Face's own ``_init_weights``) and each
    block's linears quantized before the next block: the bf16 base (137 GB for 70B) is never whole."""
    import bitsandbytes as bnb
    import torch
    from torch import nn
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(w))
    model.to(torch.bfloat16)

    def real(root):
        for m in root.modules():
            for k, p in list(m._parameters.items()):
                if p is not None and p.is_meta:
                    m._parameters[k] = nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad
                    )
            for k, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[k] = torch.empty(b.shape, dtype=b.dtype, device=device)
        with torch.no_grad():
            for m in reversed(list(root.modules())):  # children before parents, as initialize_weights
                model._init_weights(m)

    for m in (model.model.embed_tokens, model.model.norm, model.model.rotary_emb, model.lm_head):  # the shell
        real(m)
    for layer in model.model.layers:
        real(layer)
        for path, lin in list(layer.named_modules()):
            if type(lin) is nn.Linear:
                q = bnb.nn.Linear4bit(
                    lin.in_features,
                    lin.out_features,
                    bias=lin.bias is not None,
                    compute_dtype=torch.bfloat16,
                    compress_statistics=True,
                    quant_type="nf4",
                    device="meta",
                )
                q.weight = bnb.nn.Params4bit(
                    lin.weight.data, requires_grad=False, quant_type="nf4", compress_statistics=True
                ).to(device)
                if lin.bias is not None:
                    q.bias = lin.bias
                parent, _, leaf = path.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, leaf, q)
                del lin
    model.tie_weights()
    model.config.use_cache = False
    model.is_loaded_in_4bit = True  # as from_pretrained(quantization_config=...) marks it: PEFT's
    return model  # prepare_model_for_kbit_training turns on checkpointing only then


def lora_config():
    """PEFT's ``LoraConfig`` of :data:`LORA` (the same fields as zerofit's ``LoraOptions.config()``)."""
    from peft import LoraConfig

    return LoraConfig(
        r=LORA.r,
        lora_alpha=LORA.alpha,
        target_modules=list(LORA.targets),
        lora_dropout=LORA.dropout,
        task_type="CAUSAL_LM",
    )


def lora_wrap(base, seed: int = 0):
    """``peft.get_peft_model(base, lora_config())``. Adapters PEFT left on the meta device (a meta base) are made
    real on the CPU and given PEFT's own init (``reset_lora_parameters``: A Kaiming-uniform, B zero), seeded, as
    zerofit/lora/model.py's ``from_model_dir`` does for ``zerofit train --lora``."""
    from peft import get_peft_model

    return init_meta_adapters(get_peft_model(base, lora_config()), seed)


def init_meta_adapters(model, seed: int = 0):
    """A PEFT model's adapters that are still on the meta device, real on the CPU with PEFT's init, seeded."""
    import torch
    from peft.tuners.lora import LoraLayer

    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        for m in model.modules():
            if not isinstance(m, LoraLayer):
                continue
            for adapter in m.active_adapters:
                if not any(
                    p.is_meta for part in (m.lora_A, m.lora_B) if adapter in part for p in part[adapter].parameters()
                ):
                    continue
                for part in (m.lora_A, m.lora_B):
                    if adapter in part:
                        part[adapter] = part[adapter].to_empty(device="cpu").float()
                m.reset_lora_parameters(adapter, model.peft_config[adapter].init_lora_weights)
                for part in (m.lora_A, m.lora_B):  # Hugging Face's _init_weights (zerofit runs it on each unit
                    for p in part[adapter].parameters():  # of a meta model) leaves these values as PEFT made them
                        p._is_hf_initialized = True
    return model


def lora_counts(model) -> tuple[int, int]:
    """(trainable, frozen) parameter counts of a (PEFT) model, each tensor once; ZeRO-3 shards by ``ds_numel``."""
    seen, trainable, frozen = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        qs = getattr(p, "quant_state", None)  # bitsandbytes' Params4bit: two codes a byte
        n = getattr(p, "ds_numel", None) or (qs.shape.numel() if qs is not None else p.numel())
        if p.requires_grad:
            trainable += n
        else:
            frozen += n
    return trainable, frozen


def lora_record(res, model, qlora: bool = False) -> None:
    """The LoRA run's settings and parameter counts into its result (``qlora``: over an NF4 base)."""
    res.trainable_params, res.frozen_params = lora_counts(model)
    res.flops_per_param_token = 6
    res.extra["lora"] = {
        "r": LORA.r,
        "alpha": LORA.alpha,
        "dropout": LORA.dropout,
        "targets": list(LORA.targets),
        "lr": LORA.lr,
        "trainable": res.trainable_params,
        "frozen": res.frozen_params,
        "qlora": qlora,
    }
    print(
        f"[{res.engine}] LoRA r {LORA.r} alpha {LORA.alpha} on {','.join(LORA.targets)}: trainable "
        f"{res.trainable_params:,} of {res.trainable_params + res.frozen_params:,} parameters",
        flush=True,
    )


def llama_config(w: Workload):
    """The ``LlamaConfig`` of workload ``w`` (sdpa attention, no KV cache)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=w.vocab,
        hidden_size=w.hidden,
        intermediate_size=w.intermediate,
        num_hidden_layers=w.layers,
        num_attention_heads=w.heads,
        num_key_value_heads=w.kv_heads,
        max_position_embeddings=w.max_positions,
        rope_theta=w.rope_theta,
        tie_word_embeddings=w.tied,
        use_cache=False,
        attn_implementation="sdpa",
    )


def model_class(w: Workload):
    """The workload's model class: transformers' Llama or T5, or the U-Net of bench/anymodels.py."""
    if w.family == "t5":
        from transformers import T5ForConditionalGeneration

        return T5ForConditionalGeneration
    if w.family == "unet":
        from anymodels import UNetLlama

        return UNetLlama
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM


def model_config(w: Workload):
    """The workload's model config (its family's)."""
    if w.family == "t5":
        from anymodels import t5_config

        return t5_config(w)
    return llama_config(w)


def build_meta(w: Workload):
    """The workload's model on the meta device."""
    import torch

    with torch.device("meta"):
        return model_class(w)(model_config(w))


def batch_dict(item) -> dict:
    """One micro-batch as the model takes it: token ids (their own labels), or a (source, target) pair."""
    if isinstance(item, tuple):
        return {"input_ids": item[0], "labels": item[1]}
    return {"input_ids": item, "labels": item}


def zerofit_config(w: Workload, lora: bool = False) -> dict:
    """zerofit's config for workload ``w`` (WORKLOADS.md's common settings): bf16, AdamW lr 1e-4 (LoRA: 2e-4) and
    weight decay 0.01, activation checkpointing, the workload's batch."""
    return {
        "precision": "bf16",
        "micro_batch_size": w.micro_batch,
        "gradient_accumulation_steps": w.grad_accum,
        "optimizer": {"lr": LORA.lr if lora else 1e-4, "weight_decay": 0.01},
        "activation_checkpointing": True,
        "seq_len": w.seq,
    }


def count_parameters(w: Workload) -> int:
    """P: the model's parameter count (tied weights once), from a meta-device build."""
    return sum(p.numel() for p in build_meta(w).parameters())  # parameters() yields a tied one once


def build_model(w: Workload, device: str, dtype=None, init_in_dtype: bool = False):
    """The workload's ``LlamaForCausalLM``, randomly initialised on ``device``.

    Built on the meta device, materialised with ``to_empty`` and initialised once
    by Hugging Face's ``initialize_weights`` where it will live: no CPU fp32 copy
    of a GPU model, and no double initialisation (constructor, then post_init).
    ``initialize_weights`` also recomputes the rotary ``inv_freq`` buffers that
    ``to_empty`` leaves as garbage. fp32 unless ``dtype`` says otherwise; ``init_in_dtype``: materialized and
    initialized in ``dtype`` itself (no fp32 copy first: the 13B base's 52 GB would be the GPU peak of W6's plain run).
    """
    import torch

    model = build_meta(w)
    if dtype is not None and init_in_dtype:
        model.to(dtype)
    model.to_empty(device=device)
    with torch.device(device):
        model.initialize_weights()
    model.tie_weights()
    if dtype is not None:
        model.to(dtype)
    return model


def enable_checkpointing(model) -> None:
    """Activation checkpointing on every decoder layer, non-reentrant (HF's switch)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()


def make_batches(w: Workload, steps: int, seed: int = 0):
    """``steps`` optimizer steps of uniform random tokens on the CPU.

    Returns a list (per step) of lists (per micro-batch) of int64 tensors of
    shape (micro_batch, seq); labels are the same tensor (the model shifts them). An encoder-decoder's micro-batch is
    a pair: (micro_batch, seq) input tokens and (micro_batch, target_seq) labels (:func:`batch_dict`).
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    if w.family == "t5":
        return [
            [
                (
                    torch.randint(2, w.vocab, (w.micro_batch, w.seq), generator=g),
                    torch.randint(2, w.vocab, (w.micro_batch, w.target_seq), generator=g),
                )
                for _ in range(w.grad_accum)
            ]
            for _ in range(steps)
        ]
    return [
        [torch.randint(0, w.vocab, (w.micro_batch, w.seq), generator=g) for _ in range(w.grad_accum)]
        for _ in range(steps)
    ]


# --------------------------------------------------------------------------- GPU memory


def parse_bytes(value: str | None) -> int | None:
    """``"24GiB"`` -> 25769803776; ``None``, ``""``, ``"none"`` -> ``None`` (no cap)."""
    if value is None or str(value).strip().lower() in ("", "none", "0"):
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"expected a size such as 24GiB, found {value!r}")
    units = {
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    return int(float(m.group(1)) * units[(m.group(2) or "b").lower()])


def set_gpu_cap(cap: str | None, device: str) -> int | None:
    """Cap this process's CUDA caching allocator at ``cap`` bytes, before anything is allocated.

    ``torch.cuda.set_per_process_memory_fraction(cap / total)``: a 139 GiB card
    then behaves like a ``cap`` one (allocations past it raise OutOfMemoryError).
    """
    cap_bytes = parse_bytes(cap)
    if cap_bytes is None or not device.startswith("cuda"):
        return None
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), 0)
    return cap_bytes


# --------------------------------------------------------------------------- measurement


def process_start_time() -> float:
    """Wall-clock time at which this process started (psutil), or when this module was imported."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - psutil missing or /proc unreadable: fall back
        return _IMPORT_TIME


def peak_rss_gib() -> float:
    """This process's peak resident set (``ru_maxrss``, KiB on Linux), in GiB; pinned pages count."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB


class HostMemorySampler:
    """Samples, on a daemon thread, this process's RSS and the host's used memory (peaks).

    ``ru_maxrss`` is the headline figure; this adds the host-wide view (page
    cache excluded), which is what the kernel's OOM killer looks at.
    """

    def __init__(self, interval_s: float = 0.5):
        self.peak_rss = 0
        self.peak_host_used = 0
        self._stop = threading.Event()
        try:
            import psutil

            self._proc, self._psutil = psutil.Process(), psutil
        except Exception:  # noqa: BLE001
            self._proc = None
            return
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.peak_rss = max(self.peak_rss, self._proc.memory_info().rss)
                vm = self._psutil.virtual_memory()
                self.peak_host_used = max(self.peak_host_used, vm.total - vm.available)
            except Exception:  # noqa: BLE001 - sampling is best effort
                pass


class PeakKeeper:
    """Keeps the GPU's peak allocation across ``torch.cuda.reset_peak_memory_stats`` calls.

    Engines may reset the allocator's peak counters (zerofit does at the end of
    ``initialize``); the benchmark's figure is the peak over the whole process,
    so the reset is wrapped to remember ``max_memory_allocated`` first.
    """

    def __init__(self):
        import torch

        self.allocated = 0  # bytes, the largest peak seen before a reset
        self.reserved = 0
        original = torch.cuda.reset_peak_memory_stats

        def reset_peak_memory_stats(*args, **kwargs):
            if torch.cuda.is_initialized():
                self.allocated = max(self.allocated, torch.cuda.max_memory_allocated())
                self.reserved = max(self.reserved, torch.cuda.max_memory_reserved())
            return original(*args, **kwargs)

        torch.cuda.reset_peak_memory_stats = reset_peak_memory_stats
        torch.cuda.memory.reset_peak_memory_stats = reset_peak_memory_stats


@dataclasses.dataclass
class Result:
    """What one engine measured on one workload; written as JSON by :meth:`save`."""

    engine: str
    workload: str
    status: str = "running"  # running | ok | OOM | timeout | error | refused
    error: str = ""  # last line of the error, if any
    device: str = ""  # e.g. "NVIDIA H200" or "cpu"
    cap_gib: float | None = None  # GPU memory cap, None = uncapped
    params: int = 0  # P
    tokens_per_step: int = 0  # T
    warmup_steps: int = 1
    step_s: list[float] = dataclasses.field(default_factory=list)  # every step, warm-up included
    losses: list[float] = dataclasses.field(default_factory=list)
    setup_s: float | None = None  # process start -> model and optimizer ready
    first_step_s: float | None = None  # process start -> end of the first step
    peak_gpu_gib: float | None = None  # torch.cuda.max_memory_allocated over the whole run
    peak_gpu_reserved_gib: float | None = None
    peak_rss_gib: float | None = None  # ru_maxrss
    trainable_params: int | None = None  # LoRA: the adapters' parameters (None: every parameter trains)
    frozen_params: int | None = None  # LoRA: the frozen base's
    flops_per_param_token: int = 8  # model FLOPs per parameter and token: 8 (fwd, recompute, dX, dW); LoRA 6 (no dW)
    peak_host_used_gib: float | None = None  # host-wide used memory, sampled
    timeline: dict[str, Any] | None = None  # zerofit: seconds per phase of the last step
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # engine-specific
    versions: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def timed_s(self) -> list[float]:
        return self.step_s[self.warmup_steps :]

    def summary(self) -> dict[str, Any]:
        """Derived figures: median s/step over the timed steps, tokens/s, model TFLOP/s (8*P*T/s; LoRA 6*P*T/s),
        and the timed steps judged (:func:`step_check`: too few of them, one over 1.5x the median and what it paid)."""
        timed = self.timed_s
        check = step_check(self.step_s, self.warmup_steps, self.extra.get("timelines"))
        if not timed:
            return {"s_per_step": None, "tokens_per_s": None, "tflops": None, "step_check": check}
        s = statistics.median(timed)
        return {
            "s_per_step": s,
            "tokens_per_s": self.tokens_per_step / s,
            "tflops": self.flops_per_param_token * self.params * self.tokens_per_step / s / 1e12,
            "step_check": check,
        }

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(self.summary())
        return d

    def save(self, path: str | None) -> None:
        if not path:
            return
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1, default=str)
        os.replace(tmp, path)  # atomic: the harness never reads half a file


MIN_TIMED_STEPS = 3  # a figure is the median of at least this many timed steps (bench/run.py --min-timed)
SLOW_STEP_FACTOR = 1.5  # a timed step longer than this times the median is flagged


def step_check(
    step_s: list[float],
    warmup: int,
    timelines: list | None = None,
    factor: float = SLOW_STEP_FACTOR,
    min_timed: int = MIN_TIMED_STEPS,
) -> dict[str, Any]:
    """The timed steps judged, so that a slow step is not read as the speed.

    ``step_s``: every step's seconds, the ``warmup`` first untimed; ``timelines``: one dict of seconds per phase for
    each step (zerofit's ``engine.timeline()``; None where an engine has none). Returns ``timed`` (how many),
    ``enough`` (at least ``min_timed``: with two, the median is their mean and one slow step moves it by half),
    ``median_s``, and ``slow``: each timed step over ``factor`` times the median, as ``{"step", "s", "x_median",
    "paid"}``, where ``paid`` lists the phases of its timeline that ran longer than the same phase's median over
    the timed steps, ``[phase, seconds more]``, the largest first (those above 5% of the median step)."""
    timed = [float(s) for s in step_s[warmup:]]
    out: dict[str, Any] = {"timed": len(timed), "enough": len(timed) >= min_timed, "median_s": None, "slow": []}
    if not timed:
        return out
    med = statistics.median(timed)
    out["median_s"] = round(med, 4)
    lines = list(timelines or [])
    timed_lines = [t for t in lines[warmup : len(step_s)] if isinstance(t, dict)]
    for i, s in enumerate(timed):
        if s <= factor * med:
            continue
        n = warmup + i
        entry: dict[str, Any] = {"step": n, "s": round(s, 3), "x_median": round(s / med, 2)}
        line = lines[n] if n < len(lines) and isinstance(lines[n], dict) else None
        if line is not None:
            paid = []
            for phase, v in line.items():
                if phase == "step" or not isinstance(v, (int, float)):
                    continue  # "step" is the wall time itself
                same = [t[phase] for t in timed_lines if isinstance(t.get(phase), (int, float))]
                more = float(v) - statistics.median(same)
                if more > 0.05 * med:
                    paid.append([phase, round(more, 3)])
            entry["paid"] = sorted(paid, key=lambda p: -p[1])
        out["slow"].append(entry)
    return out


def step_check_text(check: dict[str, Any], min_timed: int = MIN_TIMED_STEPS) -> str:
    """One line for the table's note: too few timed steps, and each slow step with what it paid for ("" if none)."""
    parts = []
    if check.get("timed") and not check.get("enough"):
        parts.append(f"only {check['timed']} timed step{'s' if check['timed'] > 1 else ''} (fewer than {min_timed})")
    for e in check.get("slow", []):
        text = f"step {e['step']} took {e['s']:.2f} s, {e['x_median']:.1f}x the median {check['median_s']:.2f} s"
        if e.get("paid"):
            text += ": " + ", ".join(f"{phase} +{more:.2f} s" for phase, more in e["paid"])
        elif "paid" in e:
            text += ": no phase of its timeline over its median"
        parts.append(text)
    return "; ".join(parts)


def is_oom(exc: BaseException) -> bool:
    """True for CUDA (or host allocator) out-of-memory errors."""
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except Exception:  # noqa: BLE001
        pass
    msg = str(exc).lower()
    return isinstance(exc, MemoryError) or "out of memory" in msg or "cudaerrormemoryallocation" in msg


def last_line(exc: BaseException) -> str:
    """``Type: first non-empty line of the message`` (the useful line of a long CUDA error)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


# --------------------------------------------------------------------------- the driver


def engine_args(description: str) -> argparse.ArgumentParser:
    """The options every engine script takes (engines add their own)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="smoke", choices=sorted(WORKLOADS))
    p.add_argument("--steps", type=int, default=4, help="optimizer steps, warm-up included (default 4)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps (default 1)")
    p.add_argument("--device", default="cuda", help="cuda or cpu (cpu: smoke tests)")
    p.add_argument("--cap", default=None, help="GPU memory cap, e.g. 24GiB; 'none' = uncapped; default: the workload's")
    p.add_argument("--result", default=None, help="write the result JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lora",
        action="store_true",
        help="W6's LoRA (r 16, alpha 32, dropout 0, the 7 linears; AdamW lr 2e-4) over the frozen base "
        "through peft.get_peft_model; implied by W6a, W6b",
    )
    p.add_argument(
        "--qlora",
        action="store_true",
        help="W6c's QLoRA: --lora with the blocks' linears in NF4 (bitsandbytes' format); implied by W6c",
    )
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence instead of the workload's")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per micro-batch instead of the workload's, the tokens per step kept (more "
        "micro-batches): a peer that holds less at once",
    )
    return p


def with_micro_batch(w: Workload, m: int | None) -> Workload:
    """``w`` in micro-batches of ``m`` sequences, its tokens per step kept (None: ``w``)."""
    if not m or m == w.micro_batch:
        return w
    if (w.micro_batch * w.grad_accum) % m:
        raise ValueError(
            f"{w.name}: {w.micro_batch * w.grad_accum} sequences per step do not split into micro-batches of {m}"
        )
    return dataclasses.replace(w, micro_batch=m, grad_accum=w.micro_batch * w.grad_accum // m)


def versions(*modules: str) -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", *modules):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            out[name] = f"unavailable ({type(e).__name__})"
    return out


def run_engine(
    name: str, args, setup: Callable, step: Callable, *, uses_cap: bool = True, version_modules: tuple[str, ...] = ()
) -> int:
    """Time an engine: ``setup(args, w, result) -> state``, then ``step(state, micro_batches) -> loss``.

    ``step`` runs one optimizer step over the workload's micro-batches (CPU int64
    tensors) and returns the loss as a float (the float() is the sync point that
    makes the wall-clock time honest). Writes ``args.result`` after setup and
    after every step; returns the process exit code (0 ok, 1 error, 3 OOM).
    """
    w = with_micro_batch(WORKLOADS[args.workload], getattr(args, "micro_batch", None))
    w = with_seq(w, getattr(args, "seq", None))
    if args.cap is None:
        args.cap = w.cap
    # several ranks (torchrun): each trains its own micro-batches, the step's tokens are every rank's; rank r
    # writes its result beside rank 0's (``RESULT.rank<r>``)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if rank:
        args.result = f"{args.result}.rank{rank}" if args.result else None
    res = Result(engine=name, workload=w.name, warmup_steps=args.warmup, tokens_per_step=w.tokens_per_step * world)
    if world > 1:
        res.extra["world_size"], res.extra["rank"] = world, rank
    res.cap_gib = (parse_bytes(args.cap) / GiB) if parse_bytes(args.cap) else None
    t0 = process_start_time()
    sampler = HostMemorySampler()
    peaks = None
    code = 0
    try:
        res.params = count_parameters(w)
        if args.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available (use --device cpu for smoke tests)")
            if world > 1:
                torch.cuda.set_device(local)
            res.device = torch.cuda.get_device_name(local) + (f" x{world}" if world > 1 else "")
            peaks = PeakKeeper()
            if uses_cap:
                set_gpu_cap(args.cap, f"cuda:{local}" if world > 1 else args.device)
        else:
            res.device = "cpu"
        res.versions = versions(*version_modules)  # after the cap: an import may touch CUDA
        print(
            f"[{name}] {w.name}: P={res.params / 1e9:.3f} B, T={w.tokens_per_step} tokens/step, "
            f"cap={args.cap}, device={res.device}",
            flush=True,
        )
        batches = make_batches(w, args.steps, args.seed + rank)
        state = setup(args, w, res)
        res.setup_s = time.time() - t0
        print(f"[{name}] ready after {res.setup_s:.1f} s", flush=True)
        res.save(args.result)
        for i in range(args.steps):
            t = time.perf_counter()
            loss = float(step(state, batches[i]))
            dt = time.perf_counter() - t
            res.step_s.append(dt)
            res.losses.append(loss)
            if res.timeline is not None or "timelines" in res.extra:  # each step's phases, for step_check
                res.extra.setdefault("timelines", [None] * (len(res.step_s) - 1)).append(
                    dict(res.timeline) if res.timeline is not None else None
                )
            if i == 0:
                res.first_step_s = time.time() - t0
            _record_memory(res, args.device, sampler, peaks)
            print(
                f"[{name}] step {i} ({'warm-up' if i < args.warmup else 'timed'}): {dt:.3f} s, loss {loss:.4f}",
                flush=True,
            )
            res.save(args.result)
        res.status = "ok"
    except Refused as e:
        res.status, res.error, code = "refused", str(e), 2
    except BaseException as e:  # noqa: BLE001 - every failure becomes a result line
        traceback.print_exc()
        res.status = "OOM" if is_oom(e) else "error"
        res.error = last_line(e)
        code = 3 if res.status == "OOM" else 1
    _record_memory(res, args.device, sampler, peaks)
    res.save(args.result)
    s = res.summary()
    if s["tokens_per_s"]:
        print(
            f"[{name}] {res.status}: {s['tokens_per_s']:.0f} tokens/s, {s['tflops']:.1f} TFLOP/s, "
            f"{s['s_per_step']:.3f} s/step, peak GPU {res.peak_gpu_gib} GiB, "
            f"peak RSS {res.peak_rss_gib:.1f} GiB",
            flush=True,
        )
        if step_check_text(s["step_check"]):
            print(f"[{name}] steps: {step_check_text(s['step_check'])}", flush=True)
    else:
        print(f"[{name}] {res.status}: {res.error}", flush=True)
    return code


def _record_memory(res: Result, device: str, sampler: HostMemorySampler, peaks: PeakKeeper | None) -> None:
    res.peak_rss_gib = round(peak_rss_gib(), 3)
    res.peak_host_used_gib = round(sampler.peak_host_used / GiB, 3) if sampler.peak_host_used else None
    if device.startswith("cuda"):
        try:
            import torch

            if torch.cuda.is_initialized():
                allocated = max(torch.cuda.max_memory_allocated(), peaks.allocated if peaks else 0)
                reserved = max(torch.cuda.max_memory_reserved(), peaks.reserved if peaks else 0)
                res.peak_gpu_gib = round(allocated / GiB, 3)
                res.peak_gpu_reserved_gib = round(reserved / GiB, 3)
        except Exception:  # noqa: BLE001 - after a CUDA error the context may be unusable
            pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT of a one-process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> None:
    """Environment of a one-rank torch.distributed job (rank 0 of 1, on 127.0.0.1)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)


def exit_now(code: int) -> None:
    """Exit at once, the result being saved: no teardown of process groups, worker
    threads or pinned buffers, which can hang or take long after a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
