"""The hooked mode ([Note: the hooked mode], engine/model/hooked.py): models that are not one chain of blocks stream by
their submodules' calls, as under DeepSpeed ZeRO-3 and FSDP. A residual ModuleList with a long skip, a U-Net (with
dropout) and two towers with a module applied twice, each streamed unit by unit (no unit resident) under a budget of a
few slots, through ``zerofit.initialize`` + ``train_batch``, the DeepSpeed-shaped loop and the FSDP-shaped loop:
plain PyTorch's losses and weights, bitwise (fp32, torch's fused AdamW)."""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
import zerofit.deepspeed as deepspeed
from tests.support import any_models as am
from tests.support import tiny_models as tm
from zerofit.engine.memory.store import Home, WeightState
from zerofit.fsdp import CPUOffload
from zerofit.fsdp import FullyShardedDataParallel as FSDP

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS, G, LR = 4, 2, 1e-3
MODELS = {"residual": am.Residual, "unet": am.UNet, "two-towers": am.TwoTowers}
STREAMED = {"adapter": "hooked", "offload": {"resident_blocks": 0, "prefetch_depth": 1}}


def _plain(model, data):
    """Plain PyTorch: (loss / G).backward() per micro-batch, torch's fused AdamW."""
    return tm.reference_train(model, data, lr=LR, fused=True)


def _cfg(**kw):
    cfg = {"device": "cpu", "precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": G}
    return cfg | {"optimizer": {"lr": LR, "weight_decay": 0.01}} | STREAMED | kw


def _watch(engine) -> list:
    """Record each upload (a unit's name) and, at each, how many units hold a weight slot."""
    seen: list = []
    streamer = engine.streamer
    begin = streamer.begin_upload

    def upload(unit, protect, wait=True):
        held = sum(u.streamed.state is not WeightState.ON_HOST for u in engine.blocks)
        seen.append((unit.name, held))
        return begin(unit, protect, wait)

    streamer.begin_upload = upload
    return seen


def _assert_streamed(engine, seen, micro_batches: int) -> None:
    """Every unit streams (none resident) and is uploaded in every micro-batch; the first one again for its
    backward (its slot went to the units after it: released after its forward, fetched again); no more units than
    the slots hold weights at once. (The last units keep their slots from their forward to their backward.)"""
    units = engine.blocks
    assert len(units) >= 4 and all(u.home is Home.STREAMED for u in units)
    slots = engine.plan.weight_slots
    assert slots < len(units), "the budget holds fewer units than the model has"
    counts = {u.name: sum(n == u.name for n, _ in seen) for u in units}
    assert all(c >= micro_batches for c in counts.values()), counts
    assert counts[units[0].name] == 2 * micro_batches, counts
    assert max(h for _, h in seen) <= slots


def _assert_weights(state: dict, ref, atol: float = 0.0) -> None:
    """Bitwise; with ``atol``, within it."""
    for n, p in ref.named_parameters():
        if atol:
            torch.testing.assert_close(state[n], p.detach(), rtol=0, atol=atol, msg=n)
        else:
            assert torch.equal(state[n], p.detach()), n


@pytest.mark.parametrize("name", MODELS)
def test_train_batch_streams_each_unit_and_is_plain_pytorch_bitwise(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg())
    assert engine.adapter.hooked and not engine.adapter.streaming
    seen = _watch(engine)
    data = tm.batches(STEPS, G, T=8)
    torch.manual_seed(1)  # the same dropout draws on both sides
    losses = [engine.train_batch(mbs) for mbs in data]
    torch.manual_seed(1)
    want = _plain(ref, data)
    assert losses == pytest.approx(want, rel=1e-6)
    _assert_streamed(engine, seen, STEPS * G)
    _assert_weights(engine.master_state_dict(), ref)
    engine.close()


@pytest.mark.parametrize("name", ["residual", "two-towers"])
def test_the_deepspeed_shaped_loop_streams_by_calls_and_is_plain_pytorch_bitwise(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": G,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds, device="cpu", **STREAMED
    )
    seen = _watch(engine)
    data = tm.batches(STEPS, G, T=8)
    losses = []
    for mbs in data:
        total = 0.0
        for mb in mbs:
            loss = engine(**mb).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / G)
    assert losses == pytest.approx(_plain(ref, data), rel=1e-6)
    _assert_streamed(engine, seen, STEPS * G)
    _assert_weights(engine.master_state_dict(), ref)
    engine.close()


