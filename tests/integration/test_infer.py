"""Offloaded generation (zerofit.infer): the same tokens and logits as transformers' ``generate`` on the model
held whole, with blocks streamed through slots; the KV-cache plan and its refusal; the sources (model
directory, checkpoint, live engine); sampling with a seed; the CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

import zerofit
from tests.support import tiny_models as tm
from tests.support.model_dirs import TWELVE, make_model_dir
from zerofit.cli import app
from zerofit.infer import InferenceEngine, InferencePlanError
from zerofit.infer.plan import InferShape, plan_inference, spread

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gpt2"]
GREEDY = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
STATIC = dict(
    GREEDY, cache_implementation="static", disable_compile=True
)  # the engine's default cache ([Note: a KV cache ...])
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _reference(model, dtype):
    """The model held whole in ``dtype``, as ``from_pretrained(dtype=...)`` holds it: parameters cast, the
    rotary tables kept in fp32 (``Module.to`` would cast those too)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.data = p.data.to(dtype)
    return ref


def _uneven_batch(B=3, T=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, tm.VOCAB - 1, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: three prompt lengths
    mask[1, :1] = 0
    ids[mask == 0] = 0
    return ids, mask


def _streaming_cap(eng: InferenceEngine, batch: int, context: int, prefill: int, resident: int = 0) -> int:
    """A cap that leaves room for ``resident`` blocks and the slots (everything else streams). A model of two
    blocks streams through one slot (two slots would hold both: the planner keeps them resident)."""
    s = eng.shape
    blk = max(s.block_bytes)
    if s.num_blocks - resident < 3:
        eng.slots_wanted = 1
    return (
        s.shell_bytes
        + s.kv_bytes(batch, context)
        + s.work_bytes(batch, prefill, context)
        + (eng.slots_wanted + resident) * blk
        + blk // 2
    )


def _on_gpu(cap: int) -> int:
    """``cap`` on the GPU: plus the reserve the plan keeps and what the device holds outside this process's caching
    allocator now (the CUDA context, other tests' libraries), which the engine's budget subtracts from its cap
    (InferenceEngine._device_budget)."""
    free, total = torch.cuda.mem_get_info()
    return cap + (384 << 20) + (total - free - torch.cuda.memory_reserved())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_generate_is_transformers_generate(family, dtype):
    torch.manual_seed(0)
    model = getattr(tm, family)().eval()
    ids, mask = _uneven_batch()
    ref = _reference(model, dtype)
    want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **STATIC)
    dynamic = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **GREEDY)
    eng = InferenceEngine(copy.deepcopy(model), dtype=dtype, device="cpu")
    eng.cap = _streaming_cap(eng, 3, 17, 9)
    got = eng.generate(ids, mask, max_new_tokens=8, **GREEDY)
    # transformers' default (dynamic) cache: the same tokens, logits to the dtype's rounding
    assert torch.equal(got.sequences, dynamic.sequences)
    for a, b in zip(got.logits, dynamic.logits):
        torch.testing.assert_close(a, b, rtol=TOL[dtype], atol=TOL[dtype])
    assert eng.plan.resident == [] and len(eng.plan.streamed) == eng.adapter.num_blocks
    assert eng.plan.slots == eng.slots_wanted == (2 if eng.adapter.num_blocks > 2 else 1)
    # every forward (1 prefill + 7 decodes) streamed every block: the cycle ran ahead, never re-primed
    assert eng.uploads >= 8 * eng.adapter.num_blocks
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert torch.equal(a, b)  # the same kernels on the same values: bitwise


def test_mixed_placement_streams_the_spread_blocks_and_matches():
    torch.manual_seed(0)
    model = tm.llama(layers=6).eval()
    ids, mask = _uneven_batch()
    want = _reference(model, torch.bfloat16).generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, **STATIC)
    eng = InferenceEngine(copy.deepcopy(model), dtype=torch.bfloat16, device="cpu")
    eng.cap = _streaming_cap(eng, 3, 15, 9, resident=3)
    got = eng.generate(ids, mask, max_new_tokens=6, **GREEDY)
    assert len(eng.plan.resident) == 3 and eng.plan.streamed == [1, 3, 5]
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    # a streamed block's parameters view its host buffer again after its forward
    p = eng.model.model.layers[3].mlp.up_proj.weight
    host = eng._host[3]
    assert host.data_ptr() <= p.data_ptr() < host.data_ptr() + host.numel() * host.element_size()


