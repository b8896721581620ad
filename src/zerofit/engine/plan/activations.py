"""The activations' side of a plan: which blocks' input checkpoints are kept, offloaded or recomputed, the bytes a
step's activations take on the device, the head and loss in chunks, the MLP's sequence tiles. The placement search
(search.py) adds them to each candidate."""

from __future__ import annotations

import functools

from zerofit.engine.plan.plan import BatchShape, ModelShape

LOSS_CHUNK_TOKENS = 512  # tokens per chunk of the head and loss when the logits are chunked
SPARSE_EVERY = (2, 3, 4, 6, 8)  # the checkpoint spacings the planner tries when every block's input does not fit
CKPT_AHEAD = 2  # the backward brings them up this many blocks ahead ([Note: offloaded checkpoints]), or one
# ([Note: one checkpoint ahead])
CKPT_ON_DEVICE = 2 + CKPT_AHEAD  # the backward's peak: block 0's, the one computing and CKPT_AHEAD coming up (the
# last two blocks' are consumed first)


def checkpoint_ahead(checkpoint_bytes: int, other_bytes: int) -> int:
    """[Note: one checkpoint ahead]
    Offloaded checkpoints come back two blocks ahead because what else the upload stream carries for a block (its
    weights, and with updates in the backward the state of a block the device updates) was queued before a
    checkpoint asked for one block ahead, and held it back ([Note: offloaded checkpoints], memory/activations.py).
    Where a block's checkpoints (every micro-batch's) take at least those bytes, as at long sequences (the 8B
    shape at 131,072 tokens: 1 GiB against 436 MiB of weights), what is queued before one is at most as long as
    its own transfer, which one block's compute covers, so one block ahead: the device holds one checkpoint less,
    the room that otherwise sends the planner to checkpoints every 2 blocks (and a forward more of every second
    block in the backward). ``checkpoint_bytes``: one block's, every micro-batch's; ``other_bytes``: the rest of a
    block's uploads in the backward."""
    return 1 if checkpoint_bytes >= other_bytes else CKPT_AHEAD


def recomputed_blocks(n_blocks: int, every: int) -> list[int]:
    """The blocks whose forward the backward runs again for the next block's input ([Note: checkpoints every k
    blocks], schedule.py): every block but each segment's last."""
    if every == 1:
        return []
    return [i for i in range(n_blocks) if (i + 1) % every and i != n_blocks - 1]


