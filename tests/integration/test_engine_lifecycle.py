"""The engine's lifecycle and failure semantics on the CPU (RELIABILITY.md: "a process ends cleanly", no
half-applied step): close() and the context manager, release at garbage collection and at exit, errors
inside a step (forward, loss, backward, a bad batch, out of memory, the CPU worker), Ctrl-C, evaluation
forwards, and the generic fallback of models whose blocks are not chained. See [Note: failure semantics]
and [Note: engine lifecycle] in src/zerofit/engine/lifecycle.py.

Faults come from a model whose blocks raise (or send themselves SIGINT) on a flag (``_FaultyLM``), and from
an AdamW that fails on the CPU worker thread (the ``adamw_flat`` that ``unit_adamw`` calls, monkeypatched).
Every injecting test asserts that its fault fired.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import signal
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerofit
import zerofit.engine.update.unit_adamw as optimizer_module
from tests.support import lifecycle_script
from tests.support import tiny_models as tm
from zerofit.engine.lifecycle import EngineClosedError, EngineFailedError, EngineState
from zerofit.engine.model.adapter import loss_of
from zerofit.engine.step.batch import BatchError
from zerofit.engine.update.worker import WorkerError

G = 2


# ---------------------------------------------------------------------------------------------- helpers


def _cfg(**kw) -> dict:
    base = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": G,
        "seq_len": 16,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    }
    base.update(kw)
    return base


def _snapshot(engine) -> list:
    engine.wait()
    return [(u.name, u.master.clone(), u.exp_avg.clone(), u.exp_avg_sq.clone(), u.step.clone()) for u in engine.units]


def _assert_unchanged(before, after) -> None:
    for (name, *a), (_, *b) in zip(before, after, strict=True):
        for what, x, y in zip(("master", "exp_avg", "exp_avg_sq", "step"), a, b):
            assert torch.equal(x, y), f"{name}.{what} changed"


def _assert_same_masters(engine, other) -> None:
    a, b = engine.master_state_dict(), other.master_state_dict()
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), f"{n} differs from the run that never saw the failed step"


def _ds_step(engine, mbs) -> float:
    """One optimizer step through the DeepSpeed-shaped API (outputs may be a loss tensor or carry .loss)."""
    total = 0.0
    for mb in mbs:
        loss = loss_of(engine(**mb))
        engine.backward(loss)
        engine.step()
        total += loss.item()
    return total / len(mbs)


def _train(engine, mbs, api: str) -> float:
    return engine.train_batch(mbs) if api == "train_batch" else _ds_step(engine, mbs)


def _optimizer_threads() -> int:
    return sum(t.name == "zerofit-cpu-optimizer" and t.is_alive() for t in threading.enumerate())


class _Boom(RuntimeError):
    """The injected error."""


def _fire(fault: dict, phase: str, block: int | None = None) -> None:
    """Raise (or send SIGINT) when ``fault`` names this phase and block, after skipping ``fault['after']`` matches."""
    fault.setdefault("calls", []).append((phase, block))
    if fault.get("phase") != phase or fault.get("block") != block:
        return
    fault["seen"] = fault.get("seen", 0) + 1
    if fault["seen"] <= fault.get("after", 0):
        return
    fault["hits"] = fault.get("hits", 0) + 1
    if fault.get("sigint"):
        fault["phase"] = None  # once
        fault["signalled_at"] = len(fault["calls"])
        for _ in range(fault["sigint"]):
            signal.raise_signal(signal.SIGINT)
        return
    if fault.get("before") is not None:  # e.g. wait for the CPU worker to have applied an update
        fault["before"]()
    raise fault.get("exc", _Boom)(f"injected in the {phase} of block {block}")


class _FaultyBlock(tm.Block):
    def __init__(self, d: int, index: int, fault: dict):
        super().__init__(d)
        self.index, self.fault = index, fault

    def forward(self, x, scale: float = 1.0):
        # with activation checkpointing the forward runs without autograd and the backward recomputes with it
        _fire(self.fault, "backward" if torch.is_grad_enabled() else "forward", self.index)
        return super().forward(x, scale)


class _FaultyLM(tm.PlainLM):
    """tm.PlainLM whose blocks (and loss) fail on demand: set ``model.fault`` (phase, block, exc/sigint, after)."""

    def __init__(self, d: int = 24, n: int = 4):
        super().__init__(d, n)
        self.fault: dict = {}
        self.blocks = nn.ModuleList(_FaultyBlock(d, i, self.fault) for i in range(n))

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x, scale=0.5)
        _fire(self.fault, "loss")
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _faulty_pair(**cfg):
    torch.manual_seed(0)
    model = _FaultyLM()
    clean = copy.deepcopy(model)
    return model, zerofit.initialize(model, _cfg(**cfg)), clean


# ---------------------------------------------------------------------------------------------- errors in a step

_BEFORE_UPDATES = {
    "forward": (dict(phase="forward", block=1), 0.0, _Boom),
    "loss": (dict(phase="loss"), 0.0, _Boom),
    # the backward's first block (the last one): its update is not submitted yet
    "backward-first-block": (dict(phase="backward", block=3), 0.0, _Boom),
    # clipping without speculation defers every update until the whole gradient is known: nothing is applied
    # during the backward (with speculation, see test_error_after_speculative_updates_rolls_them_back)
    "backward-block0-clipping": (dict(phase="backward", block=0), 1.0, _Boom),
    "out-of-memory": (dict(phase="forward", block=2, exc=torch.OutOfMemoryError), 0.0, torch.OutOfMemoryError),
    "keyboard-interrupt": (dict(phase="backward", block=2, exc=KeyboardInterrupt), 1.0, KeyboardInterrupt),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case,api",
    [(c, "train_batch") for c in _BEFORE_UPDATES]
    + [(c, "deepspeed") for c in ("forward", "backward-block0-clipping", "keyboard-interrupt")],
)
def test_error_before_any_update_leaves_everything_as_before_and_the_engine_usable(case, api):
    """Weights and moments bitwise unchanged, the original error raised, and the run afterwards equals one
    that never saw the failed batch, bit for bit (so no transient state of the failed step survived)."""
    fault, clip, exc = _BEFORE_UPDATES[case]
    no_spec = {"speculative_updates": False}
    model, engine, clean_model = _faulty_pair(gradient_clipping=clip, offload=no_spec)
    data = tm.batches(3, G)
    _train(engine, data[0], api)
    before, params = _snapshot(engine), {n: p.clone() for n, p in engine.module.named_parameters()}

    model.fault.update(fault)
    with pytest.raises(exc) as err:
        _train(engine, data[1], api)
    assert model.fault.get("hits", 0) >= 1, "the fault never fired"
    model.fault.clear()

    assert engine.state is EngineState.OPEN and engine.global_step == 1
    assert not engine.is_gradient_accumulation_boundary()
    _assert_unchanged(before, _snapshot(engine))
    for n, p in engine.module.named_parameters():
        assert torch.equal(p, params[n]), f"module parameter {n} changed"
    assert any("was not applied" in note for note in getattr(err.value, "__notes__", [])), err.value

    _train(engine, data[2], api)
    clean = zerofit.initialize(clean_model, _cfg(gradient_clipping=clip, offload=no_spec))
    for mbs in (data[0], data[2]):
        _train(clean, mbs, api)
    _assert_same_masters(engine, clean)
    engine.close()
    clean.close()


@pytest.mark.timeout(60)
def test_error_after_speculative_updates_rolls_them_back():
    """[Note: speculative updates]: with clipping, blocks 3, 2, 1 are updated during the backward; an error in
    block 0's backward rolls them back (the inverse of the update: equal to fp32 rounding, not bitwise), the
    engine stays usable, and the run afterwards tracks one that never saw the failed batch."""
    model, engine, clean_model = _faulty_pair(gradient_clipping=1e3)
    data = tm.batches(3, G)
    engine.train_batch(data[0])
    before = _snapshot(engine)
    model.fault.update(phase="backward", block=0)
    with pytest.raises(_Boom):
        engine.train_batch(data[1])
    assert model.fault.get("hits", 0) >= 1, "the fault never fired"
    model.fault.clear()
    assert engine.state is EngineState.OPEN and engine.speculation_stats["rolled_back"] == 1
    after = _snapshot(engine)
    changed = 0
    for (name, *a), (_, *b) in zip(before, after, strict=True):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")
            changed += not torch.equal(x, y)
    assert changed, "nothing was updated speculatively: the test would not see a rollback"
    engine.train_batch(data[2])
    clean = zerofit.initialize(clean_model, _cfg(gradient_clipping=1e3))
    for mbs in (data[0], data[2]):
        clean.train_batch(mbs)
    a, b = engine.master_state_dict(), clean.master_state_dict()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-7)
    engine.close()
    clean.close()


@pytest.mark.timeout(60)
def test_deepspeed_error_in_a_later_micro_batch_drops_the_accumulation():
    """An error in micro-batch 2's forward drops micro-batch 1's gradients too (its post-pass gradients and its
    held block checkpoints: [Note: the block backward waits for the boundary]): the next forward starts a new
    accumulation, and the run equals one that skipped the whole step."""
    model, engine, clean_model = _faulty_pair()
    data = tm.batches(3, G)
    _ds_step(engine, data[0])
    before = _snapshot(engine)
    loss = loss_of(engine(**data[1][0]))
    engine.backward(loss)
    engine.step()  # before the boundary: a no-op
    assert len(engine.window.held) == 1
    model.fault.update(phase="forward", block=2)  # the second micro-batch's forward
    with pytest.raises(_Boom):
        engine(**data[1][1])
    assert model.fault["hits"] == 1 and not engine.window.held and engine.window.micro_steps == 0
    model.fault.clear()
    _assert_unchanged(before, _snapshot(engine))
    engine.step()  # nothing accumulated: a no-op
    assert engine.global_step == 1
    _ds_step(engine, data[2])
    clean = zerofit.initialize(clean_model, _cfg())
    for mbs in (data[0], data[2]):
        _ds_step(clean, mbs)
    _assert_same_masters(engine, clean)


@pytest.mark.timeout(60)
def test_error_after_updates_began_fails_the_engine():
    """Without clipping the CPU updates blocks during the backward: an error in block 0's backward comes after
    later blocks were updated. The engine fails, says so, releases everything and refuses every later call."""
    model, engine, _ = _faulty_pair()
    data = tm.batches(3, G)
    engine.train_batch(data[0])
    engine.wait()
    host = {u.name: u.master.clone() for u in engine.units if not u.optimizer_on_device}
    threads = _optimizer_threads()
    # the error comes once the worker has applied a later block's update (submitted during this backward), not
    # whenever the worker happens to get to it: otherwise a busy machine may fail before any update is applied
    later = [u for u in engine.units if u.name in host and u.name != "blocks.0" and u.index >= 0]
    model.fault.update(phase="backward", block=0, before=lambda: later[-1].updates.updated.wait(30))
    with pytest.raises(EngineFailedError, match="resume from the last checkpoint") as err:
        engine.train_batch(data[1])
    assert model.fault["hits"] >= 1 and isinstance(err.value.__cause__, _Boom)
    model.fault.clear()
    # why it must fail: the step is half applied
    changed = {u.name for u in engine.units if u.name in host and not torch.equal(u.master, host[u.name])}
    assert changed and "blocks.0" not in changed, changed

    assert engine.state is EngineState.FAILED
    assert _optimizer_threads() == threads - 1, "the CPU optimizer thread of a failed engine must stop"
    for call in (
        lambda: engine.train_batch(data[2]),
        lambda: engine(**data[2][0]),
        engine.wait,
        engine.master_state_dict,
        lambda: engine.module,
        engine.step,
        lambda: engine.backward(None),
    ):
        with pytest.raises(EngineFailedError, match="injected in the backward of block 0"):
            call()
    engine.close()  # a no-op on a failed engine
    assert engine.state is EngineState.FAILED


@pytest.mark.timeout(60)
def test_error_while_applying_the_device_updates_fails_the_engine(monkeypatch):
    """With clipping the updates run after the backward; one failing there leaves the step torn: FAILED."""
    real = optimizer_module.adamw_flat
    armed = {"on": False, "hits": 0}

    def adamw_flat(*args, **kw):
        if armed["on"] and threading.current_thread() is threading.main_thread():
            armed["hits"] += 1
            raise _Boom("injected in an update on the device")
        return real(*args, **kw)

    monkeypatch.setattr(optimizer_module, "adamw_flat", adamw_flat)
    _, engine, _ = _faulty_pair(gradient_clipping=1.0)
    data = tm.batches(2, G)
    engine.train_batch(data[0])
    armed["on"] = True
    with pytest.raises(EngineFailedError, match="not applied completely") as err:
        engine.train_batch(data[1])
    assert armed["hits"] >= 1 and isinstance(err.value.__cause__, _Boom)
    with pytest.raises(EngineFailedError):
        engine.train_batch(data[1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["updates-during-backward", "deferred-updates"])
def test_cpu_worker_failure_fails_the_engine_and_a_retry_does_not_hang(clip, monkeypatch):
    """A failing CPU update surfaces within the step or at the next call (deferred updates run after the step
    returned), as EngineFailedError; a retry raises at once instead of waiting for an update that never comes."""
    real = optimizer_module.adamw_flat
    armed = {"on": False, "hits": 0}

    def adamw_flat(*args, **kw):
        if armed["on"] and threading.current_thread().name == "zerofit-cpu-optimizer":
            armed["hits"] += 1
            raise _Boom("injected in the CPU optimizer")
        return real(*args, **kw)

    monkeypatch.setattr(optimizer_module, "adamw_flat", adamw_flat)
    _, engine, _ = _faulty_pair(gradient_clipping=clip)
    data = tm.batches(3, G)
    engine.train_batch(data[0])
    armed["on"] = True
    with pytest.raises(EngineFailedError) as err:
        for mbs in data[1:]:
            engine.train_batch(mbs)
    assert armed["hits"] >= 1
    assert isinstance(err.value.__cause__, WorkerError) and isinstance(err.value.__cause__.__cause__, _Boom)
    for _ in range(2):
        with pytest.raises(EngineFailedError, match="CPU optimizer"):
            engine.train_batch(data[1])
    assert engine.state is EngineState.FAILED and not engine.worker.alive


# ---------------------------------------------------------------------------------------------- bad batches

_IDS = torch.randint(0, tm.VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def _with(**fields) -> list[dict]:
    return [{"input_ids": _IDS, "labels": _IDS, **fields}]


_BAD = {
    "one-dict": ({"input_ids": _IDS, "labels": _IDS}, "list of micro-batches"),
    "empty-list": ([], "at least one micro-batch"),
    "not-a-dict": ([_IDS], "micro-batch 0 is a Tensor"),
    "float-ids": (_with(input_ids=_IDS.float()), r"micro-batch 0\['input_ids'\] has dtype torch.float32"),
    "1d-ids": ([{"input_ids": _IDS[0], "labels": _IDS[0]}], r"has shape \(16,\); expected \(batch, seq\)"),
    "labels-shape": (_with(labels=_IDS[:, :8]), "labels must have input_ids' shape"),
    "token-id-too-large": (_with(input_ids=_IDS.clone().fill_(tm.VOCAB)), f"holds {tm.VOCAB}: token ids"),
    "negative-label": (_with(labels=_IDS.clone().fill_(-1)), "holds -1: labels must be token ids"),
    "mask-shape": (_with(attention_mask=torch.ones(2, 8)), r"attention_mask'\] has shape \(2, 8\)"),
    "meta-tensor": (_with(input_ids=torch.empty(2, 16, dtype=torch.long, device="meta")), "is on meta"),
    "unknown-key": (_with(pixel_values=torch.ones(2, 3)), None),  # plain model only: HF models take **kwargs
}


@pytest.mark.parametrize("family", ["hf", "plain"])
@pytest.mark.parametrize("case", list(_BAD))
def test_bad_batches_are_refused_before_anything_runs(case, family):
    batch, match = _BAD[case]
    if family == "hf" and case == "unknown-key":
        pytest.skip("Hugging Face models take **kwargs: no unknown key")
    if family == "plain" and case in ("token-id-too-large", "negative-label", "mask-shape"):
        pytest.skip("a model without a known vocab (range) or an attention_mask parameter (unknown key instead)")
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama() if family == "hf" else tm.PlainLM(), _cfg())
    before = _snapshot(engine)
    with pytest.raises(BatchError, match=match or "does not take"):
        engine.train_batch(batch)
    _assert_unchanged(before, _snapshot(engine))
    padded = _IDS.clone()
    padded[:, :4] = -100  # ignored labels are fine
    assert math.isfinite(engine.train_batch([{"input_ids": _IDS, "labels": padded}] * G))
    assert engine.global_step == 1
    engine.close()


def test_bad_batch_in_the_middle_of_an_accumulation_keeps_it():
    """A refused micro-batch changes nothing: the accumulation in progress goes on and gives the same step."""
    torch.manual_seed(0)
    model = tm.llama()
    clean_model = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg())
    mbs = tm.batches(1, G)[0]
    engine.backward(engine(**mbs[0]).loss)
    engine.step()
    with pytest.raises(BatchError, match="labels must have"):
        engine(input_ids=_IDS, labels=_IDS[:, :3])
    engine.backward(engine(**mbs[1]).loss)
    engine.step()
    assert engine.global_step == 1
    clean = zerofit.initialize(clean_model, _cfg())
    _ds_step(clean, mbs)
    _assert_same_masters(engine, clean)


# ---------------------------------------------------------------------------------------------- evaluation


@pytest.mark.parametrize("how,clip", [("eval-mode", 1.0), ("no-grad", 0.0)], ids=["eval-mode-clip", "no-grad"])
def test_eval_forwards_match_the_plain_model_and_keep_no_state(how, clip):
    """engine.eval() or torch.no_grad(): the model's output with its loss, as often as wanted, between steps
    (with clipping: while updates of the last step are still pending); training afterwards is unchanged. In eval
    mode with autograd on the loss can be backpropagated, as DeepSpeed's ([Note: a forward records for backward
    as autograd says]): an unused one is dropped by the next forward or step."""
    torch.manual_seed(0)
    model = tm.llama()
    initial = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(gradient_clipping=clip))
    data = tm.batches(3, G)
    held = tm.batches(1, 3, seed=7)[0]

    def engine_loss(mb) -> torch.Tensor:
        if how == "eval-mode":
            engine.eval()
            out = engine(**mb)
            engine.train()
        else:
            with torch.no_grad():
                out = engine(**mb)
        assert out.loss.requires_grad == (how == "eval-mode")
        return out.loss.detach()

    losses = [engine.train_batch(data[0])]
    after_one = copy.deepcopy(initial)
    tm.reference_train(after_one, data[:1], clip=clip)
    after_one.eval()
    with torch.no_grad():
        expected = torch.stack([after_one(**mb).loss for mb in held])
    for _ in range(2):
        torch.testing.assert_close(torch.stack([engine_loss(mb) for mb in held]), expected)
    assert engine.global_step == 1 and engine.state is EngineState.OPEN
    losses += [engine.train_batch(mbs) for mbs in data[1:]]  # no forward is pending: train_batch works
    ref = copy.deepcopy(initial)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(tm.reference_train(ref, data, clip=clip)))
    tm.assert_masters(engine, ref)
    engine.close()


def test_eval_forward_in_the_middle_of_an_accumulation():
    torch.manual_seed(0)
    model = tm.llama()
    clean_model = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(gradient_clipping=1.0))
    data = tm.batches(2, G)
    _ds_step(engine, data[0])
    engine.backward(engine(**data[1][0]).loss)
    engine.step()
    with torch.no_grad():
        a, b = engine(**data[0][0]).loss, engine(**data[0][0]).loss
    assert torch.equal(a, b)
    engine.backward(engine(**data[1][1]).loss)
    engine.step()
    assert engine.global_step == 2
    clean = zerofit.initialize(clean_model, _cfg(gradient_clipping=1.0))
    for mbs in data:
        _ds_step(clean, mbs)
    _assert_same_masters(engine, clean)


# ---------------------------------------------------------------------------------------------- generic fallback


class _SkipLM(tm.PlainLM):
    """A residual *around* each block (block i+1 gets block i's output plus its input); dropout after the
    embedding, so that the RNG the aborted first forward consumed shows if it is not given back."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)

    def forward(self, input_ids, labels=None):
        x = self.drop(self.embed(input_ids))
        for b in self.blocks:
            x = b(x) + x
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize(
    "make,api",
    [
        (lambda: _SkipLM(dropout=0.1), "train_batch"),
        (lambda: _SkipLM(dropout=0.1), "deepspeed"),
        (tm.LoopedLM, "train_batch"),
        (tm.EarlyExitLM, "train_batch"),
    ],
    ids=["skip-connection-dropout", "skip-connection-dropout-deepspeed", "looped", "early-exit"],
)
def test_non_sequential_model_falls_back_to_the_generic_path_and_trains_exactly(make, api, caplog):
    """No weight decay: the early-exit model's last block gets no gradient, which torch.optim.AdamW skips and
    zerofit treats as a zero gradient (equal only without decay)."""
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(optimizer={"lr": 3e-3, "weight_decay": 0.0}))
    assert engine.adapter.streaming  # it cannot tell before the first forward
    data = tm.batches(3, G)
    torch.manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="zerofit"):
        losses = [_train(engine, mbs, api) for mbs in data]
    assert "trains on the generic path" in caplog.text
    assert not engine.adapter.streaming and len(engine.units) == 1
    torch.manual_seed(1)
    ref_losses = tm.reference_train(ref, data, lr=3e-3, wd=0.0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    master = engine.master_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach(), msg=lambda m, n=n: f"{n}: {m}")
    engine.close()


