"""``zerofit estimate --grpo``: a GRPO run's three phases planned before it runs ([Note: GRPO on the engine],
zerofit/hf/rl.py): the completions' generation on the training engine's own placement, the scoring forwards (the
reference's, the old policy's), and the training step over prompt + completion.

The training step is :func:`~zerofit.estimate.predict.estimate`'s, at the run's batch: ``prompts x generations``
sequences of ``prompt + completion`` tokens per optimizer step, in micro-batches. Generation runs between steps on
the same device placement (the shell, the resident blocks, the weight slots: the engine's ``generate`` streams the
other blocks through the slots) with the model's key/value cache of every sequence beside it, so the device must hold
that cache where the step's activations were; each decode step uploads every streamed block once, for all sequences
at once. The scoring forwards are forward passes over the step's tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from zerofit.engine.plan.engine_plan import DTYPES
from zerofit.engine.plan.generation import (
    blocks_kept,
    device_item,
    generation_bytes,
    generation_refusal,
    streamed_per_token,
)
from zerofit.engine.plan.plan import fmt_bytes
from zerofit.estimate.predict import FORWARD_SHARE, Estimate


@dataclass
class GRPOEstimate:
    training: Estimate
    prompts: int
    generations: int
    prompt_len: int
    completion_len: int
    scoring_passes: int  # forwards over the step's tokens besides the training one: the reference's, the old policy's
    kv_bytes: int = 0
    generation_device_bytes: int = 0
    device_budget: int | None = None
    kept_blocks: int = 0  # streamed blocks the generation keeps on the device ([Note: generation keeps blocks])
    streamed_bytes_per_token: int = 0  # the weights one decode step uploads, for every sequence at once
    upload_gb_per_s: float | None = None
    generation_s: float | None = None  # a floor: the decode steps' uploads at the measured speed
    scoring_s: float | None = None
    training_s: float | None = None
    refusal: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def sequences(self) -> int:
        return self.prompts * self.generations

    @property
    def step_s(self) -> float | None:
        parts = (self.generation_s, self.scoring_s, self.training_s)
        return None if any(p is None for p in parts) else sum(parts)  # type: ignore[arg-type]

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "training"}
        d["sequences"], d["step_s"], d["training"] = self.sequences, self.step_s, self.training.to_dict()
        return d

    def render(self) -> str:
        n, T = self.sequences, self.prompt_len + self.completion_len
        lines = [
            f"GRPO: {self.prompts} prompts x {self.generations} generations = {n} sequences of {self.prompt_len} + "
            f"{self.completion_len} tokens per step",
        ]
        budget = f" of {fmt_bytes(self.device_budget)}" if self.device_budget else ""
        gen = (
            f"  generation: the KV cache of {n} x {T} tokens {fmt_bytes(self.kv_bytes)}, beside the plan's shell, "
            f"resident blocks and slots, and {self.kept_blocks} streamed blocks kept for the call: "
            f"{fmt_bytes(self.generation_device_bytes)} of the device{budget}; each decode step uploads "
            f"{fmt_bytes(self.streamed_bytes_per_token)} of streamed weights for all {n}"
        )
        if self.generation_s is not None and self.upload_gb_per_s:
            gen += (
                f" (>= {self.generation_s / self.completion_len * 1e3:.0f} ms at {self.upload_gb_per_s:.1f} GB/s: "
                f">= {self.generation_s:.1f} s for {self.completion_len} tokens)"
            )
        if self.training.plan is not None:  # (a refused step has no placement to generate on)
            lines.append(gen)
        if self.scoring_passes:
            s = f", ~{self.scoring_s:.1f} s" if self.scoring_s is not None else ""
            lines.append(f"  scoring: {self.scoring_passes} forward pass(es) over the step's tokens{s}")
        lines.append("  training step:")
        lines += ["    " + line for line in self.training.render().splitlines()]
        if self.step_s is not None:
            lines.append(f"  one GRPO step: >= {self.step_s:.1f} s (generation, scoring, training)")
        lines += [f"  note: {x}" for x in self.notes]
        if self.refusal:
            lines.append(f"refused: {self.refusal}")
        return "\n".join(lines)


def estimate_grpo(
    model,
    config: dict,
    *,
    prompt_len: int,
    completion_len: int,
    generations: int,
    prompts: int = 1,
    micro_batch_size: int | None = None,
    beta: float = 0.0,
    num_iterations: int = 1,
    lora=None,
    measure: bool = True,
    gpu: bool = True,
) -> GRPOEstimate:
    """Plan a GRPO run of ``model`` (meta, or a folder) under ``config``. ``beta`` > 0 scores a reference (a full
    fine-tuning's second model, or LoRA's base with the adapters off), ``num_iterations`` > 1 the old policy."""
    import torch

    from zerofit.estimate import estimate
    from zerofit.estimate.serve import serve_shape
    from zerofit.estimate.shapes import meta_model

    n = prompts * generations
    mb = micro_batch_size or generations
    if n % mb:
        raise ValueError(f"micro_batch_size {mb} does not divide the step's {prompts} x {generations} sequences")
    est = estimate(
        model,
        config,
        measure=measure,
        gpu=gpu,
        lora=lora,
        micro_batch_size=mb,
        gradient_accumulation_steps=n // mb,
        seq_len=prompt_len + completion_len,
    )
    out = GRPOEstimate(est, prompts, generations, prompt_len, completion_len, int(beta > 0) + int(num_iterations > 1))
    out.refusal = est.refusal
    plan = est.plan
    if plan is None:
        return out
    meta = model if hasattr(model, "parameters") else meta_model(model, None)  # a folder: its config.json
    shape = serve_shape(meta, DTYPES[config.get("precision", "bf16")])
    T = prompt_len + completion_len
    out.kv_bytes = shape.kv_bytes(n, T)
    out.device_budget = plan.device_budget  # the planner's: max_gpu_memory, or the GPU's free bytes
    out.generation_device_bytes = generation_bytes(plan, shape, n, T)
    streamed = range(plan.resident_blocks, shape.num_blocks)
    nf4 = est.shape.nf4_bytes
    up = [
        (est.shape.nf4_bytes_of(i) + shape.block_bytes[i] - est.shape.nf4_numels[i + 1] * shape.elem)
        if nf4
        else shape.block_bytes[i]
        for i in streamed
    ]
    slots = plan.weight_slots
    slot_bytes = device_item(plan, "weight_slots") // max(slots, 1)
    out.kept_blocks = blocks_kept(plan, shape, n, T, out.device_budget, slot_bytes, max(len(up) - slots, 0), prompt_len)
    out.generation_device_bytes += out.kept_blocks * slot_bytes
    out.streamed_bytes_per_token = streamed_per_token(up, out.kept_blocks, slots)
    if out.refusal is None:
        out.refusal = generation_refusal(plan, shape, n, T, out.device_budget)
    step = est.step
    if step.compute is not None:
        out.training_s = step.step
        out.scoring_s = out.scoring_passes * FORWARD_SHARE * step.compute
    if measure and gpu and torch.cuda.is_available():
        from zerofit.cli import doctor

        speeds = {(c.direction, c.host_memory): c.gb_per_s for c in doctor.copy_bandwidth(256 << 20, 3)}
        out.upload_gb_per_s = speeds[("host->gpu", "pinned")]
        once = sum(up)  # every streamed block crosses for the first token (the kept ones stay after it)
        out.generation_s = (once + completion_len * out.streamed_bytes_per_token) / (out.upload_gb_per_s * 1e9)
    else:
        out.notes.append("the generation's time is not predicted here (no GPU to measure the upload speed)")
    return out