@pytest.mark.parametrize("name", ["residual", "unet"])
def test_the_fsdp_shaped_loop_streams_by_calls_and_is_plain_pytorch_bitwise(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    wrapped = FSDP(model, cpu_offload=CPUOffload(offload_params=True), zerofit_config={"device": "cpu", **STREAMED})
    engine = wrapped.zerofit_engine
    seen = _watch(engine)
    data = tm.batches(STEPS, G, T=8)
    torch.manual_seed(1)
    got = _plain(wrapped, data)
    torch.manual_seed(1)
    want = _plain(ref, data)
    assert got == pytest.approx(want, rel=1e-6)
    _assert_streamed(engine, seen, STEPS * G)
    _assert_weights(wrapped.state_dict(), ref)


def test_every_parameters_gradient_once_is_plain_pytorchs():
    """One micro-batch's gradients, read off the host buffers the step sums them in, against autograd's."""
    torch.manual_seed(0)
    model = am.TwoTowers()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(gradient_accumulation_steps=1))
    mb = tm.batches(1, 1, T=8)[0][0]
    engine.backward(engine(**mb).loss)
    engine.worker.drain()
    ref(**mb).loss.backward()
    for u in engine.units:
        grad = engine.grads.host_grads.get(id(u))
        if grad is None:  # the shell: its own buffer on the device
            grad = u.grads.tensor
        views = u.layout.views(grad)
        prefix = "" if u.index < 0 else engine.adapter.block_prefix(u.index) + "."
        for n, g in views.items():
            assert torch.equal(g, ref.get_parameter(prefix + n).grad), prefix + n
    engine.close()


def test_units_by_class_name_and_an_unknown_class_in_one_line():
    torch.manual_seed(0)
    model = am.Residual()
    engine = zerofit.initialize(model, _cfg(hooked_units=["Sequential"]))
    assert [u.name for u in engine.blocks] == [f"blocks.{i}" for i in range(4)]
    engine.close()
    with pytest.raises(ValueError, match=r"hooked_units: no module of the model is a Conv2d \(its module classes: "):
        zerofit.initialize(am.Residual(), _cfg(hooked_units=["Conv2d"]))


class _ReadsAWeight(am.Residual):
    """The head's weight read directly by the model's own code (x @ W.T), outside the head's call."""

    def forward(self, input_ids, labels=None, **_):
        h = self.norm(self.emb(input_ids))
        logits = h @ self.head.weight.T + self.head.bias
        return am.Out(am._loss(logits, labels), logits)


def test_a_units_parameter_read_outside_its_call_is_refused_in_one_line():
    """[Note: a unit's parameters outside its call]: not computed silently with the host master."""
    from zerofit.engine.step.hooked import UnitParameterOutside

    engine = zerofit.initialize(_ReadsAWeight(), _cfg(hooked_units=["Linear", "Embedding"]))
    assert "head" in [u.name for u in engine.blocks]
    with pytest.raises(UnitParameterOutside, match=r"outside that unit's own call .* name in hooked_units"):
        engine.train_batch(tm.batches(1, G, T=8)[0])
    engine.close()


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=3, num_heads=4)
    cfg.decoder_start_token_id = cfg.pad_token_id = 0
    return T5ForConditionalGeneration(cfg), ["T5Block"]


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(
        vocab_size=128,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        forced_eos_token_id=None,
    )
    return BartForConditionalGeneration(cfg), ["BartEncoderLayer", "BartDecoderLayer"]


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=128,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=32,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=3,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    return WhisperForConditionalGeneration(cfg), ["WhisperEncoderLayer", "WhisperDecoderLayer"]


def _pairs(steps: int, g: int, seed: int = 1, audio: bool = False) -> list[list[dict]]:
    """Inputs of 12 tokens (or, ``audio``, 32 frames of 8 mel bins) and targets of 7: an encoder-decoder's labels are
    not its inputs' shape."""
    gen = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(4, 128, (2, n), generator=gen)  # noqa: E731
    source = (
        (lambda: {"input_features": torch.randn(2, 8, 32, generator=gen)})
        if audio
        else (lambda: {"input_ids": ids(12)})
    )
    return [[{**source(), "labels": ids(7)} for _ in range(g)] for _ in range(steps)]