def test_fallback_on_a_first_eval_forward():
    torch.manual_seed(0)
    model = _SkipLM()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg())
    mb = tm.batches(1, 1)[0][0]
    engine.eval()
    loss = engine(**mb)
    engine.train()
    assert not engine.adapter.streaming
    with torch.no_grad():
        torch.testing.assert_close(loss, ref.eval()(**mb))
    assert math.isfinite(engine.train_batch(tm.batches(1, G)[0]))


# ---------------------------------------------------------------------------------------------- close and release


def test_close_applies_pending_updates_releases_and_refuses_later_calls():
    threads = _optimizer_threads()
    torch.manual_seed(0)
    model = _FaultyLM()
    clean_model = copy.deepcopy(model)
    data = tm.batches(2, G)
    with zerofit.initialize(model, _cfg(gradient_clipping=1.0)) as engine:  # updates still pending at the end
        assert _optimizer_threads() == threads + 1
        for mbs in data:
            engine.train_batch(mbs)
    assert engine.state is EngineState.CLOSED and _optimizer_threads() == threads
    for call in (
        lambda: engine.train_batch(data[0]),
        lambda: engine(**data[0][0]),
        engine.step,
        engine.wait,
        engine.master_state_dict,
        lambda: engine.backward(None),
    ):
        with pytest.raises(EngineClosedError, match=r"zerofit.initialize") as err:
            call()
        assert not isinstance(err.value, EngineFailedError)
    engine.close()  # idempotent
    clean = zerofit.initialize(clean_model, _cfg(gradient_clipping=1.0))
    for mbs in data:
        clean.train_batch(mbs)
    expected = clean.master_state_dict()
    closed = dict(engine.module.named_parameters())  # still readable: the final weights
    for n, v in expected.items():
        assert torch.equal(closed[n], v), f"{n}: close() did not leave the final weights in the module"
    clean.close()


