"""The calls DeepSpeed scripts make, made as DeepSpeed makes them (CPU, fp32, against plain PyTorch).

- A model straight from ``from_pretrained`` is in eval mode: ``engine(**batch)``, ``engine.backward(loss)`` trains
  it, without dropout ([Note: a forward records for backward as autograd says], engine/step/window.py).
- Positional calls, ``engine(x)`` and ``engine(x, y)``, reach the model's own forward, whatever the model, and
  the engine returns what the model returns (cifar10_deepspeed.py's convnet returns logits, the loss is the
  script's; DeepSpeed's unit tests' ``SimpleModel`` returns its loss).
- Models zerofit cannot split: DeepSpeedExamples' ``SimpleModel`` keeps every parameter in one ``ModuleList``
  (no shell); a model whose blocks are not chained falls back to the generic path, and its checkpoint loads
  into a fresh engine for the same model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerofit
import zerofit.deepspeed as deepspeed
from tests.support import tiny_models as tm


def _ds(G: int = 1, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": G,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3},
        **extra,
    }


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)


def _same_weights(engine, ref: nn.Module, bitwise: bool = True) -> None:
    """Bitwise with one micro-batch a step; with several, the engine sums a tied weight's gradients in another
    order than autograd's accumulation (fp32 rounding)."""
    got = dict(engine.module.named_parameters())
    for n, q in ref.named_parameters():
        if bitwise:
            assert torch.equal(got[n].detach(), q.detach()), n
        else:
            torch.testing.assert_close(got[n].detach(), q.detach(), msg=lambda m, n=n: f"{n}: {m}")


class CifarNet(nn.Module):
    """training/cifar/cifar10_deepspeed.py's ``Net``: no repeated blocks, returns logits."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class SimpleModel(nn.Module):
    """DeepSpeedExamples' training/offload_states ``SimpleModel`` (and DeepSpeed's unit tests'): every parameter in
    one ``ModuleList``, nothing around it; ``forward(x, y)`` returns the loss."""

    def __init__(self, hidden_dim: int, nlayers: int = 1):
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        for layer in self.linears:
            x = layer(x)
        return self.cross_entropy_loss(x, y)


def test_a_model_from_pretrained_trains_in_eval_mode_as_deepspeed_does(tmp_path):
    """The tutorials' flow: from_pretrained (eval mode), deepspeed.initialize, engine(**batch), backward, step.
    Dropout follows the module's mode (off), autograd follows torch.is_grad_enabled()."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tm.llama(dropout=0.2).save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert not model.training
    ref = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_ds(G=2), device="cpu")
    opt = _adamw(ref)
    data = tm.batches(3, 2, B=4)
    for mbs in data:
        ref_losses = []
        for mb in mbs:
            out = engine(**mb)
            engine.backward(out.loss)
            engine.step()
            loss = ref(**mb).loss
            (loss / 2).backward()
            ref_losses.append(loss.detach())
            assert torch.equal(out.loss.detach(), ref_losses[-1])
        opt.step()
        opt.zero_grad()
    _same_weights(engine, ref, bitwise=False)
    assert engine.global_steps == 3
    # an eval-mode forward nobody backpropagated is dropped by the next call, as DeepSpeed drops its graph
    engine(**data[0][0])
    assert torch.isfinite(torch.tensor(engine.train_batch(data[0])))
    engine.close()


def test_positional_calls_reach_a_convnet_and_return_its_logits():
    torch.manual_seed(0)
    net = CifarNet()
    ref = copy.deepcopy(net)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=_ds(), device="cpu")
    opt = _adamw(ref)
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        inputs, labels = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
        outputs = engine(inputs)
        assert outputs.shape == (4, 10)  # the model's own output
        loss = criterion(outputs, labels)
        engine.backward(loss)
        engine.step()
        ref_loss = criterion(ref(inputs), labels)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.equal(loss.detach(), ref_loss.detach())
    _same_weights(engine, ref)
    with torch.no_grad():
        x = torch.randn(2, 3, 32, 32)
        assert torch.equal(engine(x), ref(x))
    with pytest.raises(TypeError, match=r"engine\(\.\.\.\): too many positional arguments"):
        engine(x, x)
    from zerofit.engine.step.batch import BatchError

    with pytest.raises(BatchError, match=r"micro-batch 0 is a Tensor; .*forward \(x\)") as err:
        engine.train_batch([x])
    assert "input_ids" not in str(err.value)  # a convnet's hint names its own argument
    engine.close()