@pytest.mark.parametrize("build", [_t5, _bart, _whisper], ids=["t5", "bart", "whisper"])
@pytest.mark.parametrize("door", ["train_batch", "deepspeed", "fsdp"])
def test_encoder_decoders_stream_both_stacks_and_are_plain_pytorch(build, door):
    """T5, BART and Whisper (``input_features``; dropout on in T5: the recompute replays it) with their encoder and
    decoder blocks as units (the decoder's with their cross-attention), labels shorter than the inputs (the model
    builds decoder_input_ids),
    through each door: plain PyTorch's losses, and its weights within 1e-6 (the shared embedding is used by the
    encoder, the decoder and the head, and autograd sums its gradients in another order here: a rounding apart after
    the first step, which the next steps carry into the other weights)."""
    torch.manual_seed(0)
    model, classes = build()
    ref = copy.deepcopy(model)
    cfg = _cfg(hooked_units=classes)
    data = _pairs(STEPS, G, audio=build is _whisper)
    torch.manual_seed(2)
    if door == "train_batch":
        engine = zerofit.initialize(model, cfg)
        seen = _watch(engine)
        got = [engine.train_batch(mbs) for mbs in data]
        state = engine.master_state_dict()
    elif door == "deepspeed":
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        seen = _watch(engine)
        got = []
        for mbs in data:
            total = 0.0
            for mb in mbs:
                loss = engine(**mb).loss
                engine.backward(loss)
                engine.step()
                total += loss.item()
            got.append(total / G)
        state = engine.master_state_dict()
    else:
        wrapped = FSDP(model, cpu_offload=CPUOffload(offload_params=True), zerofit_config=cfg)
        engine = wrapped.zerofit_engine
        seen = _watch(engine)
        got = _plain(wrapped, data)
        state = wrapped.state_dict()
    names = {u.name.rsplit(".", 1)[0] for u in engine.blocks}
    assert len(names) == 2 and all("decoder" in n or "encoder" in n for n in names), names
    torch.manual_seed(2)
    assert got == pytest.approx(_plain(ref, data), rel=1e-6)
    _assert_streamed(engine, seen, STEPS * G)
    _assert_weights(state, ref, atol=1e-6)


def test_an_encoder_decoders_labels_must_have_one_row_per_input():
    model, classes = _t5()
    engine = zerofit.initialize(model, _cfg(hooked_units=classes))
    mb = {"input_ids": torch.randint(3, 128, (2, 12)), "labels": torch.randint(3, 128, (3, 7))}
    with pytest.raises(ValueError, match=r"labels'\] has 3 rows, input_ids 2: an encoder-decoder's labels"):
        engine.train_batch([mb, mb])
    engine.close()


def test_calls_after_the_first_step_find_their_units_prefetched():
    """[Note: prefetch by the recorded order]: the first step records the calls' order and uploads each unit when it
    is called; from the second step on, all but the first unit of the forward (and of the backward) are on their way
    when called. The math is unchanged (the train_batch tests above run with it)."""
    torch.manual_seed(0)
    engine = zerofit.initialize(am.Residual(layers=6), _cfg(gradient_accumulation_steps=1))
    found: list = []
    acquire = engine.streamer.acquire

    def watched(order, pos):
        found.append(order[pos].streamed.state)
        return acquire(order, pos)

    engine.streamer.acquire = watched
    data = tm.batches(2, 1, T=8)
    engine.train_batch(data[0])
    first, found[:] = list(found), []
    engine.train_batch(data[1])
    cold = lambda states: sum(s is WeightState.ON_HOST for s in states)  # noqa: E731
    assert cold(first) >= len(engine.blocks)  # nothing recorded yet: each forward call uploads on its own
    assert cold(found) <= 2, found  # the forward's first unit, the backward's first (if its slot went)
    engine.close()


def test_an_encoder_decoder_trained_in_the_hooked_mode_exports_a_folder_transformers_loads(tmp_path):
    """``save_pretrained`` of a T5 whose blocks stream: the folder loads with transformers' ``from_pretrained``, every
    weight (the tied embedding's aliases too) the engine's masters."""
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(0)
    model, classes = _t5()
    engine = zerofit.initialize(model, _cfg(hooked_units=classes))
    for mbs in _pairs(2, G):
        engine.train_batch(mbs)
    engine.save_pretrained(tmp_path / "out")
    master = engine.master_state_dict()
    engine.close()
    back = T5ForConditionalGeneration.from_pretrained(tmp_path / "out").state_dict()
    for n, t in back.items():
        name = "shared.weight" if n.endswith("embed_tokens.weight") or n == "lm_head.weight" else n
        assert torch.equal(t, master[name]), n