def test_context_manager_closes_on_error_and_keeps_the_error():
    threads = _optimizer_threads()
    torch.manual_seed(0)
    with pytest.raises(ZeroDivisionError):
        with zerofit.initialize(tm.llama(), _cfg()) as engine:
            engine.train_batch(tm.batches(1, G)[0])
            _ = 1 / 0
    assert engine.state is EngineState.CLOSED and _optimizer_threads() == threads


def test_an_engine_no_one_holds_is_freed_at_once_without_the_garbage_collector():
    """No part holds the engine (they take what they need, and the end of a step through a weak reference: [Note:
    the parts as a value], parts.py), so the last reference's going frees it: no cycle waits for a collection."""
    import weakref

    gc.disable()
    try:
        torch.manual_seed(0)
        engine = zerofit.initialize(tm.llama(), _cfg(gradient_clipping=1.0))
        engine.train_batch(tm.batches(1, G)[0])
        ref = weakref.ref(engine)
        del engine
        assert ref() is None
    finally:
        gc.enable()


def test_an_engine_never_closed_is_released_when_collected():
    # engines of earlier tests that sit in reference cycles go first, so the baseline stays put
    gc.collect()
    threads = _optimizer_threads()
    for _ in range(100):
        threading.Event().wait(0.05)
        if _optimizer_threads() == threads:
            break
        threads = _optimizer_threads()
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(), _cfg(gradient_clipping=1.0))
    engine.train_batch(tm.batches(1, G)[0])
    assert _optimizer_threads() == threads + 1
    del engine
    gc.collect()  # the last reference may also go on the worker thread, with its last task
    for _ in range(100):
        if _optimizer_threads() == threads:
            break
        threading.Event().wait(0.05)
    assert _optimizer_threads() == threads, "weakref.finalize did not stop the CPU optimizer thread"