@pytest.mark.parametrize("nlayers", [1, 3])
def test_a_model_that_is_only_a_block_list_trains(nlayers):
    """offload_states' SimpleModel: with 3 layers every parameter is in the blocks and the shell trains nothing;
    with 1 there is nothing to stream (the generic path)."""
    torch.manual_seed(0)
    model = SimpleModel(16, nlayers)
    ref = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_ds(), device="cpu")
    assert engine.adapter.streaming == (nlayers > 1)
    opt = _adamw(ref)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(4, 16, generator=g), torch.randint(0, 16, (4,), generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        ref_loss = ref(x, y)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.equal(loss.detach(), ref_loss.detach())
    _same_weights(engine, ref)
    engine.close()


class _SkipLM(tm.PlainLM):
    """A residual around each block: block i+1 reads block i's output plus its input, so the blocks cannot
    stream one at a time and the engine falls back to the generic path."""

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x) + x
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_the_checkpoint_of_a_model_that_fell_back_loads_in_a_fresh_engine(tmp_path):
    cfg = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    }
    torch.manual_seed(0)
    model = _SkipLM()
    twin = copy.deepcopy(model)
    engine = zerofit.initialize(model, cfg)
    data = tm.batches(4, 2)
    for mbs in data[:2]:
        engine.train_batch(mbs)
    assert not engine.adapter.streaming  # it fell back on its first step
    engine.save_checkpoint(tmp_path)
    rest = [engine.train_batch(mbs) for mbs in data[2:]]
    final = engine.master_state_dict()
    engine.close()
    fresh = zerofit.initialize(twin, cfg)  # streams until its first forward shows it cannot
    assert fresh.adapter.streaming
    fresh.load_checkpoint(tmp_path)
    assert [fresh.train_batch(mbs) for mbs in data[2:]] == rest  # falls back with the loaded moments
    assert not fresh.adapter.streaming
    for n, v in fresh.master_state_dict().items():
        assert torch.equal(v, final[n]), n
    fresh.close()
    # and the other way: a generic engine loads a checkpoint an engine that streams saved
    torch.manual_seed(0)
    streaming = zerofit.initialize(tm.PlainLM(), cfg)
    streaming.train_batch(data[0])
    streaming.save_checkpoint(tmp_path / "blocks")
    after = streaming.train_batch(data[1])
    streaming.close()
    torch.manual_seed(0)
    generic = zerofit.initialize(tm.PlainLM(), cfg, adapter="generic")
    generic.load_checkpoint(tmp_path / "blocks")
    assert generic.train_batch(data[1]) == pytest.approx(after, rel=1e-6)
    generic.close()


def test_a_model_attribute_read_through_the_engine_waits_for_nothing_and_a_method_for_the_updates(monkeypatch):
    """DeepSpeed's engine passes what it does not have on to its module. A value (``engine.training``, a model's
    own attribute) is read as it is: no attribute read waits for the engine's updates, which with several ranks is
    a collective. A method of the module (``engine.named_parameters()``) is called with the weights made current."""
    from zerofit.engine.engine import Engine

    model = SimpleModel(8, nlayers=2)
    model.marker = "mine"
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_ds())
    waits = []
    real = Engine._apply_pending
    monkeypatch.setattr(Engine, "_apply_pending", lambda self, *a, **k: (waits.append(a), real(self, *a, **k)))
    assert engine.marker == "mine" and engine.training in (True, False)
    assert waits == []
    names = [n for n, _ in engine.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()] and len(waits) == 1
    engine.close()


def test_the_deepspeed_face_is_held_by_the_engine_not_its_base():
    """The engine holds its DeepSpeed face (``engine.deepspeed``) and serves its names as its own: the DeepSpeed loop
    through either is the same call, the face holds the engine weakly (a dropped engine is freed with it), and a
    name neither has is a plain AttributeError (``getattr`` with a default works)."""
    import gc
    import weakref

    from zerofit.engine.engine import Engine
    from zerofit.engine.faces.deepspeed_surface import DeepSpeedFace

    assert DeepSpeedFace not in Engine.__mro__
    model = SimpleModel(8, nlayers=2)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_ds())
    face = engine.deepspeed
    assert isinstance(face, DeepSpeedFace) and face.engine is engine
    assert Engine.backward.__doc__ == DeepSpeedFace.backward.__doc__
    x = torch.randn(4, 8)
    engine.backward(engine(x, torch.zeros(4, dtype=torch.long)))
    assert face.record.unstepped == engine.window.micro_steps == 1 and engine.micro_steps == face.micro_steps
    engine.step()
    assert engine.global_steps == face.global_steps == 1 and engine.was_step_applied()
    assert getattr(engine, "no_such_name", "default") == "default"
    engine.close()
    gone = weakref.ref(engine)
    del engine, face
    gc.collect()
    assert gone() is None
