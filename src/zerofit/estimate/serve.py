"""``zerofit estimate --serve``: the placement ``zerofit serve`` would choose for a concurrency and a context, from
the model's shape alone (nothing allocated): the KV cache of ``concurrency x context`` tokens, the blocks kept
resident and streamed, and the bytes that cross per step (shared by every request of the step).

    plan = serve_plan(meta_model(shape="llama-2-13b"), max_gpu_memory="24GiB", concurrency=16, context=4096)
"""

from __future__ import annotations

import math

from zerofit.config.schema import parse_bytes
from zerofit.infer.plan import RESERVE, InferPlan, InferShape, plan_inference, row_prefill


def serve_shape(model, dtype=None) -> InferShape:
    """What the inference planner needs of ``model`` (on the meta device), as InferenceEngine measures it: the
    shell's bytes and each block's, aligned as its flat buffers are, in ``dtype`` (None: bf16, a named shape's
    published weights; :func:`estimate_serve` passes a folder's own)."""
    import torch

    from zerofit.engine.model.adapter import Adapter
    from zerofit.engine.model.materialize import param_table
    from zerofit.infer.engine import aligned, as_dtype, infer_shape

    adapter = Adapter(model, "auto")
    table = param_table(model, adapter)
    canon = dict(table.canonical)
    sizes = [
        sum(aligned(math.prod(canon[n].shape)) for n in table.unit_names[b + 1]) for b in range(adapter.num_blocks)
    ]
    return infer_shape(model, table, sizes, as_dtype(dtype) or torch.bfloat16)


def serve_plan(
    model,
    *,
    max_gpu_memory=None,
    concurrency: int = 8,
    context: int = 4096,
    prefill_tokens: int | None = None,
    dtype=None,
    slots: int = 2,
    gpu: bool = True,
) -> InferPlan:
    """The plan of ``zerofit serve --max-batch concurrency --context context`` at its full batch (its Scheduler checks
    the same at start, and plans this way for the rows in flight: [Note: a plan that follows the batch]);
    :class:`~zerofit.infer.plan.InferencePlanError` with what fits when nothing does."""
    shape = serve_shape(model, dtype)
    prefill = row_prefill(context, prefill_tokens, concurrency)
    cap = parse_bytes(max_gpu_memory, "max_gpu_memory")
    return plan_inference(shape, cap, concurrency, context, prefill, slots, RESERVE if gpu else 0)


def render(plan: InferPlan, pcie_gb_per_s: float | None = None, alone: InferPlan | None = None) -> str:
    """The plan in words; with a host-to-device bandwidth, the PCIe bound of one decode step for the batch;
    ``alone``: the plan of one request in flight."""
    lines = [
        f"zerofit serve --max-batch {plan.batch} --context {plan.context}, the full batch:",
        f"  {plan.summary()}",
        f"  KV cache: rows for the requests in flight (1, 2, 4, ... up to {plan.batch}) x {plan.context} tokens; "
        "the memory of the rows not held keeps blocks resident",
    ]
    if plan.streamed and pcie_gb_per_s:
        step = plan.streamed_bytes / (pcie_gb_per_s * 1e9)
        lines.append(
            f"  one decode step streams {plan.streamed_bytes / 1e9:.2f} GB: >= {step * 1e3:.0f} ms at "
            f"{pcie_gb_per_s:g} GB/s, shared by the step's requests (up to {plan.batch / step:.1f} tokens/s at a "
            "full batch, before compute binds)"
        )
    if alone is not None and alone is not plan:
        lines.append(f"  one request in flight: {alone.summary()}")
        if alone.streamed and pcie_gb_per_s:
            step = alone.streamed_bytes / (pcie_gb_per_s * 1e9)
            lines.append(f"    {alone.streamed_bytes / 1e9:.2f} GB a token: up to {1 / step:.1f} tokens/s")
    return "\n".join(lines)


def estimate_serve(
    model_dir=None, shape: str | None = None, *, max_gpu_memory=None, concurrency: int = 8, context: int | None = None,
    gpu: bool = True, pcie_gb_per_s: float | None = 25.0,
) -> tuple[dict, str]:  # fmt: skip
    """``zerofit estimate --serve``'s answer: (a JSON-able dict, the text). The context defaults as ``zerofit
    serve``'s does (the model's, at most 4096); a plan that cannot fit gives ``fits: false`` and what would."""
    from zerofit.estimate.shapes import meta_model
    from zerofit.infer.plan import InferencePlanError
    from zerofit.models.directory import positions

    model = meta_model(model_dir, shape)
    if getattr(model.config, "is_encoder_decoder", False):  # no chain of decoder blocks to keep or stream
        arch = ", ".join(getattr(model.config, "architectures", None) or [model.config.model_type])
        why = (
            f"an encoder-decoder ({arch}) is served through the hooked mode's generate, one batch of requests at a "
            "time, its layers streamed as the training engine plans them (docs/serve.md); --serve plans the KV "
            "cache and the blocks of a decoder-only model. `zerofit estimate --model DIR` gives the hooked mode's "
            "placement"
        )
        return {"fits": False, "concurrency": concurrency, "refusal": why}, f"refused: {why}"
    own, _ = positions(model.config)
    ctx = context or min(own or 4096, 4096)
    dtype = None  # a named shape: bf16; a folder: its own, as zerofit serve holds it ([Note: the model's own dtype])
    if model_dir is not None:
        from zerofit.models import ModelDir

        dtype = ModelDir.open(model_dir, config_only=True).dtype()
    try:
        plan = serve_plan(
            model, max_gpu_memory=max_gpu_memory, concurrency=concurrency, context=ctx, dtype=dtype, gpu=gpu
        )
        alone = (
            serve_plan(model, max_gpu_memory=max_gpu_memory, concurrency=1, context=ctx, dtype=dtype, gpu=gpu)
            if concurrency > 1
            else plan
        )
    except InferencePlanError as e:
        return {"fits": False, "concurrency": concurrency, "context": ctx, "refusal": str(e)}, f"refused: {e}"
    info = {
        "fits": True,
        "concurrency": concurrency,
        "context": ctx,
        "kv_cache_bytes": plan.kv_bytes,
        "resident_blocks": len(plan.resident),
        "streamed_blocks": len(plan.streamed),
        "streamed_bytes_per_step": plan.streamed_bytes,
        "device_bytes": plan.device_bytes,
        "one_request": {"resident_blocks": len(alone.resident), "streamed_bytes_per_step": alone.streamed_bytes},
    }
    return info, render(plan, pcie_gb_per_s if gpu else None, alone)