# ---------------------------------------------------------------------------------------------- placement report


def test_placement_warnings_say_where_the_optimizer_state_really_is():
    from zerofit.engine.plan.search import BatchShape, ModelShape, make_plan, placement_warnings

    shape = ModelShape(50_000_000, (100_000_000,) * 8, 2048, 8192, 32000)
    kw = dict(
        compute_dtype=torch.bfloat16,
        on_cuda=True,
        device_budget=None,
        host_budget=None,
        deferred_updates=False,
        checkpointing=True,
        prefetch_depth=None,
    )
    all_gpu = make_plan(shape, BatchShape(1, 1024, 1), resident_blocks=None, stream_params=False, **kw)
    assert all_gpu.optimizer_homes(8) == "optimizer state: shell on the GPU; blocks 0-7 on the GPU"
    [w] = placement_warnings(all_gpu, 8, optimizer_device="cpu", param_device="none", on_cuda=True)
    assert "keeps all optimizer state on the GPU" in w and "param_device" in w, w
    [w] = placement_warnings(all_gpu, 8, optimizer_device="none", param_device="cpu", on_cuda=True)
    assert "optimizer_device is 'none'" in w, w
    split = make_plan(shape, BatchShape(1, 1024, 1), resident_blocks=3, stream_params=True, shell_on_device=False, **kw)
    assert split.optimizer_homes(8) == (
        "optimizer state: shell in host memory (CPU AdamW); blocks 0-2 on the GPU; "
        "blocks 3-7 in host memory (CPU AdamW)"
    )
    assert placement_warnings(split, 8, optimizer_device="cpu", param_device="cpu", on_cuda=True) == []
    [w] = placement_warnings(split, 8, optimizer_device="nvme", param_device="cpu", on_cuda=True)
    assert "the disk is not used" in w and "host memory holds all the optimizer state" in w, w
    assert placement_warnings(all_gpu, 8, optimizer_device="cpu", param_device="none", on_cuda=False) == []


