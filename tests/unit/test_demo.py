"""The embedded demo: tokenizer, corpus, model, configuration, and a short training run through the engine."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from zerofit.config import ConfigError
from zerofit.demo.corpus import load_corpus, micro_batches, random_windows, stdlib_sources
from zerofit.demo.model import build_model, eval_loss, sample
from zerofit.demo.run import DemoOptions, resolve_config, run_demo
from zerofit.demo.tokenizer import ByteTokenizer

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
CPU = torch.device("cpu")


# ---------------------------------------------------------------- tokenizer


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_bytes_are_tokens():
    tok = ByteTokenizer()
    assert tok.vocab_size == 258
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.decode(torch.tensor([104, 105, tok.eos_id])) == "hi"


# ---------------------------------------------------------------- corpus


def test_corpus_is_python_source_and_deterministic():
    a, b = load_corpus(max_bytes=256 << 10), load_corpus(max_bytes=256 << 10)
    assert a.files > 0 and len(a) == 256 << 10
    assert torch.equal(a.train, b.train) and torch.equal(a.eval, b.eval)
    assert a.eval.numel() == int(len(a) * 0.05)
    text = bytes(a.train[:100_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    names = [p.name for p in stdlib_sources()]
    assert names == sorted(names) and "os.py" in names


def test_corpus_without_sources_says_so(tmp_path):
    with pytest.raises(RuntimeError, match="standard library sources"):
        load_corpus(root=tmp_path)


def test_windows_are_seeded_slices_of_the_text():
    data = torch.arange(1000) % 256
    data = data.to(torch.uint8)
    b1 = random_windows(data, 4, 16, torch.Generator().manual_seed(3))
    b2 = random_windows(data, 4, 16, torch.Generator().manual_seed(3))
    assert b1["input_ids"].shape == (4, 16) and b1["input_ids"].dtype == torch.long
    assert torch.equal(b1["input_ids"], b2["input_ids"]) and torch.equal(b1["labels"], b1["input_ids"])
    row = b1["input_ids"][0]
    assert bool(((row[1:] - row[:-1]) % 256 == 1).all())  # a contiguous slice of the text
    steps = micro_batches(data, 2, 8, grad_accum=3, seed=0)
    step = next(steps)
    assert len(step) == 3 and all(mb["input_ids"].shape == (2, 8) for mb in step)
    with pytest.raises(ValueError, match="seq_len"):
        random_windows(data, 1, 1000, torch.Generator())


# ---------------------------------------------------------------- model


def test_model_is_a_tiny_llama_built_from_a_seed():
    a, b = build_model(seed=1), build_model(seed=1)
    n = sum(p.numel() for p in a.parameters())
    assert 2_000_000 < n < 6_000_000
    assert a.config.model_type == "llama" and a.config.num_key_value_heads == 2
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.lm_head.weight, build_model(seed=2).lm_head.weight)


def test_sample_and_eval_loss_on_an_untrained_model():
    model, tok = build_model(max_seq_len=64), ByteTokenizer()
    s1 = sample(model, tok, "def ", max_new_tokens=10, seed=0)
    s2 = sample(model, tok, "def ", max_new_tokens=10, seed=0)
    assert s1 == s2 and s1.startswith("def ")
    assert sample(model, tok, "x", max_new_tokens=0) == "x"
    batch = random_windows(load_corpus(max_bytes=64 << 10).eval, 2, 32, torch.Generator().manual_seed(0))
    loss = eval_loss(model, [batch])
    assert abs(loss - math.log(258)) < 0.5  # untrained: about uniform over the vocabulary


# ---------------------------------------------------------------- configuration


def test_demo_defaults_follow_the_options():
    cfg = resolve_config(DemoOptions(micro_batch_size=4, grad_accum=3, lr=1e-3, seed=7, steps=9), CPU).config
    assert (cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 3, 12)
    assert cfg.optimizer.lr == 1e-3 and cfg.seed == 7 and cfg.scheduler.total_steps == 9
    assert cfg.precision == "fp32"  # the CPU default
    assert resolve_config(DemoOptions(), torch.device("cuda")).config.precision == "bf16"


def test_bad_option_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError) as e:
        resolve_config(DemoOptions(max_gpu_memory="lots"), CPU)
    assert "max_gpu_memory" in str(e.value)


@pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared/fixtures not beside the repository")
def test_user_config_file_with_options_on_top():
    loaded = resolve_config(DemoOptions(config=FIXTURES / "zero3_cpu_offload.json", lr=1e-3, steps=5), CPU)
    assert loaded.flavour == "deepspeed"
    assert loaded.config.optimizer.lr == 1e-3 and loaded.config.train_batch_size == 32


# ---------------------------------------------------------------- training through the engine


@pytest.mark.timeout(600)
def test_demo_trains_loss_falls():
    options = DemoOptions(steps=12, micro_batch_size=8, seq_len=64, sample_tokens=20)
    out = io.StringIO()
    result = run_demo(options, console=Console(file=out, width=100), progress=True)
    assert result.steps == 12 and not result.stopped_early
    assert all(math.isfinite(x) for x in result.losses)
    assert result.first_loss > 5.0  # ~ln(258) = 5.55 at initialisation
    assert result.final_loss < result.first_loss - 1.5, result.losses
    assert result.eval_loss_after < result.eval_loss_before - 1.5
    assert result.tokens_per_s > 0 and result.timeline["step"] > 0
    assert {"compute", "step"} <= set(result.timeline)
    assert result.sample.startswith("def ")
    assert "train" in out.getvalue()


@pytest.mark.timeout(300)
def test_time_budget_stops_after_the_first_step():
    result = run_demo(
        DemoOptions(steps=50, micro_batch_size=2, seq_len=32, time_budget=0.0, sample_tokens=0),
        console=Console(file=io.StringIO()),
        progress=False,
    )
    assert result.steps == 1 and result.stopped_early