def test_auto_chooses_the_hooked_mode_for_a_model_with_no_chain_the_device_cannot_hold(monkeypatch):
    """``adapter: auto`` on a model with no chain of blocks (two towers): one resident unit where the device holds it
    (the plan for it fits), else the hooked mode. The CPU's plan does not bound the device, so the generic plan is
    made to refuse here, as a GPU's too small would."""
    from zerofit.engine import recovery
    from zerofit.engine.plan.search import PlanError

    real = recovery.Planning

    def small_device(config, adapter, *args, **kwargs):
        if not adapter.hooked:
            raise PlanError("the device's budget (1 MiB) holds less than the model")
        return real(config, adapter, *args, **kwargs)

    auto = {k: v for k, v in _cfg().items() if k != "adapter"}
    torch.manual_seed(0)
    resident = zerofit.initialize(am.TwoTowers(), auto)
    assert not resident.adapter.hooked and not resident.blocks  # it fits: one unit
    resident.close()
    monkeypatch.setattr(recovery, "Planning", small_device)
    torch.manual_seed(0)
    model = am.TwoTowers()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, auto)
    assert engine.adapter.hooked and len(engine.blocks) >= 4
    data = tm.batches(2, G, T=8)
    assert [engine.train_batch(mbs) for mbs in data] == pytest.approx(_plain(ref, data), rel=1e-6)
    _assert_weights(engine.master_state_dict(), ref)
    engine.close()


def test_a_checkpoint_of_the_hooked_mode_resumes_bitwise(tmp_path):
    """Two steps, a checkpoint, a fresh engine (another seed) that loads it and takes two more: the uninterrupted
    run's losses and weights, bitwise (the U-Net's dropout draws from the restored RNG state)."""
    data = tm.batches(4, G, T=8)
    torch.manual_seed(0)
    whole = zerofit.initialize(am.UNet(), _cfg())
    torch.manual_seed(5)
    want = [whole.train_batch(mbs) for mbs in data]
    torch.manual_seed(0)
    first = zerofit.initialize(am.UNet(), _cfg())
    torch.manual_seed(5)
    got = [first.train_batch(mbs) for mbs in data[:2]]
    first.save_checkpoint(tmp_path, tag="half")
    first.close()
    torch.manual_seed(1)
    second = zerofit.initialize(am.UNet(), _cfg())
    second.load_checkpoint(tmp_path, tag="half")
    got += [second.train_batch(mbs) for mbs in data[2:]]
    assert got == want
    a, b = whole.master_state_dict(), second.master_state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    whole.close()
    second.close()


@pytest.mark.parametrize("build", [_t5, _bart, _whisper], ids=["t5", "bart", "whisper"])
def test_an_encoder_decoder_streams_its_own_layers_by_default(build):
    """No adapter and no unit classes in the config: an encoder-decoder takes the hooked mode by itself, its units the
    layers transformers names as never split (``_no_split_modules``: ``T5Block``, ``BartEncoderLayer``...)."""
    torch.manual_seed(0)
    model, classes = build()
    ref = copy.deepcopy(model)
    cfg = {k: v for k, v in _cfg().items() if k != "adapter"}
    engine = zerofit.initialize(model, cfg)
    assert engine.adapter.hooked
    assert {type(m).__name__ for m in engine.adapter.blocks} == set(classes) == set(type(model)._no_split_modules)
    data = _pairs(2, G, audio=build is _whisper)
    torch.manual_seed(2)
    got = [engine.train_batch(mbs) for mbs in data]
    torch.manual_seed(2)
    assert got == pytest.approx(_plain(ref, data), rel=1e-6)
    _assert_weights(engine.master_state_dict(), ref, atol=1e-6)
    engine.close()


@pytest.mark.parametrize("build", [_t5, _bart], ids=["t5", "bart"])
def test_an_encoder_decoder_generates_in_the_hooked_mode_with_its_trained_weights(build):
    """``engine.generate`` of a trained encoder-decoder: each unit streamed as in training ([Note: generation in the
    hooked mode]), greedy, transformers' own ``generate`` over the same weights (the engine's masters)."""
    torch.manual_seed(0)
    model, classes = build()
    ref = copy.deepcopy(model).eval()
    engine = zerofit.initialize(model, _cfg(hooked_units=classes))
    for mbs in _pairs(2, G):
        engine.train_batch(mbs)
    seen = _watch(engine)
    engine.adapter.model.eval()
    prompt = _pairs(1, 1, seed=7)[0][0]["input_ids"]
    got = engine.generate(input_ids=prompt, max_new_tokens=6, min_new_tokens=4, do_sample=False)
    ref.load_state_dict(engine.master_state_dict(), strict=False)
    want = ref.generate(input_ids=prompt, max_new_tokens=6, min_new_tokens=4, do_sample=False)
    assert torch.equal(got.cpu(), want) and got.shape[1] > 2
    assert {n for n, _ in seen} == {u.name for u in engine.blocks}  # every unit streamed for it
    engine.close()


