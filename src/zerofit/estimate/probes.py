"""``zerofit estimate``'s compute probes: one block's seconds per micro-batch on this GPU, from two plain models
of n and 2n blocks (:func:`block_seconds`) and from the engine itself on a 2-block model
(:func:`engine_block_seconds`); estimate/predict.py's ``predict_step`` takes them."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from zerofit.engine.model.adapter import Adapter
from zerofit.engine.plan.search import BatchShape


def compute_dtype(cfg) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision]


def small_twin(model, layers: int, dtype: torch.dtype):
    """A model of ``model``'s shape with ``layers`` blocks, made on the current device (``torch.device`` as a
    context), its attention through SDPA: of the model's own class, or where ``model`` is a PEFT model, of its base
    model's class with the same adapters over it (their compute is part of the step, and PEFT's class has no
    constructor from a config)."""
    peft_config = getattr(model, "peft_config", None)
    base = model.get_base_model() if peft_config and hasattr(model, "get_base_model") else model
    mcfg = base.config
    small = mcfg.__class__.from_dict({**mcfg.to_dict(), "num_hidden_layers": layers})
    small._attn_implementation = "sdpa"
    m = type(base)._from_config(small, dtype=dtype)
    if base is not model:
        import copy

        from peft import get_peft_model

        m = get_peft_model(m, copy.deepcopy(peft_config[model.active_adapter]))
    return m


# block counts of the two plain models whose difference gives one block's time, largest first: for a 3B model 4 and 8
# blocks came out several percent short of the whole model's time per block, 8 and 16 within a fraction of a percent
# (bench/probes/compute_probe.py; docs/benchmarks.md, the estimate's compute, probed); a GPU without room for 16
# blocks falls back to the next pair
BLOCK_PAIRS = ((8, 16), (4, 8), (2, 4), (1, 2))


@dataclass
class ComputeProbe:
    """Seconds per micro-batch on this GPU: one block's forward + recompute + backward, the shell's (everything
    else, as a plain model runs it), and of that the engine's post pass (head and loss, over ``chunks`` token
    chunks with the shell's gradient accumulated in fp32, as the engine runs it) and the rest (``pre``:
    embeddings)."""

    per_block: float
    shell: float
    post: float
    pre: float
    forward_share: float = 0.25  # of a block's compute, its forward's (the rest: recompute and backward)
    source: str = "plain models"


@dataclass
class EngineProbe:
    """Seconds per micro-batch as the engine computes them (engine_block_seconds)."""

    per_block: float  # one block's forward + recompute + backward
    forward_share: float  # of it, the forward's
    pre: float  # the pre pass (embeddings) and its backward
    update: float = 0.0  # the device AdamW's seconds per parameter


def engine_block_seconds(
    model,
    batch: BatchShape,
    cfg,
    layers: int = 2,
    steps: int = 3,
    seconds: float = 2.0,
    device: str = "cuda",
    nf4: bool = False,
    tile: int | None = None,
    chunks: int = 1,
) -> EngineProbe | None:
    """One block's seconds per micro-batch, the forward's share of them, the pre pass's, and the device AdamW's
    seconds per parameter, as the engine itself computes them: the engine on a model of this shape with ``layers``
    blocks, all of them resident (no copies to wait for), the config's batch; from its steps' traces
    (engine.trace()): each block's first compute interval of a step is its forward, its second its recompute and
    backward (block-major over the micro-batches, the gradients added in fp32: what plain models do not do); the
    intervals labelled "pre" are the embeddings' forward and backward (the plain models' difference,
    block_seconds, leaves them in the noise: 0 for a 3B model, where the engine spends a few ms per micro-batch on
    them); those labelled "optimizer[block]" the blocks' updates on the device. ``nf4``: the base is held in NF4 (a
    4-bit folder's, or ``quantize_base``), so the probe's blocks are too. Steps run for ``seconds`` (``steps`` at
    least): the median step of the second half counts ([Note: the probe's clocks]). ``tile``: the plan's sequence
    tile, so that the blocks' recompute of their tiles is in the probe's time; ``chunks``: the plan's loss chunks
    (the probe's own plan, with no cap, would hold a long sequence's full-vocabulary logits at once). None where
    it does not fit (the fallback is the plain models' difference)."""
    import zerofit
    from zerofit.engine.plan.search import PlanError

    with torch.device("meta"):
        m = small_twin(model, layers, torch.float32)
    run = {
        "precision": cfg.precision,
        "micro_batch_size": batch.micro_batch,
        "seq_len": batch.seq_len,
        "gradient_accumulation_steps": batch.grad_accum,
        "device": device,
        "offload": {"resident_blocks": layers}
        | ({"sequence_tile": tile} if tile else {})
        | ({"loss_chunks": chunks} if chunks > 1 else {}),
        "quantize_base": "nf4" if nf4 else cfg.quantize_base,
        "kernels": cfg.kernels,
        "attention_backend": cfg.attention_backend,
    }
    try:
        engine = zerofit.initialize(m, run)
    except (PlanError, torch.cuda.OutOfMemoryError):
        return None
    try:
        names = {engine.adapter.block_prefix(i) for i in range(layers)}
        numel = sum(u.numel for u in engine.blocks)
        ids = torch.randint(0, model.config.vocab_size, (batch.micro_batch, batch.seq_len))

        def step() -> tuple[float, float, float, float]:
            # F821 waived below: ruff reads the finally's ``del engine`` as unbinding it here; step runs before that
            engine.train_batch([{"input_ids": ids, "labels": ids} for _ in range(batch.grad_accum)])  # noqa: F821
            return _probe_step(engine.trace(), names)  # noqa: F821

        fwd, bwd, pre, opt = _late_median(step, seconds, least=steps, key=lambda s: s[0] + s[1])
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not fwd or not bwd:
        return None
    return EngineProbe((fwd + bwd) / layers / batch.grad_accum, fwd / (fwd + bwd), pre / batch.grad_accum, opt / numel)


# [Note: the probe's clocks]
# The 2-block engine's steps are short (a 3B model's: about a tenth of a second); three of them, as the probe first
# ran, were a burst, and the whole model's blocks then computed several percent slower in a step of 1-2 s than the
# probe had timed them (docs/benchmarks.md, the estimate against the runs). The plain models' probe (block_seconds)
# runs for 2 s for the same reason: so that the GPU works at the clocks a long step holds. The engine's probe does
# too: it then timed the blocks a few percent slower than the three-step probe had, and the whole models' compute
# stayed a few percent longer than predicted (docs/benchmarks.md, the estimate against the runs).


def _probe_step(trace: list[dict], names: set[str]) -> tuple[float, float, float, float]:
    """One step's (forward, recompute + backward, pre pass, device updates) seconds of ``names``' blocks, from
    the engine's trace."""
    seen: dict[str, int] = {}
    fwd = bwd = pre = opt = 0.0
    for e in sorted(trace, key=lambda e: e["start"]):
        if e["lane"] != "compute":
            continue
        label, span = e["label"], e["end"] - e["start"]
        if label == "pre":
            pre += span
        elif label.startswith("optimizer[") and label[len("optimizer[") : -1] in names:
            opt += span
        elif label in names:
            k = seen[label] = seen.get(label, 0) + 1
            if k == 1:
                fwd += span
            elif k == 2:
                bwd += span
    return fwd, bwd, pre, opt


def block_seconds(
    model, batch: BatchShape, cfg, chunks: int = 1, seconds: float = 2.0, tile: int | None = None
) -> ComputeProbe:
    """The compute of a step, from two plain PyTorch models of this shape (activation checkpointing, compute
    dtype) with n and 2n blocks: the largest pair of BLOCK_PAIRS the model has blocks for and the GPU has room
    for; and the post pass, timed through the engine's own code (adapter.post_in_chunks) on the smaller one.

    Each runs its G micro-batches back to back, repeatedly, for ``seconds`` (the median of the second half is
    taken), so that the GPU works at the clocks a long step holds, not at a short burst's, and the per-block
    figure is a difference of two GPU-bound times."""
    mcfg = getattr(model, "config", None)
    if mcfg is None:
        raise ValueError("the compute is measured on a Hugging Face model's config")
    pairs = [p for p in BLOCK_PAIRS if p[1] <= mcfg.num_hidden_layers] or [BLOCK_PAIRS[-1]]
    for i, pair in enumerate(pairs):
        try:
            return _block_seconds(model, mcfg, pair, batch, cfg, chunks, seconds, tile)
        except torch.cuda.OutOfMemoryError:
            if i == len(pairs) - 1:
                raise
            gc.collect()
            torch.cuda.empty_cache()
    raise AssertionError("unreachable")


def _late_median(run, seconds: float, least: int = 4, key=None):
    """``run()`` called for ``seconds`` (``least`` times at least); the median of the second half of its results
    (by ``key``): the clocks a long step holds ([Note: the probe's clocks])."""
    results = []
    start = time.perf_counter()
    while len(results) < least or time.perf_counter() - start < seconds:
        results.append(run())
    late = sorted(results[len(results) // 2 :], key=key)
    return late[len(late) // 2]


def _median_late(run, seconds: float) -> float:
    """The median of the second half of ``run()``'s timings (GPU-synchronized), run for ``seconds``, 4 at least."""

    def timed() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    return _late_median(timed, seconds)


def _post_seconds(m, ids: torch.Tensor, chunks: int, seconds: float) -> float | None:
    """The engine's post pass on model ``m`` (adapter.post_in_chunks): head and loss over ``chunks`` token chunks
    from a final hidden state, backward, the shell's gradients added into fp32 buffers."""
    from torch.func import functional_call

    from zerofit.engine.model.adapter import post_in_chunks

    adapter = Adapter(m)
    if not adapter.streaming:  # a one-block model: no block list to stand the final hidden state in for
        return None
    inside = {id(p) for p in adapter.blocks.parameters()}
    named = [(n, p) for n, p in m.named_parameters() if id(p) not in inside]
    leaves = {n: p.detach().requires_grad_(True) for n, p in named}
    sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for _, p in named]
    call = lambda kw: functional_call(m, leaves, (), kw, strict=False)  # noqa: E731
    final = torch.randn(*ids.shape, m.config.hidden_size, dtype=next(m.parameters()).dtype, device=ids.device)
    batch = {"input_ids": ids, "labels": ids}

    def accumulate(grads):
        pairs = [(d, g) for d, g in zip(sums, grads) if g is not None]
        torch._foreach_add_([d for d, _ in pairs], [g for _, g in pairs])

    return _median_late(
        lambda: post_in_chunks(adapter, call, batch, final, list(leaves.values()), 1.0, chunks, accumulate), seconds / 2
    )


def _block_seconds(
    model, mcfg, pair: tuple[int, int], batch: BatchShape, cfg, chunks: int, seconds: float, tile: int | None = None
):
    """The blocks' and the embeddings' seconds from the pair's decoders alone (their final hidden state's backward
    from a cheap sum: the head and loss, a long sequence's largest tensors, are the post pass's, timed apart over
    the plan's chunks). ``tile``: the blocks over sequence tiles, as the engine runs them ([Note: a block over
    sequence tiles])."""
    from zerofit.engine.model import tiling
    from zerofit.engine.model.attention import Attention

    dev = torch.device("cuda", torch.cuda.current_device())
    shape = (batch.micro_batch, batch.seq_len)
    times, post = [], None
    for layers in pair:
        with torch.device(dev):
            m = small_twin(model, layers, compute_dtype(cfg))
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        if tile:
            tiling.install(Adapter(m).blocks, lambda: tile)
        ids = torch.randint(0, mcfg.vocab_size, (batch.micro_batch, batch.seq_len), device=dev)
        decoder = m.get_decoder()
        # [Note: attention's backend]: the kernel the run's blocks will run their attention on
        order = Attention(m, cfg.attention_backend, dev)

        def step(decoder=decoder, m=m, ids=ids, order=order):
            for _ in range(batch.grad_accum):
                with order.context(shape, compute_dtype(cfg)):
                    decoder(input_ids=ids, use_cache=False).last_hidden_state.float().square().mean().backward()
            m.zero_grad(set_to_none=True)

        times.append(_median_late(step, seconds) / batch.grad_accum)
        if post is None:  # the shell is the same in both models
            post = _post_seconds(m, ids, chunks, seconds)
        del m, ids, step, decoder, order  # step's defaults hold the model too
        gc.collect()
        torch.cuda.empty_cache()
    n = pair[1] - pair[0]
    per_block = max((times[1] - times[0]) / n, 0.0)
    pre = max(times[0] - pair[0] * per_block, 0.0)
    if post is None:
        return ComputeProbe(per_block, pre, pre, 0.0)
    return ComputeProbe(per_block, pre + post, post, pre)