def test_a_forward_that_raises_midway_reprimes_the_cycle():
    torch.manual_seed(0)
    model = tm.llama(layers=4).eval()
    ids, mask = _uneven_batch()
    ref = _reference(model, torch.float32)
    eng = InferenceEngine(copy.deepcopy(model), dtype=torch.float32, device="cpu")
    eng.cap = _streaming_cap(eng, 3, 9, 9)
    eng.prepare(3, 9, 9)
    boom = eng.model.model.layers[2].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        eng(input_ids=ids, attention_mask=mask)
    boom.remove()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(eng(input_ids=ids, attention_mask=mask).logits, want)


def test_sampling_is_reproducible_with_a_seed_and_is_transformers_sampling():
    torch.manual_seed(0)
    model = tm.qwen2().eval()
    ids, mask = _uneven_batch()
    eng = InferenceEngine(copy.deepcopy(model), dtype=torch.float32, device="cpu")
    eng.cap = _streaming_cap(eng, 3, 21, 9)
    kw = dict(
        do_sample=True, temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.2, max_new_tokens=12, pad_token_id=0
    )

    def run(gen, seed):
        torch.manual_seed(seed)
        return gen(ids, mask, **kw) if gen is eng.generate else gen(input_ids=ids, attention_mask=mask, **kw)

    a, b, c = run(eng.generate, 5), run(eng.generate, 5), run(eng.generate, 6)
    assert torch.equal(a, b) and not torch.equal(a, c)
    kw["cache_implementation"] = "static"
    assert torch.equal(a, run(_reference(model, torch.float32).generate, 5))


def test_plan_keeps_what_fits_and_spreads_the_rest():
    shape = InferShape(
        shell_bytes=100,
        block_bytes=(10,) * 10,
        layers=10,
        kv_heads=1,
        head_dim=1,
        hidden=1,
        intermediate=1,
        vocab=1,
        elem=1,
    )
    fixed = 100 + shape.kv_bytes(1, 8) + shape.work_bytes(1, 4, 8)
    assert plan_inference(shape, None, 1, 8, 4, reserve=0).resident == list(range(10))
    assert plan_inference(shape, fixed + 100, 1, 8, 4, reserve=0).streamed == []
    p = plan_inference(shape, fixed + 70, 1, 8, 4, reserve=0)  # 2 slots + 5 resident
    assert len(p.resident) == 5 and p.streamed == spread(10, 5) == [1, 3, 5, 7, 9] and p.slots == 2
    assert p.device_bytes <= fixed + 70 and p.streamed_bytes == 50
    assert spread(40, 4) == [9, 19, 29, 39] and spread(3, 3) == [0, 1, 2]


def test_kv_cache_that_cannot_fit_is_refused_before_the_first_token_with_the_numbers():
    torch.manual_seed(0)
    eng = InferenceEngine(tm.llama().eval(), dtype=torch.bfloat16, device="cpu")
    s = eng.shape
    eng.cap = _streaming_cap(eng, 1, 40, 8) - max(s.block_bytes) // 2  # room for batch 1, not for 64
    calls = []
    eng.model.register_forward_pre_hook(lambda *a: calls.append(1))
    ids = torch.randint(1, 90, (64, 8))
    with pytest.raises(InferencePlanError) as e:
        eng.generate(ids, torch.ones_like(ids), max_new_tokens=32, do_sample=False, pad_token_id=0)
    msg = str(e.value)
    assert calls == [] and eng.uploads == 0
    assert (
        "64 sequences x 40 tokens" in msg and "KV cache" in msg and "--batch-size" in msg and "cap of at least" in msg
    )
    fits = int(msg.split("--batch-size ")[1].split(";")[0].split(".")[0])
    assert 1 <= fits < 64
    eng.generate(ids[:fits], torch.ones_like(ids[:fits]), max_new_tokens=32, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("family,dtype", [("llama", torch.bfloat16), ("gpt2", torch.float16)])
def test_model_directory_source_matches_from_pretrained(tmp_path, family, dtype):
    from transformers import AutoModelForCausalLM

    d = make_model_dir(tmp_path / "m", family, dtype=dtype, layers=3)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
    eng = InferenceEngine.from_pretrained(d, device="cpu")
    assert eng.dtype == dtype and eng.tokenizer is not None
    eng.cap = _streaming_cap(eng, 2, 16, 6)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **STATIC)
    got = eng.generate(ids, mask, max_new_tokens=10, **GREEDY)
    assert eng.plan.streamed and torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))