def test_a_block_list_that_is_not_a_chain_falls_back_to_the_hooked_mode_where_one_unit_does_not_fit(monkeypatch):
    """``adapter: auto`` on the residual model: its block list is found, its first forward shows the blocks are not
    a chain ([Note: generic fallback]); where the device cannot hold the model as one unit (the generic plan made to
    refuse here, as a GPU's too small would), the engine rebuilds itself in the hooked mode, with deferred updates,
    and the step runs again: plain PyTorch's losses and weights, bitwise."""
    from zerofit.engine import recovery
    from zerofit.engine.plan.search import PlanError

    real = recovery.Planning

    def small_device(config, adapter, *args, **kwargs):
        if not adapter.hooked:
            raise PlanError("the device's budget (1 MiB) holds less than the model")
        return real(config, adapter, *args, **kwargs)

    monkeypatch.setattr(recovery, "Planning", small_device)
    torch.manual_seed(0)
    model = am.Residual()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, {k: v for k, v in _cfg().items() if k != "adapter"})
    assert engine.adapter.streaming and not engine.deferred  # a block list, immediate updates
    data = tm.batches(STEPS, G, T=8)
    losses = [engine.train_batch(mbs) for mbs in data]
    assert engine.adapter.hooked and engine.deferred
    assert losses == pytest.approx(_plain(ref, data), rel=1e-6)
    _assert_weights(engine.master_state_dict(), ref)
    engine.close()


def test_lora_on_an_encoder_decoder_streams_its_blocks_and_trains_the_adapters_as_peft():
    """PEFT's LoRA over T5 (q and v), no adapter in the config: the hooked mode finds the base's own layers through
    the PEFT model, streams each block with its frozen base and its adapters, and trains the adapters as PEFT with
    torch's AdamW does (dropout on, seeded alike), within 1e-6."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base, classes = _t5()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"], lora_dropout=0.0))
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, {k: v for k, v in _cfg().items() if k != "adapter"})
    assert engine.adapter.hooked and {type(m).__name__ for m in engine.adapter.blocks} == set(classes)
    assert all(u.frozen is not None and u.trains for u in engine.blocks)  # the base frozen, the adapters trained
    seen = _watch(engine)
    data = _pairs(STEPS, G)
    torch.manual_seed(2)
    got = [engine.train_batch(mbs) for mbs in data]
    torch.manual_seed(2)
    trained = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, weight_decay=0.01, fused=True)
    want = []
    for mbs in data:
        total = 0.0
        for mb in mbs:
            loss = ref(**mb).loss
            (loss / G).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        want.append(total / G)
    assert got == pytest.approx(want, rel=1e-6)
    _assert_streamed(engine, seen, STEPS * G)
    master = engine.master_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach(), rtol=0, atol=1e-6, msg=n)
    engine.close()


def test_zerofit_generate_of_a_trained_encoder_decoder_engine_decodes_its_answers(tmp_path):
    """``zerofit.generate(engine, prompts)`` of a T5 trained by ``zerofit train``'s folder and tokenizer: the texts of
    transformers' own greedy ``generate`` over the engine's masters, in batches with padding."""
    from transformers import T5ForConditionalGeneration

    from tests.support.model_dirs import make_model_dir
    from tests.support.tiny_tokenizer import build_tokenizer

    folder = make_model_dir(tmp_path / "t5", "t5", torch.float32)
    tok = build_tokenizer()
    engine = zerofit.initialize(str(folder), {k: v for k, v in _cfg().items() if k != "adapter"})
    assert engine.adapter.hooked
    prompts = ["What is 3 plus 3?", "The quick brown fox", "Hello there"]
    got = zerofit.generate(engine, prompts, tokenizer=tok, max_new_tokens=5, batch_size=2, min_new_tokens=3)
    ref = T5ForConditionalGeneration.from_pretrained(folder).eval()
    ref.load_state_dict(engine.master_state_dict(), strict=False)
    want = []
    for a in range(0, 3, 2):
        enc = tok(prompts[a : a + 2], return_tensors="pt", padding=True)
        ids = ref.generate(**enc, max_new_tokens=5, min_new_tokens=3, do_sample=False)
        want += tok.batch_decode(ids, skip_special_tokens=True)
    assert got == want and all(got)
    engine.close()