@functools.lru_cache(maxsize=64)
def offloaded_blocks(n_blocks: int, every: int) -> tuple[int, ...]:
    """The blocks whose checkpoints go to host memory when they are offloaded ([Note: offloaded checkpoints],
    activations.py), in order (their places in the host arena): all but block 0's and the last two's; with checkpoints
    every k blocks, the kept ones but block 0's and the last segment's."""
    if every == 1:
        return tuple(range(1, n_blocks - 2))
    return tuple(range(every, (n_blocks - 1) // every * every, every))


def offloaded_checkpoints(n_blocks: int, every: int) -> int:
    """How many blocks' checkpoints go to host memory when they are offloaded."""
    return len(offloaded_blocks(n_blocks, every))


def device_checkpoints(n_blocks: int, every: int, offloaded: bool, ahead: int = CKPT_AHEAD) -> int:
    """How many blocks' inputs (per micro-batch) the device holds at once in the backward, at most. Every block's
    checkpoints: all, or, offloaded, block 0's, the one computing and the ``ahead`` coming up. Every k-th block's
    ([Note: checkpoints every k blocks]), in a segment: its own input and the k - 1 it recomputes, beside block 0's
    when offloaded, else beside every earlier segment's kept input."""
    if every == 1:
        return min(n_blocks, 2 + ahead) if offloaded else n_blocks
    peak = 0
    for j, start in enumerate(range(0, n_blocks, every)):
        recomputed = min(every, n_blocks - start) - 1
        kept = (2 if j else 1) if offloaded else j + 1
        peak = max(peak, kept + recomputed)
    return peak


# [Note: the loss's bytes]
# The head's loss as transformers' Llama models compute it (ForCausalLMLoss: the logits upcast to fp32, cross
# entropy) holds three fp32 tensors per token and vocabulary entry at its peak, in its backward: log_softmax's saved
# output, nll_loss's gradient, and log_softmax's gradient, 12 B whatever the model's dtype (bench/probes/live_bytes.py,
# measured on the CPU; tests/gpu/test_small_gpu_floor.py holds the planner to it). The 16-bit gradient that follows is
# made after nll_loss's gradient is freed. A 3B model's GPU peak at a 24 GiB cap, in the post pass, held 12.5 B
# (bench/probes/mem_peak.py; docs/benchmarks.md, where the GPU memory peaks), where the planner had counted
# dtype_bytes + 8 (10 in bf16). Then the head's backward holds the 16-bit logits' gradient, the head's weight
# gradient (vocabulary x hidden, 16-bit), the hidden state's and the final norm's backward's (fp32: three of
# tokens x hidden in all): with the loss in token chunks (a 3B model at an 8 GiB cap: 512 tokens, 788 MB either
# way) that is the larger. One chunk's weight gradients at a time ([Note: one micro-batch's gradients at a time],
# adapter.py): the chunks' loop had kept two, about a quarter of that model's peak at 8 GiB.
LOSS_BYTES = 12


def activation_bytes(
    shape: ModelShape,
    batch: BatchShape,
    n_blocks: int,
    dtype_bytes: int,
    loss_chunks: int = 1,
    offload_checkpoints: bool = False,
    every: int = 1,
    tile: int | None = None,
    ahead: int = CKPT_AHEAD,
) -> dict[str, int]:
    """Predicted activation memory of a block-major step with per-block recompute.

    checkpoints: the block inputs the device holds at once (:func:`device_checkpoints`), for every micro-batch
    (block-major order keeps them all until the backward);
    boundary: the gradient flowing between blocks, one per micro-batch, and the one a block's backward is making;
    block: one block's recomputed activations and their gradients (transient): per token, 24 x hidden elements
    (the attention's and the norms' tensors, the MLP's input and output) and 8 x intermediate, the MLP's (the gate's,
    up's and the activation's outputs and their product, and a gradient of each). With ``tile`` ([Note: MLP over
    sequence tiles], tiling.py) the MLP's exist for ``min(tile, tokens)`` tokens at a time; where the whole block
    runs over tiles ([Note: a block over sequence tiles]: ``shape.attention`` set) so do the hidden-sized ones, and
    the whole sequence holds q, k, v, the attention's output and a gradient of each (2 x ``shape.attention``), the
    output's copy for o_proj, its gradient, the two parts' input gradients and their sum, and the block's output
    (6 x hidden);
    logits: the post pass's transient: the loss's fp32 tensors at its peak, or the head's backward after it
    ([Note: the loss's bytes]; the 16-bit logits themselves are dropped before the backward)."""
    tok = batch.tokens
    per_chunk = -(-tok // loss_chunks)
    kept = device_checkpoints(n_blocks, every, offload_checkpoints, ahead)
    return {
        "checkpoints": kept * batch.grad_accum * tok * shape.hidden * dtype_bytes,
        "boundary_grads": (batch.grad_accum + 1) * tok * shape.hidden * dtype_bytes,
        "block_working_set": block_working_set(shape, tok, tile) * dtype_bytes,
        "logits": max(
            per_chunk * shape.vocab * LOSS_BYTES,
            (per_chunk + shape.hidden) * shape.vocab * dtype_bytes + 3 * per_chunk * shape.hidden * 4,
        ),
    }


def block_working_set(shape: ModelShape, tokens: int, tile: int | None) -> int:
    """Elements of one block's working set in the backward (:func:`activation_bytes`)."""
    t = min(tile or tokens, tokens)
    if t < tokens and shape.attention:
        return tokens * (2 * shape.attention + 6 * shape.hidden) + t * (24 * shape.hidden + 8 * shape.intermediate)
    return tokens * 24 * shape.hidden + t * 8 * shape.intermediate


TILE_MIN = 1024  # the smallest MLP tile the planner chooses (tokens)


def tiles_for(batch: BatchShape) -> list[int]:
    """The MLP tiles the planner tries for ``batch``, largest first: powers of two of at least TILE_MIN tokens
    below the micro-batch's tokens ([Note: MLP over sequence tiles], tiling.py)."""
    tiles, t = [], TILE_MIN
    while t < batch.tokens:
        tiles.append(t)
        t *= 2
    return tiles[::-1]


def padded_level(level: tuple) -> tuple:
    """A floor level as (chunked loss, offloaded checkpoints, lean, every, tile)."""
    defaults = (False, False, False, 1, None)
    return tuple(level) + defaults[len(level) :]


def loss_chunks_for(batch: BatchShape) -> int:
    """Chunks of the head and loss when chunked: LOSS_CHUNK_TOKENS tokens of a micro-batch each."""
    return max(1, -(-batch.seq_len // max(1, LOSS_CHUNK_TOKENS // batch.micro_batch)))
