"""``zerofit estimate --grpo`` (zerofit/estimate/grpo.py): the training step planned at the run's batch, the
generation's key/value cache counted beside the placement it generates on, and a run whose cache cannot fit refused
by name, by the estimate and by the trainer at its first generation (the same check)."""

from __future__ import annotations

import pytest

from zerofit.estimate import meta_model
from zerofit.estimate.grpo import estimate_grpo, generation_refusal
from zerofit.estimate.serve import serve_shape

CFG = {"max_gpu_memory": "24GiB", "max_host_memory": "100GiB"}


def _grpo(**kw):
    args = dict(prompt_len=256, completion_len=1024, generations=8, prompts=2, lora=True, measure=False, gpu=True)
    return estimate_grpo(meta_model(shape="llama-3.1-8b"), dict(CFG), **(args | kw))


def test_an_8b_lora_run_fits_24_gib_with_its_cache_counted():
    e = _grpo(beta=0.04)
    assert e.refusal is None and e.training.plan is not None
    b = e.training.batch
    assert (b.micro_batch, b.grad_accum, b.seq_len) == (8, 2, 1280)  # 2 x 8 sequences of 256 + 1024 tokens
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128, keys and values in bf16, for 16 sequences of 1,280 tokens
    assert e.kv_bytes == 2 * 32 * 8 * 128 * 2 * 16 * 1280
    assert e.kv_bytes < e.generation_device_bytes <= 24 * 2**30
    assert e.scoring_passes == 1
    assert "KV cache of 16 x 1280 tokens" in e.render() and "scoring: 1 forward" in e.render()
    # [Note: generation keeps blocks]: the room the step's activations leave holds the streamed blocks the pool's
    # slots do not, so after the first token no weight crosses
    plan = e.training.plan
    assert e.kept_blocks == 32 - plan.resident_blocks - plan.weight_slots > 0 and e.streamed_bytes_per_token == 0


def test_a_longer_run_streams_what_its_cache_leaves_no_room_for():
    """[Note: generation keeps blocks]: beside what stays of the plan and the cache, the call's largest forward (the
    prefill of its 32 prompts, and one layer's cache again) is all the room kept blocks leave; the streamed blocks
    beyond them and the pool's slots cross every token."""
    from zerofit.engine.plan.generation import device_item, generation_bytes, generation_work_bytes

    e = _grpo(prompts=4, completion_len=2048)
    plan, shape = e.training.plan, serve_shape(meta_model(shape="llama-3.1-8b"))
    room = e.device_budget - generation_bytes(plan, shape, 32, 2304) - generation_work_bytes(shape, 32, 256, 2304)
    block = 2 * 218_112_000  # a Llama-3.1-8B block in bf16
    slot = device_item(plan, "weight_slots") // plan.weight_slots
    assert e.refusal is None and 0 < e.kept_blocks == room // slot < 32 - plan.resident_blocks - plan.weight_slots
    rotating = 32 - plan.resident_blocks - e.kept_blocks
    assert e.streamed_bytes_per_token > (rotating - 1) * block


def test_a_cache_that_cannot_fit_is_refused_by_name():
    e = _grpo(prompts=8, generations=16, completion_len=2048, micro_batch_size=1)
    assert e.training.plan is not None  # the training step alone fits
    assert e.refusal is not None and e.refusal.startswith("generation: the KV cache of 128 sequences x 2304 tokens")
    # the trainer's check at its first generation is the same function
    shape = serve_shape(meta_model(shape="llama-3.1-8b"))
    assert generation_refusal(e.training.plan, shape, 128, 2304, 24 * 2**30) == e.refusal
    assert generation_refusal(e.training.plan, shape, 2, 2304, 24 * 2**30) is None


def test_a_batch_that_does_not_split_into_micro_batches_is_refused():
    with pytest.raises(ValueError, match="micro_batch_size 3 does not divide"):
        _grpo(micro_batch_size=3)


def test_a_long_completion_keeps_the_blocks_the_prefill_leaves_room_for():
    """8 completions of 4,096 tokens at 24 GiB: the training step's tiles need a block working set the generation
    never uses; beside the prefill of 8 prompts, the room holds every streamed block the pool's slots do not, so no
    weight crosses after the first token, within the budget."""
    from zerofit.engine.plan.generation import device_item, generation_bytes

    e = _grpo(prompts=1, completion_len=4096)
    plan, shape = e.training.plan, serve_shape(meta_model(shape="llama-3.1-8b"))
    slot = device_item(plan, "weight_slots") // plan.weight_slots
    assert e.refusal is None and e.kept_blocks == 32 - plan.resident_blocks - plan.weight_slots > 0
    assert e.streamed_bytes_per_token == 0 and e.generation_device_bytes <= e.device_budget
    # counted with the training step's block working set, the room would not have held one block
    assert generation_bytes(plan, shape, 8, 4352) + device_item(plan, "block_working_set") + slot > e.device_budget
