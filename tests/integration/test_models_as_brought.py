"""Models and loops as users bring them, with the one change the docs name, against the same code on plain PyTorch
(or the real library): a wrapper that calls an HF model with its cache on, a forward that returns logits or a
reconstruction for the user's criterion, a model with its own activation checkpointing, PEFT's quicktour ending in
``save_pretrained``, torch's FSDP names from ``zerofit.fsdp``, and a loop that forgets ``zero_grad``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.support import tiny_models as tm
from zerofit.fsdp import CPUOffload, MixedPrecision
from zerofit.fsdp import FullyShardedDataParallel as FSDP
from zerofit.userloop import UserLoopError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _plain_steps(model, batches, loss_of) -> list[float]:
    """The tutorial's loop: forward, the user's loss, backward, step, zero_grad."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    out = []
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _same_weights(state: dict, ref: nn.Module) -> None:
    for n, p in ref.named_parameters():
        assert torch.equal(state[n], p.detach()), n


class CausalLM(nn.Module):
    """A user's module around an HF causal LM, called as its docs show (``use_cache`` left at the config's
    default, True)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, x):
        return self.lm(input_ids=x, labels=x).loss


def _wrapped_llama():
    torch.manual_seed(0)
    lm = tm.llama(tied=False)
    lm.config.use_cache = True
    return CausalLM(lm)


def test_a_wrapper_calling_the_model_with_its_cache_on_trains_as_plain_pytorch_under_fsdp():
    """The cache would keep the first pass's keys and values: the recompute would read them and k_proj, v_proj
    get no gradient. The engine runs the model without its cache."""
    ref = _wrapped_llama()
    model = FSDP(copy.deepcopy(ref), cpu_offload=CPUOffload(offload_params=True))
    data = [torch.randint(0, tm.VOCAB, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    want = _plain_steps(ref, data, lambda m, x: m(x))
    got = _plain_steps(model, data, lambda m, x: m(x))
    assert got == want
    _same_weights(model.state_dict(), ref)
    assert ref.lm.config.use_cache and model.lm.config.use_cache  # the user's setting as it was


def test_a_wrapper_calling_the_model_with_its_cache_on_trains_as_plain_pytorch_under_the_deepspeed_door():
    import zerofit.deepspeed as deepspeed

    ref = _wrapped_llama()
    engine, *_ = deepspeed.initialize(
        model=copy.deepcopy(ref),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "cpu"},
            },
        },
    )
    data = [torch.randint(0, tm.VOCAB, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for x in data:
        want = ref(x)
        want.backward()
        opt.step()
        opt.zero_grad()
        got = engine(x)
        engine.backward(got)
        engine.step()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    k_proj = "lm.model.layers.0.self_attn.k_proj.weight"
    state = engine.module.state_dict()
    torch.testing.assert_close(state[k_proj], dict(ref.named_parameters())[k_proj].detach(), rtol=1e-4, atol=1e-6)


class Block(nn.Module):
    def __init__(self, d, ckpt=False):
        super().__init__()
        self.l1, self.l2, self.ckpt = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), ckpt

    def _f(self, x):
        return x + self.l2(F.relu(self.l1(x)))

    def forward(self, x):
        return checkpoint(self._f, x, use_reentrant=False) if self.ckpt else self._f(x)


class MyLargeModel(nn.Module):
    """A classifier whose forward returns logits; ``ckpt``: 'inner' (each block checkpoints itself), 'outer' (the
    model checkpoints each block), or None."""

    def __init__(self, ckpt=None, d=32, n=4, classes=5):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList(Block(d, ckpt == "inner") for _ in range(n))
        self.head = nn.Linear(d, classes)
        self.ckpt = ckpt

    def forward(self, x):
        h = self.inp(x)
        for block in self.layers:
            h = checkpoint(block, h, use_reentrant=False) if self.ckpt == "outer" else block(h)
        return self.head(h)


def _classes(n=3, rows=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(rows, 8, generator=g).to(dtype), torch.randint(0, 5, (rows,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("ckpt", [None, "inner", "outer"])
def test_logits_reach_the_users_criterion_and_the_models_own_checkpointing_composes(ckpt):
    """``outputs = model(inputs); loss = criterion(outputs, labels)``, with and without the model's own
    ``torch.utils.checkpoint`` around its blocks: bitwise plain PyTorch."""
    torch.manual_seed(0)
    ref = MyLargeModel(ckpt)
    model = FSDP(copy.deepcopy(ref))
    criterion = nn.CrossEntropyLoss()
    data = _classes()
    want = _plain_steps(ref, data, lambda m, b: criterion(m(b[0]), b[1]))
    got = _plain_steps(model, data, lambda m, b: criterion(m(b[0]), b[1]))
    assert got == want
    _same_weights(model.state_dict(), ref)


def test_the_models_own_checkpointing_in_bf16_recomputes_in_bf16():
    """Under MixedPrecision(bf16) the model's own checkpoint recomputes a block with the engine's bf16 weights,
    as its first pass ran: the same steps as the model without its checkpointing."""

    def run(ckpt):
        torch.manual_seed(0)
        model = FSDP(
            MyLargeModel(ckpt),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
            cpu_offload=CPUOffload(offload_params=True),
        )
        criterion = nn.CrossEntropyLoss()
        losses = _plain_steps(model, _classes(dtype=torch.bfloat16), lambda m, b: criterion(m(b[0]).float(), b[1]))
        return losses, model.state_dict()

    (got, mine), (want, theirs) = run("inner"), run(None)
    assert got == want
    assert all(torch.equal(mine[n], v) for n, v in theirs.items())


def test_mixed_precision_casts_the_models_floating_inputs_as_fsdp_does():
    """FSDP's MixedPrecision casts the root's floating inputs to param_dtype (cast_root_forward_inputs): fp32
    inputs to a bf16 wrapper train as the same inputs given in bf16."""

    def run(dtype):
        torch.manual_seed(0)
        model = FSDP(MyLargeModel(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        return _plain_steps(model, _classes(dtype=dtype), lambda m, b: F.cross_entropy(m(b[0]).float(), b[1]))

    assert run(torch.float32) == run(torch.bfloat16)


class AutoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 16))

    def forward(self, x):
        z = self.encoder(x)
        return {"z": z, "x_hat": self.decoder(z)}


def test_an_output_of_several_tensors_in_a_dict_reaches_the_users_objective():
    torch.manual_seed(0)
    ref = AutoEncoder()
    model = FSDP(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 16, generator=g) for _ in range(3)]

    def loss_of(m, x):
        out = m(x)
        return F.mse_loss(out["x_hat"], x) + 0.1 * out["z"].pow(2).mean()

    assert _plain_steps(model, data, loss_of) == _plain_steps(ref, data, loss_of)
    _same_weights(model.state_dict(), ref)


def test_peft_quicktour_trains_and_saves_with_save_pretrained(tmp_path):
    """PEFT's quicktour: ``get_peft_model``, the loop, ``model.save_pretrained``, ``PeftModel.from_pretrained``:
    the wrapper reaches the PEFT model's methods as torch's FSDP does; the adapter reloaded gives plain PyTorch's
    logits."""
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model

    torch.manual_seed(0)
    base = tm.llama(tied=False)
    cfg = LoraConfig(task_type=TaskType.CAUSAL_LM, inference_mode=False, r=8, lora_alpha=32, lora_dropout=0.1)
    data = [torch.randint(0, tm.VOCAB, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    logits = {}
    for name in ("plain", "zerofit"):
        torch.manual_seed(0)
        model = get_peft_model(copy.deepcopy(base), cfg)
        if name == "zerofit":
            model = FSDP(model, cpu_offload=CPUOffload(offload_params=True))
        torch.manual_seed(1)  # the same dropout masks
        model.train()
        _plain_steps(model, data, lambda m, x: m(input_ids=x, labels=x).loss)
        model.save_pretrained(tmp_path / name)
        model.print_trainable_parameters()  # another of the wrapped model's methods
        fresh = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / name).eval()
        with torch.no_grad():
            logits[name] = fresh(input_ids=data[0]).logits
    assert torch.equal(logits["zerofit"], logits["plain"])


def test_zerofit_fsdp_exports_torch_fsdps_public_names():
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap

    import zerofit.fsdp
    import zerofit.fsdp.wrap

    for name in torch_fsdp.__all__:
        assert hasattr(zerofit.fsdp, name), name
    assert zerofit.fsdp.CPUOffload is torch_fsdp.CPUOffload
    assert zerofit.fsdp.FullyShardedDataParallel is not torch_fsdp.FullyShardedDataParallel
    assert zerofit.fsdp.wrap.transformer_auto_wrap_policy is torch_wrap.transformer_auto_wrap_policy


def test_the_wrapper_reaches_the_wrapped_models_attributes():
    model = FSDP(tm.llama(tied=False))
    assert model.config.num_hidden_layers == 3
    assert model.get_input_embeddings() is model.module.get_input_embeddings()
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = model.no_such_thing


def test_a_loop_without_zero_grad_is_refused_by_name():
    """Torch adds a step's gradients to the last step's when the loop never calls zero_grad (a GradScaler loop
    written without it): the engine starts each step from zero, so the step after is refused, and so is a
    zero_grad between a backward and its step (torch would drop that backward's gradients)."""
    model = FSDP(MyLargeModel())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    criterion = nn.CrossEntropyLoss()
    (x, y), (x2, y2) = _classes(2)
    criterion(model(x), y).backward()
    opt.step()
    loss = criterion(model(x2), y2)
    with pytest.raises(UserLoopError, match=r"without optimizer.zero_grad\(\)"):
        loss.backward()

    model = FSDP(MyLargeModel())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    criterion(model(x), y).backward()
    with pytest.raises(UserLoopError, match=r"torch would drop their gradients"):
        opt.zero_grad()

    model = FSDP(MyLargeModel())  # model.zero_grad() clears as well, at either end of the step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _classes(3):
        model.zero_grad()
        out = model(x)
        criterion(out, y).backward()
        opt.step()
    assert model.zerofit_engine.global_step == 3


def test_a_plain_head_after_the_wrapped_model_trains_by_torchs_step_and_a_clip_over_both_is_refused():
    """[Note: one wrapped model per optimizer]: plain parameters after the wrapped model, in the same optimizer,
    train as plain PyTorch trains them; a clip over both would leave theirs out, so it is refused by name, as is
    an input of the wrapped model that requires grad."""
    torch.manual_seed(0)
    ref_body, ref_head = MyLargeModel(), nn.Linear(5, 3)
    body, head = FSDP(copy.deepcopy(ref_body)), copy.deepcopy(ref_head)
    data = _classes()

    def steps(body, head):
        opt = torch.optim.AdamW([*body.parameters(), *head.parameters()], lr=1e-2, fused=True)
        out = []
        for x, y in data:
            loss = F.cross_entropy(head(body(x)), y % 3)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    assert steps(body, head) == steps(ref_body, ref_head)
    _same_weights(body.state_dict(), ref_body)
    assert all(torch.equal(a, b) for a, b in zip(head.parameters(), ref_head.parameters()))

    x, y = data[0]
    F.cross_entropy(head(body(x)), y % 3).backward()
    with pytest.raises(UserLoopError, match="outside it"):
        torch.nn.utils.clip_grad_norm_([*body.parameters(), *head.parameters()], 1.0)
    with pytest.raises(UserLoopError, match="an input of the wrapped model requires grad"):
        FSDP(MyLargeModel())(torch.randn(2, 8, requires_grad=True))


def test_fsdp_arguments_zerofit_does_not_take_say_what_to_do():
    with pytest.raises(UserLoopError, match=r"process_group.*launch fewer"):
        FSDP(MyLargeModel(), process_group=object())
    with pytest.raises(UserLoopError, match=r"ignored_modules.*requires_grad_\(False\)"):
        FSDP(MyLargeModel(), ignored_modules=[])


class KeywordLabels(tm.PlainLM):
    """``labels`` keyword-only and required."""

    def forward(self, input_ids, *, labels):
        return super().forward(input_ids, labels)


class KwargsLabels(tm.PlainLM):
    """``labels`` through ``**kwargs``, read before the first block."""

    def forward(self, input_ids, **kwargs):
        return super().forward(input_ids, kwargs["labels"])


class ResidualAround(tm.PlainLM):
    """The residual around each block (``h = h + block(h)``): not a chain of blocks, so it trains on the generic
    path ([Note: generic fallback]), whose rebuild keeps the model's parameter objects."""

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _accumulating(model, data, step_of=None) -> list[float]:
    """The tutorial's loop with G micro-batches per step: ``(loss / G).backward()`` each, then the step
    (``step_of(loss)``: the door's own per micro-batch; None: AdamW over ``model.parameters()``, built after the
    wrap, stepped after the G-th)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True) if step_of is None else None
    out = []
    for mbs in data:
        losses = []
        for mb in mbs:
            loss = model(**mb)
            if step_of is None:
                (loss / len(mbs)).backward()
            else:
                step_of(loss)
            losses.append(loss.detach())
        if opt is not None:
            opt.step()
            opt.zero_grad()
        out.append(torch.stack(losses).mean().item())
    return out


@pytest.mark.parametrize("cls", [KeywordLabels, KwargsLabels, ResidualAround])
@pytest.mark.parametrize("door", ["zerofit.fsdp", "zerofit.deepspeed", "zerofit.initialize"])
def test_hand_written_forwards_train_as_plain_pytorch_under_every_door(cls, door):
    """A forward that requires ``labels`` keyword-only or reads it from ``**kwargs`` before its first block (the
    pre pass calls it with the micro-batch as the user's forward takes it), and one with the residual around its
    blocks (the generic path): under each door the losses and weights of plain PyTorch, and the user's optimizer
    built over the wrapper's parameters holds the model's parameters through the generic path's rebuild."""
    import zerofit
    import zerofit.deepspeed as deepspeed

    torch.manual_seed(0)
    ref = cls()
    data = tm.batches(3, 2)
    want = _accumulating(ref, data)
    torch.manual_seed(0)
    model = cls()
    if door == "zerofit.fsdp":
        wrapped = FSDP(model, zerofit_config={"device": "cpu"})
        got = _accumulating(wrapped, data)
        state = wrapped.state_dict()
    elif door == "zerofit.deepspeed":
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config={
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 2,
                "gradient_clipping": 0,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                "zero_optimization": {"stage": 3},
            },
        )

        def step_of(loss):
            engine.backward(loss)
            engine.step()

        got = _accumulating(engine, data, step_of)
        state = engine.module.state_dict()
    else:
        engine = zerofit.initialize(
            model,
            {
                "device": "cpu",
                "precision": "fp32",
                "micro_batch_size": 2,
                "gradient_accumulation_steps": 2,
                "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
            },
        )
        got = [engine.train_batch(mbs) for mbs in data]
        state = engine.module.state_dict()
    assert got == want
    _same_weights(state, ref)


def test_the_residual_model_clipped_under_fsdp_is_plain_pytorch_after_the_generic_rebuild():
    """``model.clip_grad_norm_`` of the user's loop sums the trained parameters in the module's order: after the
    generic path's rebuild it follows the new unit (the norms and weights of torch's own clip)."""

    def loop(model, data, clip):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
        norms = []
        for mbs in data:
            for mb in mbs:
                (model(**mb) / len(mbs)).backward()
            norms.append(float(clip(model)))
            opt.step()
            opt.zero_grad()
        return norms

    torch.manual_seed(0)
    ref = ResidualAround()
    torch.manual_seed(0)
    wrapped = FSDP(ResidualAround(), zerofit_config={"device": "cpu"})
    data = tm.batches(3, 2)
    want = loop(ref, data, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
    assert loop(wrapped, data, lambda m: m.clip_grad_norm_(0.5)) == want and want[0] > 0.5
    _same_weights(wrapped.state_dict(), ref)
