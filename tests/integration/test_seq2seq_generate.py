"""``zerofit generate`` and ``zerofit serve`` on an encoder-decoder's folder (a T5 saved with ``save_pretrained`` and
its tokenizer): transformers' own ``generate`` with the layers streamed by the hooked mode ([Note: an encoder-decoder
generates through the hooked mode], zerofit/infer/seq2seq.py; [Note: an encoder-decoder's requests, a batch at a
time], zerofit/serve/seq2seq.py). Greedy tokens are ``AutoModelForSeq2SeqLM.from_pretrained(folder).generate``'s on
a batch of prompts of different lengths, fp32 on the CPU; sampling with a seed is transformers' sampling with that
seed; the server's completions are the same answers; options that apply to decoder-only models are refused in one
line."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from typer.testing import CliRunner

from tests.support.tiny_tokenizer import build_tokenizer
from zerofit.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["Hello there", "The quick brown fox jumps", "x", "def train(model"]


def _t5_folder(path: Path) -> Path:
    """A tiny fp32 T5 and the test tokenizer, saved as a user's folder. Its weights are drawn wide
    (``initializer_factor``) so that greedy answers differ from prompt to prompt and token to token."""
    from transformers import T5Config, T5ForConditionalGeneration

    tok = build_tokenizer(path)
    config = T5Config(
        vocab_size=len(tok),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        decoder_start_token_id=tok.pad_token_id,
        initializer_factor=6.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        T5ForConditionalGeneration(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def t5(tmp_path_factory) -> Path:
    return _t5_folder(tmp_path_factory.mktemp("seq2seq") / "t5")


def _hf(folder: Path, prompts: list[str], max_new: int, **kw) -> list[list[int]]:
    """transformers' own generate on the folder, the prompts in one batch padded on the right: each answer's tokens
    (after the decoder's start token, up to its end-of-sequence token)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    assert model.dtype == torch.float32
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert tok.padding_side == "right"
    out = model.generate(**enc, max_new_tokens=max_new, **kw)[:, 1:].tolist()
    eos = model.generation_config.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in out]


def test_complete_on_a_t5_folder_is_transformers_generate_greedy_and_seeded(t5):
    """Four prompts of different lengths in one batch: greedy tokens equal transformers' on the same weights; a seed
    gives transformers' sampled tokens with that seed, and the same tokens again. Every layer streamed."""
    from zerofit.infer.seq2seq import Seq2SeqEngine, open_engine
    from zerofit.infer.text import complete

    eng = open_engine(t5, device="cpu")
    assert isinstance(eng, Seq2SeqEngine) and eng.dtype == torch.float32
    assert "4 layers as units, 4 streamed" in eng.summary()
    # an engine for generate alone: nothing trains, no optimizer state anywhere
    assert not any(p.requires_grad for p in eng.model.parameters())
    assert all(u.master.numel() == 0 and u.exp_avg.numel() == 0 for u in eng.engine.units)
    try:
        got = complete(eng, PROMPTS, max_new_tokens=8, batch_size=4, do_sample=False)
        greedy = _hf(t5, PROMPTS, 8, do_sample=False)
        assert [c.token_ids for c in got] == greedy
        assert len({tuple(w) for w in greedy}) == len(PROMPTS)  # the answers differ: the comparison can fail
        sampled = [complete(eng, PROMPTS[:2], max_new_tokens=8, temperature=5.0, seed=3) for _ in range(2)]
        torch.manual_seed(3)
        want = _hf(t5, PROMPTS[:2], 8, do_sample=True, temperature=5.0)
        assert [c.token_ids for c in sampled[0]] == [c.token_ids for c in sampled[1]] == want
        assert want != greedy[:2]  # it sampled
    finally:
        eng.close()


def test_cli_generate_on_a_t5_folder_prints_transformers_answers(t5, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(t5)
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", str(t5), "--max-new-tokens", "8", "--device", "cpu", "--output", str(out)]
    r = CliRunner().invoke(app, [*args, *[a for p in PROMPTS for a in ("--prompt", p)]])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "encoder-decoder (T5ForConditionalGeneration): transformers' generate in zerofit's hooked mode" in said
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    want = _hf(t5, PROMPTS, 8, do_sample=False)
    assert [x["text"] for x in recs] == [tok.decode(w, skip_special_tokens=True) for w in want]
    assert [x["new_tokens"] for x in recs] == [len(w) for w in want]
    # one prompt streams its answer to the terminal
    r = CliRunner().invoke(app, ["generate", "--model", str(t5), "--prompt", PROMPTS[1], "--max-new-tokens", "8"])
    assert r.exit_code == 0 and r.stdout.splitlines()[0] == tok.decode(want[1], skip_special_tokens=True), r.output


def test_options_for_decoder_only_models_are_refused_in_one_line(t5, tmp_path):
    r = CliRunner().invoke(app, ["generate", "--model", str(t5), "--prompt", "Hi", "--adapter", str(tmp_path)])
    assert r.exit_code == 2 and "is an encoder-decoder (T5ForConditionalGeneration)" in r.output, r.output
    assert "merge the adapter" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["serve", "--model", str(t5), "--adapter", str(tmp_path), "--port", "0"])
    assert r.exit_code == 2 and "adapters are served over a decoder-only base" in " ".join(r.output.split())