def test_initialize_logs_the_placement_and_says_when_nvme_is_not_needed(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="zerofit"):
        engine = zerofit.initialize(
            tm.PlainLM(), _cfg(offload={"optimizer_device": "nvme", "nvme_path": str(tmp_path)})
        )
    assert "optimizer state: shell on the device (cpu); blocks 0-3 in host memory (CPU AdamW)" in caplog.text
    assert any(r.levelno == logging.WARNING and "the disk is not used" in r.getMessage() for r in caplog.records)
    assert not any(tmp_path.iterdir()), "nothing is written to nvme_path when host memory holds everything"
    engine.close()


# ---------------------------------------------------------------------------------------------- Ctrl-C


@pytest.fixture
def default_sigint():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT does not have Python's default handler here")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("api", ["train_batch", "deepspeed"])
def test_ctrl_c_before_any_update_stops_at_the_next_block_with_nothing_applied(api, default_sigint):
    model, engine, clean_model = _faulty_pair(gradient_clipping=1.0)
    data = tm.batches(3, G)
    _train(engine, data[0], api)
    before = _snapshot(engine)
    model.fault.update(phase="forward", block=1, sigint=1)
    with pytest.raises(KeyboardInterrupt):
        _train(engine, data[1], api)
    assert model.fault["hits"] == 1
    after_signal = model.fault["calls"][model.fault["signalled_at"] :]
    assert ("forward", 2) not in after_signal, "the step went on past the next block boundary"
    model.fault.clear()
    assert engine.state is EngineState.OPEN
    _assert_unchanged(before, _snapshot(engine))
    _train(engine, data[2], api)
    clean = zerofit.initialize(clean_model, _cfg(gradient_clipping=1.0))
    for mbs in (data[0], data[2]):
        _train(clean, mbs, api)
    _assert_same_masters(engine, clean)


