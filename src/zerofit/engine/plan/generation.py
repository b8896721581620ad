"""A generation on a training plan's placement: what it holds on the device, and the streamed blocks it keeps.

[Note: generation keeps blocks]
The engine's ``generate`` runs between steps on the training plan's placement ([Note: generation over the engine's
weights], step/hooked.py): the shell, the resident blocks and the weight slots stay; the step's activations, gradient
slots and loss buffers are not in use, and the model's key/value cache of every sequence takes their place. Every
decode step runs every block, so a streamed block that must leave its slot for the next one is uploaded again for
every token: the PCIe bound of a token is the streamed blocks' bytes. Where the device budget has room beyond
:func:`generation_bytes` (less the working memory of the call's largest forward, the prefill of every sequence's
prompt, as the inference planner counts a forward: ``InferShape.work_bytes``, and one layer's keys and values
again, for a cache that grows by concatenation), the streamer keeps that many more streamed blocks in slots of
their own for the call (Streamer.keep_for_generation): they cross once per call, and when the rest fit the pool's
slots, no weight crosses after the first token. A generation whose cache cannot fit the budget beside what stays is
refused by name before anything is allocated (:class:`GenerationTooLarge`). ``zerofit estimate --grpo`` plans the
same numbers.
"""

from __future__ import annotations

from zerofit.engine.plan.plan import Plan, fmt_bytes
from zerofit.errors import InputError


class GenerationTooLarge(InputError, RuntimeError):
    """A generation's key/value cache cannot fit the device budget beside the engine's placement."""


# the plan's device items that stay while the model generates (the step's activations, gradient slots and loss do not)
KEPT = ("shell", "resident_blocks", "weight_slots", "upload_staging", "allocator_reserve")


def device_item(plan: Plan, key: str) -> int:
    """One of the plan's device items (on the CPU the planner counts them as host memory, ``device:<key>``)."""
    return plan.device_bytes.get(key, 0) or plan.host_bytes.get("device:" + key, 0)


def kept_bytes(plan: Plan) -> int:
    """The bytes of the plan's device items that stay while the model generates (:data:`KEPT`)."""
    return sum(device_item(plan, k) for k in KEPT)


def generation_bytes(plan: Plan, shape, sequences: int, length: int) -> int:
    """The device bytes while ``sequences`` of up to ``length`` tokens generate on ``plan``'s placement: what of the
    plan stays (the shell, the resident blocks, the slots), the key/value cache of every sequence (``shape``: an
    InferShape, zerofit/infer/plan.py), and the last token's logits of each in fp32."""
    return kept_bytes(plan) + shape.kv_bytes(sequences, length) + sequences * shape.vocab * 4


def generation_refusal(plan: Plan, shape, sequences: int, length: int, budget: int | None) -> str | None:
    """Why ``sequences`` of up to ``length`` tokens cannot generate within ``budget`` on ``plan``'s placement, or
    None where they fit (or there is no budget)."""
    need = generation_bytes(plan, shape, sequences, length)
    if not budget or need <= budget:
        return None
    kept = kept_bytes(plan)
    return (
        f"generation: the KV cache of {sequences} sequences x {length} tokens "
        f"({fmt_bytes(shape.kv_bytes(sequences, length))}) does not fit beside the plan's shell, resident blocks and "
        f"slots ({fmt_bytes(kept)}): {fmt_bytes(need)} > max_gpu_memory {fmt_bytes(budget)}; fewer prompts or "
        "generations per step, a shorter max_completion_length, or fewer resident blocks (offload.resident_blocks)"
    )


def generation_work_bytes(shape, sequences: int, prompt: int, length: int) -> int:
    """The working memory of a generation's largest forward ([Note: generation keeps blocks]): the prefill of
    ``sequences`` prompts of ``prompt`` tokens over ``length`` positions, and one layer's keys and values again."""
    return shape.work_bytes(sequences, prompt, length) + shape.kv_bytes(sequences, length) // max(1, shape.layers)


def blocks_kept(
    plan: Plan,
    shape,
    sequences: int,
    length: int,
    budget: int | None,
    slot_bytes: int,
    candidates: int,
    prompt: int,
) -> int:
    """How many streamed blocks a generation keeps in slots of their own ([Note: generation keeps blocks]): the room
    ``budget`` leaves beside :func:`generation_bytes` and :func:`generation_work_bytes` (prompts of ``prompt``
    tokens), in slots of ``slot_bytes``, at most ``candidates`` (the streamed blocks beyond the pool's slots)."""
    if not budget or slot_bytes <= 0 or candidates <= 0:
        return 0
    room = (
        budget
        - generation_bytes(plan, shape, sequences, length)
        - generation_work_bytes(shape, sequences, prompt, length)
    )
    return max(0, min(candidates, room // slot_bytes))


def streamed_per_token(block_bytes: list[int], kept: int, slots: int) -> int:
    """The bytes one decode step uploads: those of the streamed blocks (``block_bytes``, in order) that neither a
    kept slot holds (the first ``kept``) nor stay in the pool's ``slots`` (all the rest do when they fit)."""
    rotating = block_bytes[kept:]
    return 0 if len(rotating) <= slots else sum(rotating)


def generation_shape(model, args: tuple, kwargs: dict) -> tuple[int, int, int]:
    """(sequences, tokens each at most, prompt tokens) of a ``generate(*args, **kwargs)`` call on ``model``: the
    prompts times the returned sequences or beams, their length plus the new tokens (the call's, else its generation
    config's), the prompts' length."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    batch, prompt = (int(ids.shape[0]), int(ids.shape[-1])) if ids is not None else (1, 1)
    cfg = kwargs.get("generation_config") or getattr(model, "generation_config", None)

    def setting(name: str, default):
        value = kwargs.get(name)
        return value if value is not None else (getattr(cfg, name, None) or default)

    copies = max(int(setting("num_return_sequences", 1)), int(setting("num_beams", 1)))
    new = setting("max_new_tokens", None)
    length = prompt + int(new) if new is not None else max(int(setting("max_length", prompt + 1)), prompt + 1)
    return batch * copies, length, prompt
