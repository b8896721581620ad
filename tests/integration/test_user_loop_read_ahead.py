"""[Note: the loop's loader reads the window ahead] (src/zerofit/userloop/loop.py): a user's loop that draws its
micro-batches from a DataLoader has each window's forwards made at once, block-major, so a step uploads each
streamed block twice (train_batch's count) instead of once per micro-batch and once more; the losses and weights
are bitwise those of the same loop drawing the same batches from a list, and a loop that edits a batch before its
forward gets the numbers of its edited batch."""

from __future__ import annotations

import collections
import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zerofit.fsdp import CPUOffload
from zerofit.fsdp import FullyShardedDataParallel as FSDP
from zerofit.userloop.live import loop_of

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

G, STEPS, LAYERS, VOCAB = 4, 3, 8, 256


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _run(source: str, window: int | None = G, edit: bool = False, as_tuples: bool = False, door: str = "torch") -> dict:
    """The tutorial's loop over ``STEPS`` steps of ``G`` micro-batches, clipped at 1.0, from a DataLoader
    (``source`` "loader") or a list of the same batches ("list"), under a device budget that streams most
    blocks. ``window``: zerofit_config's gradient_accumulation_steps (None: learnt from the first step);
    ``edit``: the loop changes the second micro-batch of each step in place before its forward; ``door``: the
    loop as plain torch, accelerate's (its prepared loader fetches one batch ahead) or Fabric's writes it."""
    torch.manual_seed(0)
    cfg = {"max_gpu_memory": 3 << 20, "seq_len": 32, "micro_batch_size": 2}
    if window:
        cfg["gradient_accumulation_steps"] = window
    wrapped = model = FSDP(_model(), cpu_offload=CPUOffload(offload_params=True), zerofit_config=cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    collate = (lambda b: tuple(_stack(b).values())) if as_tuples else None
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2, collate_fn=collate)
    if door == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(gradient_accumulation_steps=G, cpu=True)
        model, opt, loader = acc.prepare(model, opt, loader)
    elif door == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1)
        model, opt = fabric.setup(model, opt)
        loader = fabric.setup_dataloaders(loader)
    it = iter(loader) if source == "loader" else iter(list(loader))
    eng = loop_of(list(wrapped.parameters())).engine
    out: dict = {"losses": [], "uploads": [], "seen": []}
    for _ in range(STEPS):
        for i in range(G):
            b = next(it)
            if as_tuples:
                b = {"input_ids": b[0], "labels": b[1]}
            if edit and i == 1:
                b["input_ids"][:, 0] = 7
            out["seen"].append(b["input_ids"].clone())
            loss = model(**b).loss
            out["losses"].append(loss.item())
            if door == "accelerate":
                with acc.accumulate(model):  # its backward divides by G; its step waits for the boundary
                    acc.backward(loss)
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
                continue
            if door == "fabric":
                fabric.backward(loss / G)
            else:
                (loss / G).backward()
        if door == "fabric":
            fabric.clip_gradients(model, opt, max_norm=1.0)
        elif door == "torch":
            wrapped.clip_grad_norm_(1.0)
        if door != "accelerate":
            opt.step()
            opt.zero_grad()
        counts = collections.Counter(iv["label"] for iv in eng.trace() if iv["lane"] == "upload")
        out["uploads"].append(counts)
    out["weights"] = {k: v.clone() for k, v in wrapped.state_dict().items()}
    out["stats"] = dict(eng.window.stats)
    eng.close()
    del model, wrapped, opt, eng, loader, it
    gc.collect()  # one wrapped model alive at a time: two would offer no read-ahead
    return out


def _model():
    """A Llama large enough beside the budget that most of its blocks stream (untied: docs/fsdp.md)."""
    c = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4
    )
    return LlamaForCausalLM(c)


def _stack(items):
    return {k: torch.stack([x[k] for x in items]) for k in items[0]}


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k


@pytest.mark.parametrize("window", [G, None], ids=["named-window", "learnt-window"])
def test_a_loaders_window_streams_each_block_twice_a_step_and_is_bitwise_the_lists(window):
    plain, ahead = _run("list", window), _run("loader", window)
    _same(ahead, plain)
    assert [torch.equal(x, y) for x, y in zip(ahead["seen"], plain["seen"])] == [True] * (G * STEPS)
    # the blocks that streamed (an assisted block's state chunks go up as "NAME+adamw": not its weights)
    streamed = sorted(n for n in plain["uploads"][-1] if "+" not in n and n.startswith("model.layers."))
    assert len(streamed) >= LAYERS - 2, plain["uploads"][-1]  # the budget streams most blocks
    offered_steps = STEPS if window else STEPS - 1  # a learnt window knows G from the second step
    assert ahead["stats"] == {"announced": offered_steps, "mismatched": 0}
    # without it, each micro-batch's forward uploads a streamed block, and the step's backward once more
    assert max(plain["uploads"][-1][n] for n in streamed) == G + 1, plain["uploads"][-1]
    assert max(ahead["uploads"][-1][n] for n in streamed) <= 2, ahead["uploads"][-1]


def test_a_batch_edited_before_its_forward_drops_the_window_and_keeps_the_edited_numbers():
    plain, ahead = _run("list", edit=True), _run("loader", edit=True)
    _same(ahead, plain)
    # the first window's second forward found other inputs than read ahead: no offer after it
    assert ahead["stats"] == {"announced": 1, "mismatched": 1}


def test_batches_that_are_not_mappings_are_not_offered():
    plain, ahead = _run("list", as_tuples=True), _run("loader", as_tuples=True)
    _same(ahead, plain)
    assert ahead["stats"] == {"announced": 0, "mismatched": 0}


@pytest.mark.parametrize("door", ["accelerate", "fabric"])
def test_accelerates_and_fabrics_loaders_read_ahead_too(door):
    pytest.importorskip("accelerate" if door == "accelerate" else "lightning")
    plain, ahead = _run("list"), _run("loader", door=door)
    _same(ahead, plain)
    assert ahead["stats"] == {"announced": STEPS, "mismatched": 0}
    streamed = sorted(n for n in plain["uploads"][-1] if "+" not in n and n.startswith("model.layers."))
    assert max(ahead["uploads"][-1][n] for n in streamed) <= 2, ahead["uploads"][-1]