@pytest.mark.timeout(60)
def test_ctrl_c_after_updates_began_finishes_the_step_then_stops(default_sigint):
    """The step's updates had begun (block 0's backward, without clipping): it runs to its end, then
    KeyboardInterrupt; the state is that of the full step."""
    model, engine, clean_model = _faulty_pair()
    data = tm.batches(2, G)
    engine.train_batch(data[0])
    model.fault.update(phase="backward", block=0, sigint=1)
    with pytest.raises(KeyboardInterrupt, match="finished the step"):
        engine.train_batch(data[1])
    assert model.fault["hits"] == 1
    assert engine.state is EngineState.OPEN and engine.global_step == 2
    clean = zerofit.initialize(clean_model, _cfg())
    for mbs in data:
        clean.train_batch(mbs)
    _assert_same_masters(engine, clean)


@pytest.mark.timeout(60)
def test_second_ctrl_c_stops_at_once(default_sigint):
    model, engine, _ = _faulty_pair()
    data = tm.batches(2, G)
    engine.train_batch(data[0])
    model.fault.update(phase="backward", block=0, sigint=2)
    with pytest.raises(KeyboardInterrupt, match="second Ctrl-C") as err:
        engine.train_batch(data[1])
    assert engine.state is EngineState.FAILED  # its updates had begun
    assert any("resume from the last checkpoint" in n for n in getattr(err.value, "__notes__", []))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ---------------------------------------------------------------------------------------------- exit status


