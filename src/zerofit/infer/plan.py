"""The placement of offloaded generation: which blocks stay on the GPU, how many stream, and the KV cache.

[Note: inference placement]
Generation needs on the device: the shell (embeddings, final norm, head) in the
weights' dtype, the KV cache of ``batch x context`` tokens, the working memory
of the largest forward (the prefill of the longest prompt, and the logits of
the last position), and either a block's weights for every block (resident) or
``slots`` streaming buffers that the other blocks pass through. The planner keeps
as many blocks resident as fit under the cap after the rest; the streamed ones
are spread evenly between them, so that each upload overlaps the resident
blocks' compute ([Note: the upload cycle], engine.py). When even zero resident
blocks leave no room for the KV cache, the plan is refused before the first
token, with what would fit: a batch, a context, or a cap.

The bytes per token at batch 1 are the streamed blocks' bytes: that over the
pinned-host-to-device bandwidth is the PCIe bound of one decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerofit.engine.plan.search import PlanError, fmt_at_least, fmt_bytes

MiB = 2**20
RESERVE = 384 * MiB  # the allocator's rounding and fragmentation, cuBLAS workspaces


class InferencePlanError(PlanError):
    """The KV cache and working memory of this batch and context cannot fit the GPU budget."""


@dataclass(frozen=True)
class InferShape:
    """What the planner needs to know of the model (bytes in the weights' dtype)."""

    shell_bytes: int
    block_bytes: tuple[int, ...]
    layers: int  # layers that keep a KV cache
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    elem: int  # bytes per weight/activation element

    @property
    def num_blocks(self) -> int:
        return len(self.block_bytes)

    def kv_bytes(self, batch: int, context: int) -> int:
        """Keys and values of every layer for ``batch`` sequences of ``context`` tokens."""
        return 2 * self.layers * batch * context * self.kv_heads * self.head_dim * self.elem

    def work_bytes(self, batch: int, tokens: int, context: int) -> int:
        """The working memory of one forward of ``batch x tokens`` new tokens over ``context`` positions:
        a block's activations (residual stream, attention projections, MLP), the attention mask, the
        rotary tables, and the last position's logits (the dtype's and generate's fp32 copies)."""
        acts = batch * tokens * (5 * self.hidden + 3 * self.intermediate) * self.elem
        mask = batch * tokens * context * max(self.elem, 1)
        rope = 2 * batch * tokens * self.head_dim * 4
        logits = batch * self.vocab * (self.elem + 3 * 4)
        return acts + mask + rope + logits


@dataclass
class InferPlan:
    """Where each block's weights live during generation, and the device bytes that placement takes."""

    shape: InferShape
    batch: int
    context: int
    prefill: int  # longest prompt
    cap: int | None  # device budget (None: no cap)
    resident: list[int] = field(default_factory=list)
    streamed: list[int] = field(default_factory=list)  # in execution order
    slots: int = 0
    reserve: int = RESERVE  # allocator rounding and workspaces (0 on the CPU)

    @property
    def slot_bytes(self) -> int:
        return max(self.shape.block_bytes, default=0)

    @property
    def kv_bytes(self) -> int:
        return self.shape.kv_bytes(self.batch, self.context)

    @property
    def work_bytes(self) -> int:
        return self.shape.work_bytes(self.batch, self.prefill, self.context)

    @property
    def device_bytes(self) -> int:
        blocks = sum(self.shape.block_bytes[i] for i in self.resident)
        return (
            self.shape.shell_bytes
            + blocks
            + self.slots * self.slot_bytes
            + self.kv_bytes
            + self.work_bytes
            + self.reserve
        )

    @property
    def streamed_bytes(self) -> int:
        """Bytes that cross to the device per forward (per decoded token)."""
        return sum(self.shape.block_bytes[i] for i in self.streamed)

    def summary(self) -> str:
        s = self.shape
        cap = fmt_bytes(self.cap) if self.cap else "no cap"
        return (
            f"{len(self.resident)}/{s.num_blocks} blocks resident, {len(self.streamed)} streamed through "
            f"{self.slots} slots ({fmt_bytes(self.streamed_bytes)} per token); KV cache "
            f"{fmt_bytes(self.kv_bytes)} for {self.batch} x {self.context} tokens; device "
            f"{fmt_bytes(self.device_bytes)} of {cap}"
        )


def spread(n: int, m: int) -> list[int]:
    """``m`` of ``n`` block indices, evenly spaced, the last block among them, in ascending order."""
    return sorted({n - 1 - (k * n) // m for k in range(m)}) if m else []


def row_prefill(context: int, prefill_tokens: int | None, rows: int) -> int:
    """The longest prompt a server's forward over ``rows`` rows is planned for: ``prefill_tokens`` (default: the
    context) in all, at most the context a row."""
    return min(context, max(1, (prefill_tokens or context) // rows))


def plan_inference(
    shape: InferShape, cap: int | None, batch: int, context: int, prefill: int, slots: int = 2, reserve: int = RESERVE
) -> InferPlan:
    """The placement for ``batch`` sequences of up to ``context`` tokens, the longest prompt ``prefill``
    tokens ([Note: inference placement]). Raises :class:`InferencePlanError` when nothing fits."""
    n = shape.num_blocks
    plan = InferPlan(shape, batch, context, prefill, cap, reserve=reserve)
    if cap is None or n == 0:
        plan.resident = list(range(n))
        return plan
    fixed = shape.shell_bytes + shape.kv_bytes(batch, context) + shape.work_bytes(batch, prefill, context) + reserve
    blk = max(shape.block_bytes)
    if fixed + sum(shape.block_bytes) <= cap:
        plan.resident = list(range(n))
        return plan
    room = cap - fixed - slots * blk
    if room < 0:
        raise InferencePlanError(_refusal(shape, cap, batch, context, prefill, slots, reserve))
    r = min(n, int(room // blk))
    m = n - r
    plan.slots = min(slots, m)
    plan.streamed = spread(n, m)
    plan.resident = [i for i in range(n) if i not in set(plan.streamed)]
    return plan


def _refusal(shape: InferShape, cap: int, batch: int, context: int, prefill: int, slots: int, reserve: int) -> str:
    blk = max(shape.block_bytes)

    def need(b: int, c: int, p: int) -> int:
        return shape.shell_bytes + shape.kv_bytes(b, c) + shape.work_bytes(b, p, c) + reserve + slots * blk

    total = need(batch, context, prefill)
    parts = [
        f"generation of {batch} sequences x {context} tokens cannot fit {fmt_bytes(cap)} of GPU memory: the KV cache "
        f"needs {fmt_bytes(shape.kv_bytes(batch, context))}, the shell {fmt_bytes(shape.shell_bytes)}, "
        f"{slots} streaming slots {fmt_bytes(slots * blk)}, the working memory of a {prefill}-token prefill "
        f"{fmt_bytes(shape.work_bytes(batch, prefill, context))} (and {fmt_bytes(reserve)} reserve): "
        f"{fmt_bytes(total)} with no block resident"
    ]
    fits = []
    b = batch - 1
    while b >= 1 and need(b, context, prefill) > cap:
        b -= 1
    if b >= 1:
        fits.append(f"--batch-size {b}")
    c = context
    while c > prefill + 1 and need(batch, c, prefill) > cap:
        c = max(prefill + 1, c * 7 // 8)
    if need(batch, c, prefill) <= cap:
        fits.append(f"at most {c - prefill} new tokens (context {c})")
    fits.append(f"a cap of at least {fmt_at_least(total)} (--max-gpu-memory)")
    return f"{parts[0]}. What fits: {'; or '.join(fits)}."