def test_waiting_greedy_requests_share_one_generate_and_each_gets_its_own_answer(t5):
    """[Note: an encoder-decoder's requests, a batch at a time]: four greedy requests queued together run as one
    ``generate`` (one of them ending early at its max_tokens), a sampled one alone after them; each answer is
    transformers' (greedy: the batch's rows; sampled: its sampling with the request's seed), its pieces streamed."""
    from zerofit.infer.seq2seq import open_engine
    from zerofit.serve.scheduler import Delta, Done, Sampling, Sequence
    from zerofit.serve.seq2seq import Seq2SeqScheduler

    eng = open_engine(t5, device="cpu")
    sched = Seq2SeqScheduler(eng, slots=4, context=128)
    tok = eng.tokenizer
    events: list[list] = [[] for _ in range(5)]
    limits = [8, 3, 8, 8]
    seqs = [
        Sequence(tok(p)["input_ids"], Sampling(max_tokens=n, temperature=0), events[i].append)
        for i, (p, n) in enumerate(zip(PROMPTS, limits))
    ]
    seqs.append(Sequence(tok(PROMPTS[0])["input_ids"], Sampling(8, temperature=3.0, seed=5), events[4].append))
    try:
        with sched._cond:  # all queued before the scheduler's thread looks
            for seq in seqs:
                sched.submit(seq)
        sched.close(timeout=60)
        assert (sched.forwards, sched.max_rows) == (2, 4)
        greedy = _hf(t5, PROMPTS, 8, do_sample=False)
        torch.manual_seed(5)
        sampled = _hf(t5, PROMPTS[:1], 8, do_sample=True, temperature=3.0, top_k=0)
        assert [s.tokens for s in seqs] == [g[:n] for g, n in zip(greedy, limits)] + sampled
        assert sampled[0] != greedy[0]
        for seq, evs in zip(seqs, events):
            assert isinstance(evs[-1], Done) and evs[-1].completion_tokens == len(seq.tokens)
            assert "".join(e.text for e in evs if isinstance(e, Delta)) == seq.text
            assert seq.text == tok.decode(seq.tokens, skip_special_tokens=True)
        assert isinstance(events[1][-1], Done) and events[1][-1].finish == "length"
    finally:
        sched.close()
        eng.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(t5, tmp_path_factory):
    """The server on a copy of the T5 folder whose tokenizer has no chat template (as T5's own has none)."""
    folder = tmp_path_factory.mktemp("served") / "t5"
    shutil.copytree(t5, folder)
    (folder / "chat_template.jinja").unlink()
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "zerofit.cli",
        "serve",
        "--model",
        str(folder),
        "--port",
        str(port),
        "--max-batch",
        "4",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited {proc.returncode}: {proc.stdout.read()}")  # type: ignore[union-attr]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            assert time.time() - t0 < 120, "the server did not start"
            time.sleep(0.2)
    yield {"url": url, "folder": folder, "proc": proc}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def test_serve_answers_completions_of_a_t5_as_transformers_and_refuses_chat_without_a_template(served):
    from transformers import AutoTokenizer

    folder = served["folder"]
    tok = AutoTokenizer.from_pretrained(folder)
    client = openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0)
    want = [tok.decode(w, skip_special_tokens=True) for w in _hf(folder, PROMPTS, 8, do_sample=False)]
    whole = client.completions.create(model="t5", prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == want
    assert whole.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in PROMPTS)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: batched or queued, each its own answer
        alone = pool.map(
            lambda p: client.completions.create(model="t5", prompt=p, max_tokens=8, temperature=0), PROMPTS
        )
        assert [c.choices[0].text for c in alone] == want
    pieces = client.completions.create(model="t5", prompt=PROMPTS[1], max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == want[1]
    seeded = [
        client.completions.create(model="t5", prompt=PROMPTS[0], max_tokens=8, temperature=2.0, seed=7).choices[0].text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1] != want[0]
    with pytest.raises(openai.BadRequestError, match="needs a chat template"):
        client.chat.completions.create(model="t5", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    health = httpx.get(served["url"] + "/health").json()
    assert 1 <= health["max_batch"] <= 4 and health["running"] == health["waiting"] == 0  # --max-batch 4