@pytest.fixture(scope="module")
def exits():
    return lifecycle_script.run_all("cpu", modes=("return", "raise-forward", "sigint"))


def _no_abort(outcome) -> None:
    assert "terminate called" not in outcome.stderr, outcome.stderr[-2000:]
    assert outcome.returncode not in (134, -signal.SIGABRT), outcome.stderr[-2000:]


def test_script_that_trains_then_returns_exits_0(exits):
    """The CPU worker is still applying the last step's updates when the script returns."""
    o = exits["return"]
    _no_abort(o)
    assert o.returncode == 0 and "trained" in o.stdout, o.stderr[-2000:]


def test_script_whose_step_raised_exits_1(exits):
    """The error comes while the CPU worker is still applying the previous step's updates (on the GPU,
    test_gpu.py also runs the script whose step fails the engine)."""
    o = exits["raise-forward"]
    _no_abort(o)
    assert o.returncode == 1 and "was not applied" in o.stderr, (o.returncode, o.stderr[-2000:])


def test_script_interrupted_by_sigint_stops_promptly(exits):
    o = exits["sigint"]
    _no_abort(o)
    assert "training" in o.stdout, o.stderr[-2000:]
    assert o.returncode != 0 and "KeyboardInterrupt" in o.stderr, (o.returncode, o.stderr[-2000:])
    assert o.seconds_after_sigint is not None and o.seconds_after_sigint < 30, o.seconds_after_sigint


def test_the_engine_keeps_none_of_the_users_original_weights():
    """The module's parameters become views of the units' buffers (the same parameter objects: [Note: the model's
    parameter objects]); the engine holds no reference to the storage they had (a real model's weights would be
    held twice in host memory)."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    model = tm.llama()
    params = list(model.parameters())
    originals = [StorageWeakRef(p.untyped_storage()) for p in params]
    engine = zerofit.initialize(model, _cfg())
    gc.collect()
    assert sum(not r.expired() for r in originals) == 0
    assert [id(p) for p in engine.module.parameters()] == [id(p) for p in params]
    engine.close()