def test_an_fp32_folder_generates_in_fp32_by_default_as_transformers_loads_it(tmp_path):
    """``zerofit generate`` with no --dtype: the folder's own dtype (config.json's), as ``from_pretrained`` loads
    it, so greedy answers are transformers' on all twelve prompts; the same folder held in bf16 answers some of
    them otherwise (what the default must not do silently), and the start-up line says which dtype computes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = make_model_dir(tmp_path / "m", "llama", dtype=torch.float32, layers=2)
    out = tmp_path / "o.jsonl"
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in TWELVE))
    args = ["generate", "--model", str(d), "--prompts", str(tmp_path / "p.jsonl"), "--greedy", "--device", "cpu"]
    r = CliRunner().invoke(app, [*args, "--max-new-tokens", "16", "--batch-size", "1", "--output", str(out)])
    assert r.exit_code == 0, r.output
    assert "float32 weights and KV cache (the model's own)" in r.output
    got = [json.loads(x)["text"] for x in out.read_text().splitlines()]
    ref = AutoModelForCausalLM.from_pretrained(d).eval()
    assert ref.dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(d)
    bf16 = InferenceEngine.from_pretrained(d, device="cpu", dtype="bf16")
    differs = 0
    for p, text in zip(TWELVE, got):
        ids = tok(p, return_tensors="pt").input_ids
        want = ref.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert text == tok.decode(want[0, ids.shape[1] :], skip_special_tokens=True), p
        differs += not torch.equal(bf16.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0), want)
    assert differs > 0  # the check has power: bf16 is not the same answers on this folder
    assert "bfloat16 weights and KV cache (as asked)" in bf16.summary()
    # a bf16 folder stays bf16, a model in memory keeps its own dtype
    bf16_folder = make_model_dir(tmp_path / "b", "llama")
    assert InferenceEngine.from_pretrained(bf16_folder, device="cpu").dtype == torch.bfloat16
    assert InferenceEngine(copy.deepcopy(ref), device="cpu").dtype == torch.float32


def test_text_generation_batches_prompts_of_uneven_lengths_like_one_at_a_time(tmp_path):
    d = make_model_dir(tmp_path / "m", "llama", layers=3)
    eng = InferenceEngine.from_pretrained(d, device="cpu", dtype="fp32")
    prompts = ["The quick brown fox", "Hello", "def train(model, data): return"]
    together = zerofit.generate(eng, prompts, max_new_tokens=6, batch_size=3)
    alone = [zerofit.generate(eng, p, max_new_tokens=6) for p in prompts]
    assert together == alone and all(isinstance(t, str) for t in together)
    # chat: the tokenizer's template, the conversation's last turn answered
    chat = zerofit.generate(eng, [{"role": "user", "content": "Hi"}], max_new_tokens=4)
    assert isinstance(chat, str)
    pieces = []
    streamed = zerofit.generate(eng, "Hello there", max_new_tokens=8, stream=pieces.append)
    assert "".join(pieces).strip() == streamed.strip()


def test_stop_strings_end_the_text(tmp_path):
    d = make_model_dir(tmp_path / "m", "llama", layers=2)
    eng = InferenceEngine.from_pretrained(d, device="cpu", dtype="fp32")
    full = zerofit.generate(eng, "The quick", max_new_tokens=12)
    stop = full.strip()[2:4] if len(full.strip()) >= 4 else None
    if not stop:
        pytest.fail(f"the tiny model generated too little text to test stop strings: {full!r}")
    cut = zerofit.generate(eng, "The quick", max_new_tokens=12, stop=[stop])
    assert stop not in cut and full.startswith(cut) and len(cut) < len(full)


def test_checkpoint_and_live_engine_sources_generate_the_trained_weights(tmp_path):
    d = make_model_dir(tmp_path / "m", "llama", dtype=torch.float32, layers=2)
    engine = zerofit.initialize(
        str(d),
        {
            "device": "cpu",
            "precision": "fp32",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "optimizer": {"lr": 1e-2},
        },
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randint(0, 50, (2, 12), generator=g)
        engine.train_batch([{"input_ids": x, "labels": x}])
    engine.save_checkpoint(tmp_path / "ck")
    trained = copy.deepcopy(engine.module).eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    want = trained.generate(input_ids=ids, max_new_tokens=8, **STATIC)
    from_checkpoint = InferenceEngine.from_pretrained(tmp_path / "ck", device="cpu", dtype="fp32")
    for eng in (from_checkpoint, InferenceEngine.from_engine(engine, device="cpu", dtype="fp32")):
        eng.cap = _streaming_cap(eng, 1, 12, 4)
        got = eng.generate(ids, max_new_tokens=8, **GREEDY)
        assert eng.plan.streamed and torch.equal(got.sequences, want.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    assert from_checkpoint.tokenizer is not None  # the checkpoint carries the model's tokenizer files
    engine.close()


def test_cli_generate_prompt_prompts_file_and_refusal(tmp_path):
    d = make_model_dir(tmp_path / "m", "llama", layers=2)
    runner = CliRunner()
    r = runner.invoke(
        app, ["generate", "--model", str(d), "--prompt", "The quick brown", "--max-new-tokens", "6", "--device", "cpu"]
    )
    assert r.exit_code == 0, r.output
    assert "new tokens" in r.output and "blocks resident" in r.output
    f = tmp_path / "p.jsonl"
    f.write_text('"Hello"\n{"prompt": "The quick"}\n{"messages": [{"role": "user", "content": "Hi"}]}\n')
    out = tmp_path / "o.jsonl"
    r = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(d),
            "--prompts",
            str(f),
            "--output",
            str(out),
            "--max-new-tokens",
            "5",
            "--device",
            "cpu",
            "--batch-size",
            "2",
            "--seed",
            "1",
            "--temperature",
            "0.8",
        ],
    )
    assert r.exit_code == 0, r.output
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 3 and all(0 < x["new_tokens"] <= 5 and x["finish"] in ("stop", "length") for x in recs)
    r = runner.invoke(
        app, ["generate", "--model", str(d), "--prompt", "Hi", "--max-gpu-memory", "1KB", "--device", "cpu"]
    )
    assert r.exit_code == 2 and "refused before the first token" in r.output and "KV cache" in r.output
    r = runner.invoke(app, ["generate", "--model", str(tmp_path / "nope"), "--prompt", "Hi"])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_cli_chat_keeps_the_conversation(tmp_path):
    d = make_model_dir(tmp_path / "m", "llama", layers=2)
    r = CliRunner().invoke(
        app, ["chat", "--model", str(d), "--max-new-tokens", "4", "--device", "cpu"], input="Hello\nHow are you?\n\n"
    )
    assert r.exit_code == 0, r.output
    assert r.output.count("model> ") == 2


def test_cli_chat_leaves_the_oldest_turns_out_when_the_conversation_passes_the_context(tmp_path):
    """A model of 48 tokens' context: each exchange here takes about 20, so from the second on the oldest turns go
    (said each time), and every answer fits what is left; a message longer than the context is not sent."""
    import zerofit.infer.text as text_mod

    d = make_model_dir(tmp_path / "m", "llama", layers=2)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 48}))
    lengths = []
    complete = text_mod.complete

    def spy(engine, prompts, **kw):
        lengths.append(len(text_mod.prompt_ids(engine.tokenizer, prompts[0], chat=True)) + kw["max_new_tokens"])
        return complete(engine, prompts, **kw)

    text_mod.complete = spy
    try:
        r = CliRunner().invoke(
            app,
            ["chat", "--model", str(d), "--max-new-tokens", "6", "--device", "cpu"],
            input="one two three four\nfive six seven eight\nnine ten eleven\ntwelve\n" + "word " * 60 + "\n",
        )
    finally:
        text_mod.complete = complete
    assert r.exit_code == 0, r.output
    assert r.output.count("model> ") == 5 and r.output.count("oldest turn") >= 3, r.output
    assert "not sent: the message is longer than the model's context" in r.output
    assert len(lengths) == 4 and max(lengths) <= 48, lengths


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gpu_streamed_generate_is_transformers_generate(family):
    torch.manual_seed(0)
    model = getattr(tm, family)(**({"layers": 6} if family == "llama" else {})).eval()
    ids, mask = _uneven_batch()
    ref = _reference(model, torch.bfloat16).cuda()
    want = ref.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=16, **STATIC)
    eng = InferenceEngine(copy.deepcopy(model), dtype=torch.bfloat16, device="cuda")
    eng.cap = _on_gpu(_streaming_cap(eng, 3, 25, 9, resident=1))
    got = eng.generate(ids, mask, max_new_tokens=16, **GREEDY)
    assert eng.plan.streamed and eng.plan.resident
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))


def test_dynamic_cache_on_request_is_transformers_default_generate_bitwise():
    torch.manual_seed(0)
    model = tm.mistral().eval()
    ids, mask = _uneven_batch()
    want = _reference(model, torch.bfloat16).generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **GREEDY)
    eng = InferenceEngine(copy.deepcopy(model), dtype=torch.bfloat16, device="cpu")
    eng.cap = _streaming_cap(eng, 3, 17, 9)
    got = eng.generate(ids, mask, max_new_tokens=8, cache_implementation="dynamic", **GREEDY)
    assert eng.plan.streamed and torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))


def test_blocks_beyond_the_host_budget_stream_from_the_disk_and_match(tmp_path):
    torch.manual_seed(0)
    model = tm.llama(layers=6).eval()
    ids, mask = _uneven_batch()
    want = _reference(model, torch.bfloat16).generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, **STATIC)
    probe = InferenceEngine(copy.deepcopy(model), dtype=torch.bfloat16, device="cpu")
    blk = max(probe.shape.block_bytes)
    cap = _streaming_cap(probe, 3, 15, 9, resident=2)
    eng = InferenceEngine(
        copy.deepcopy(model),
        dtype=torch.bfloat16,
        device="cpu",
        max_gpu_memory=cap,
        max_host_memory=2 * blk + 2 * blk,
        nvme_path=tmp_path / "nvme",
    )  # staging + 2 blocks
    swap = eng._disk.path
    assert swap.is_file() and sorted(eng._disk.regions) != [] and len(eng._disk.regions) == 4
    got = eng.generate(ids, mask, max_new_tokens=6, **GREEDY)
    assert len(eng.plan.resident) == 2 and len(eng.plan.streamed) == 4
    st = eng.stats()
    on_disk_streamed = [b for b in eng.plan.streamed if eng._host[b] is None]
    assert on_disk_streamed and st["disk_reads"] >= 6 * len(on_disk_streamed)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    assert "on the disk" in eng.summary()
    eng.close()
    assert not swap.exists()  # removed at close


def test_disk_blocks_are_the_blocks_whose_weights_live_on_the_disk(tmp_path):
    model = tm.llama(layers=6).eval()
    probe = InferenceEngine(copy.deepcopy(model), dtype=torch.bfloat16, device="cpu")
    blk = max(probe.shape.block_bytes)
    probe.prepare(3, 15, 9)
    assert probe.disk_blocks == ()
    eng = InferenceEngine(
        copy.deepcopy(model),
        dtype=torch.bfloat16,
        device="cpu",
        max_gpu_memory=_streaming_cap(probe, 3, 15, 9, resident=2),
        max_host_memory=4 * blk,
        nvme_path=tmp_path / "nvme",
    )
    assert eng.disk_blocks == tuple(sorted(eng._disk.regions)) and len(eng.disk_blocks) == 4
    eng.close()


def test_disk_tier_refusals_name_what_to_change(tmp_path):
    model = tm.llama(layers=3).eval()
    with pytest.raises(ValueError, match="give nvme_path"):
        InferenceEngine(copy.deepcopy(model), device="cpu", max_host_memory=1000)
    with pytest.raises(ValueError, match="staging buffers"):
        InferenceEngine(copy.deepcopy(model), device="cpu", max_host_memory=1000, nvme_path=tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_disk_blocks_stream_through_pinned_staging_and_match(tmp_path):
    torch.manual_seed(0)
    model = tm.llama(layers=6).eval()
    ids, mask = _uneven_batch()
    want = (
        _reference(model, torch.bfloat16)
        .cuda()
        .generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=12, **STATIC)
    )
    probe = InferenceEngine(copy.deepcopy(model), dtype=torch.bfloat16, device="cpu")
    blk = max(probe.shape.block_bytes)
    cap = _on_gpu(_streaming_cap(probe, 3, 21, 9, resident=1))
    eng = InferenceEngine(
        copy.deepcopy(model),
        dtype=torch.bfloat16,
        device="cuda",
        max_gpu_memory=cap,
        max_host_memory=4 * blk,
        nvme_path=tmp_path,
    )
    got = eng.generate(ids, mask, max_new_tokens=12, **GREEDY)
    assert eng.stats()["disk_reads"] > 12 and eng.plan.streamed
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    eng.close()


def test_first_use_inside_inference_mode_then_outside():
    torch.manual_seed(0)
    model = tm.llama(layers=4).eval()
    ids, mask = _uneven_batch()
    eng = InferenceEngine(copy.deepcopy(model), dtype=torch.float32, device="cpu")
    eng.cap = _streaming_cap(eng, 3, 17, 9)
    with torch.inference_mode():
        a = eng.generate(ids, mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    b = eng.generate(ids, mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert eng.plan.streamed and torch.equal(a, b)


def test_beam_search_plans_the_cache_of_every_beam_and_matches():
    torch.manual_seed(0)
    model = tm.qwen3().eval()
    ids, mask = _uneven_batch()
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    want = _reference(model, torch.float32).generate(
        input_ids=ids, attention_mask=mask, cache_implementation="static", disable_compile=True, **kw
    )
    eng = InferenceEngine(copy.deepcopy(model), dtype=torch.float32, device="cpu")
    got = eng.generate(ids, mask, **kw)
    assert eng.plan.batch == 9 and torch.equal(got, want)


def test_text_api_takes_a_training_engine_and_refuses_other_objects(tmp_path):
    d = make_model_dir(tmp_path / "m", "llama", dtype=torch.float32, layers=2)
    engine = zerofit.initialize(
        str(d), {"device": "cpu", "precision": "fp32", "micro_batch_size": 1, "gradient_accumulation_steps": 1}
    )
    from zerofit.models.directory import load_tokenizer

    tok = load_tokenizer(d)
    text = zerofit.generate(engine, "The quick", tokenizer=tok, max_new_tokens=5, device="cpu", dtype="fp32")
    ref = zerofit.generate(
        InferenceEngine.from_pretrained(d, device="cpu", dtype="fp32"), "The quick", max_new_tokens=5
    )
    assert text == ref
    with pytest.raises(TypeError, match="model directory"):
        zerofit.generate(object(), "x")
    engine.close()


def test_every_source_of_weights_is_one_contract_and_reads_the_folders_values(tmp_path):
    """A folder, a PEFT model over it as ``zerofit train --lora`` builds it, the folder with one adapter and with
    several, a checkpoint of a run over it and the live engine: each a WeightSource (models/source.py), each
    building the model on the meta device and filling a base weight with the folder's value."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from zerofit.infer.adapter_source import AdapterSource
    from zerofit.infer.sources import CheckpointSource, EngineSource, open_source
    from zerofit.lora.model import from_model_dir
    from zerofit.lora.options import LoraOptions
    from zerofit.models import ModelDir
    from zerofit.models.source import WeightSource
    from zerofit.serve.adapters import MultiAdapterSource

    d = make_model_dir(tmp_path / "m", "llama", dtype=torch.float32, layers=2)
    hf = AutoModelForCausalLM.from_pretrained(d)
    want = hf.model.layers[1].mlp.up_proj.weight.detach()
    torch.manual_seed(0)
    get_peft_model(hf, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "a")
    engine = zerofit.initialize(str(d), {"device": "cpu", "precision": "fp32", "micro_batch_size": 1})
    engine.save_checkpoint(tmp_path / "ck")
    name = "model.layers.1.mlp.up_proj.weight"
    peft_name = "base_model.model." + name  # (up_proj carries no adapter: its base name under PEFT)
    sources = {
        "folder": (ModelDir.open(d), name),
        "opened": (open_source(d), name),
        "peft": (from_model_dir(d, LoraOptions(r=2, alpha=4, targets="q_proj"))[1], peft_name),
        "adapter": (AdapterSource(d, tmp_path / "a"), peft_name),
        "adapters": (MultiAdapterSource(d, {"one": tmp_path / "a", "two": tmp_path / "a"}), peft_name),
        "checkpoint": (open_source(tmp_path / "ck"), name),
        "engine": (EngineSource(engine), name),
    }
    assert isinstance(sources["checkpoint"][0], CheckpointSource)
    for what, (src, n) in sources.items():
        assert isinstance(src, WeightSource), what
        model = src.build_meta()
        assert dict(model.named_parameters())[n].is_meta, what
        assert src.dtype() == torch.float32 and src.tokenizer() is not None, what
        got = torch.empty(want.shape, dtype=torch.float32)
        src.fill([n], got)
        src.close()
        assert torch.equal(got, want), what
    engine.close()
