"""What a person sees: counts, the CPU plan, the tokenizer's warning, a tiny held-out set,
the first step's progress line, and `zerofit chat`'s commands; each through the real CLI where the CLI prints it."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from tests.support.model_dirs import make_model_dir, write_data
from tests.support.tiny_tokenizer import build_tokenizer
from zerofit.cli import app

ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("ux")
    return root, make_model_dir(root / "model", "llama", torch.float32), write_data(root / "data")


def test_counts_read_as_counts():
    from zerofit.engine.plan.search import fmt_count

    assert [fmt_count(n) for n in (37, 1_000, 203_456, 3_030_000, 3_212_000_000, 13_016_000_000)] == [
        "37",
        "1 K",
        "203 K",
        "3.03 M",
        "3.21 B",
        "13 B",
    ]


def test_a_cpu_run_says_what_is_true_on_the_cpu(workspace):
    """One `zerofit train` run on the CPU, its terminal text: the parameter count, the CPU plan, the warning
    about a tiny held-out set, and the progress line during step 1 (rendered as on a terminal)."""
    root, model, data = workspace
    args = [
        "train",
        "--model",
        str(model),
        "--data",
        *map(str, data),
        "--output",
        str(root / "run"),
        "--device",
        "cpu",
        "--seq-len",
        "64",
        "--steps",
        "1",
        "--eval-size",
        "1",
        "--no-save-at-end",
        "--no-export",
    ]
    r = CliRunner().invoke(app, args, env={"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    out = " ".join(ANSI.sub("", r.output).split())
    params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(model).parameters())
    from zerofit.engine.plan.search import fmt_count

    assert f"({fmt_count(params)} parameters)" in out and "K parameters" in out and "0.00 B" not in out, out
    assert "plan: on the CPU (no GPU: no GPU memory cap, nothing streams over PCIe)" in out, out
    assert "device 0 B" not in out and "pinned" not in out and "resident blocks (device optimizer)" not in out
    assert "warning: the held-out set has only" in out and "--eval-size" in out, out
    assert out.count("warning: the held-out set") == 1
    assert "step 1: torch's CPU kernels warm up" in out, out  # the progress line while step 1 runs


def test_the_plan_on_a_gpu_still_names_the_device():
    from zerofit.engine.plan.search import BatchShape, ModelShape, make_plan

    shape = ModelShape(10_000, (5_000,) * 4, 32, 64, 97)
    kw = dict(
        compute_dtype=torch.bfloat16,
        device_budget=None,
        host_budget=None,
        deferred_updates=True,
        checkpointing=True,
        stream_params=True,
        resident_blocks=1,
        prefetch_depth=None,
    )
    gpu = make_plan(shape, BatchShape(1, 16, 1), on_cuda=True, **kw)
    cpu = make_plan(shape, BatchShape(1, 16, 1), on_cuda=False, **kw)
    assert not gpu.on_cpu and "  device " in gpu.describe() and "pinned gradient buffers" in gpu.describe()
    text = cpu.describe()
    assert cpu.on_cpu and "  device " not in text and "1 blocks kept whole, the others stream" in text, text
    assert "compute shell" in text and "device:" not in text


def test_whole_documents_tokenize_without_the_too_long_warning(tmp_path, caplog):
    """Packing cuts windows itself, so transformers' warning about sequences longer than model_max_length is
    noise there; it still shows where someone else tokenizes a long text."""
    import logging

    from zerofit.data import build_datasets

    caplog.set_level(logging.WARNING, logger="transformers")
    tok = build_tokenizer()
    tok.model_max_length = 16
    f = tmp_path / "long.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    data = build_datasets([f], tok, seq_len=8)
    assert len(data.train) > 10
    assert "Token indices sequence length" not in caplog.text
    tok("The quick brown fox jumps over the lazy dog. " * 40)  # the same text, tokenized by anyone else
    assert "Token indices sequence length" in caplog.text


def test_small_held_out_sets_are_named_and_large_ones_are_not():
    import numpy as np

    from zerofit.data import pack, scored_tokens, small_held_out
    from zerofit.data.encode import Document

    def doc(n):
        return Document(np.arange(n, dtype=np.int32) % 50, np.ones(n, dtype=bool), "text", "x")

    tiny = pack([doc(20)], 64, 0)
    assert scored_tokens(tiny) == 19
    msg = small_held_out(tiny)
    assert msg is not None and "only 19 tokens with a loss (1 document)" in msg and "--eval-size" in msg
    big = pack([doc(100), doc(100)], 64, 0)
    assert small_held_out(big) is None
    cut = small_held_out(big, max_windows=1)  # --eval-windows 1: 63 scored tokens, under one window
    assert scored_tokens(big, 1) == 63 and cut is not None and "--eval-windows" in cut


def test_chat_loads_visibly_hints_and_handles_its_commands(tmp_path):
    d = make_model_dir(tmp_path / "m", "llama", layers=2)
    lines = ["/help", "Hello", "/reset", "/nope", "Hi again", "", "/quit", "never sent"]
    r = CliRunner().invoke(
        app, ["chat", "--model", str(d), "--max-new-tokens", "3", "--device", "cpu"], input="\n".join(lines) + "\n"
    )
    assert r.exit_code == 0, r.output
    out = r.output
    assert out.index(f"loading {d}") < out.index("loaded in") < out.index("/quit, /exit or Ctrl-D ends the chat")
    assert "/reset" in out and "start the conversation over" in out  # /help answered locally
    assert "(the conversation starts over)" in out
    assert "unknown command /nope" in out
    assert out.count("model> ") == 2  # two messages reached the model: not /help, /reset, /nope, nor after /quit


def test_chat_session_state():
    from zerofit.infer.chat import Chat, run_chat

    seen = []

    def answer(messages, stream):
        seen.append([m["content"] for m in messages])
        stream("ok")
        return "ok"

    def read(lines):
        feed = iter(lines)

        def next_line(prompt):
            try:
                return next(feed)
            except StopIteration:
                raise EOFError from None

        return next_line

    chat = Chat(system="Be brief.")
    printed = []
    run_chat(chat, answer, read(["first", "/reset", "//slash", "  ", "second"]), printed.append)
    assert seen == [["Be brief.", "first"], ["Be brief.", "/slash"], ["Be brief.", "/slash", "ok", "second"]]
    assert chat.turns == 2 and "(the conversation starts over)\n" in printed
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "Be brief."}] and Chat().messages == []


def test_the_deepspeed_doors_refusals_say_how_several_gpus_train(monkeypatch):
    import zerofit.deepspeed as zds
    from tests.support import tiny_models as tm
    from zerofit.engine.faces.deepspeed_names import DeepSpeedUnsupported

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zds.initialize(model=tm.llama(), model_parameters=None, config=config)
    with pytest.raises(DeepSpeedUnsupported) as err:
        engine.no_sync()
    with pytest.raises(DeepSpeedUnsupported) as comm:
        engine.allreduce_gradients()
    engine.close()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DeepSpeedUnsupported) as launch:
        zds.initialize(model=tm.llama(), config=config)
    for e in (err, comm, launch):
        text = str(e.value)
        assert "not available yet" not in text and "zerofit.deepspeed runs one process" in text, text
        assert "torchrun --nproc-per-node N" in text and "zerofit train --gpus N" in text, text
    assert "WORLD_SIZE=2" in str(launch.value)


def test_estimate_on_the_cpu_speaks_of_the_cpu(workspace):
    _, model, _ = workspace
    r = CliRunner().invoke(app, ["estimate", "--model", str(model), "--cpu", "--no-measure", "--seq-len", "64"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert " K parameters" in out and "0.00 B" not in out, out
    assert "plan: on the CPU" in out and "GPU peak" not in out and "device 0 B" not in out, out


def test_a_first_micro_batch_larger_than_the_one_placed_for_names_the_batch_to_give():
    """A user's loop shows the engine its batch only at the first forward; where that batch does not fit the
    placement made at start-up (resident blocks kept), the refusal names the batch to give at start-up, not a
    GPU cap the kept placement cannot use (found on the H200, W7 at 24 GiB: micro-batches of 2 x 2048 tokens
    against a placement made for 1 x 2048)."""
    from zerofit.config.schema import ZerofitConfig
    from zerofit.engine.plan import engine_plan as planning
    from zerofit.engine.plan.search import BatchShape, ModelShape, PlanError, make_plan

    config = ZerofitConfig()
    shape = ModelShape(10_000, (5_000,) * 4, 32, 64, 97)
    args = planning.plan_args(config, torch.bfloat16, True, planning.needs_norm(config)) | dict(
        host_budget=None, resident_blocks=None
    )
    tight = make_plan(shape, BatchShape(1, 16, 1), **args, device_budget=None).device_total
    p = object.__new__(planning.Planning)  # Planning's own start-up asks the GPU for its budget
    p.config, p.shape, p.on_cuda, p.plan_batch = config, shape, True, BatchShape(1, 16, 1)
    p.plan = make_plan(shape, p.plan_batch, **args, device_budget=tight)
    p.batch_plan, p.checked_shape, p.host16, p.held = None, None, False, 1
    p.ensure([{"input_ids": torch.zeros(1, 16, dtype=torch.long)}])  # the batch placed for fits
    kept = p.batch_plan
    with pytest.raises(PlanError) as e:
        p.ensure([{"input_ids": torch.zeros(8, 512, dtype=torch.long)}])
    text = str(e.value)
    assert (
        "this micro-batch (8 x 512 tokens) does not fit the placement made at start-up for micro-batches "
        "of 1 x 16 tokens" in text
    ), text
    assert "micro_batch_size: 8, seq_len: 512" in text and "no placement fits" in text, text
    assert p.batch_plan is kept and p.checked_shape == (1, 16) and p.plan_batch == BatchShape(1, 16, 1)
