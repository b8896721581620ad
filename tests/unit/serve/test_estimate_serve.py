"""``zerofit estimate --serve``: the plan it gives from a config alone is the one ``zerofit serve``'s scheduler
prepares over the loaded model (the same KV cache, the same blocks streamed); a plan that cannot fit exits 2 with
what would."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from tests.support.model_dirs import make_model_dir
from zerofit.cli import app
from zerofit.estimate import meta_model
from zerofit.estimate.serve import serve_plan, serve_shape
from zerofit.infer import InferenceEngine
from zerofit.serve.scheduler import Scheduler


def test_the_estimate_is_the_plan_the_server_prepares(tmp_path):
    d = make_model_dir(tmp_path / "m", dtype=torch.float32, layers=6)
    eng = InferenceEngine.from_pretrained(d, dtype="fp32", device="cpu")
    try:
        assert serve_shape(meta_model(d), "fp32") == eng.shape
        s = eng.shape
        cap = s.shell_bytes + s.kv_bytes(3, 64) + s.work_bytes(3, 21, 64) + 4 * max(s.block_bytes)
        want = serve_plan(meta_model(d), max_gpu_memory=cap, concurrency=3, context=64, dtype="fp32", gpu=False)
        assert 0 < len(want.streamed) < 6
        eng.cap = cap
        sched = Scheduler(eng, slots=3, context=64)
        sched.close()
        got = sched.full_plan  # checked at start; the cache holds the rows in flight ([Note: a plan that follows
        assert (got.resident, got.streamed, got.kv_bytes) == (want.resident, want.streamed, want.kv_bytes)  # the
        assert sched.cache.bytes * 3 == want.kv_bytes  # batch]): one of the three at start
    finally:
        eng.close()


def test_estimate_serve_on_the_command_line(tmp_path):
    d = make_model_dir(tmp_path / "m", dtype=torch.bfloat16, layers=2)
    r = CliRunner().invoke(app, ["estimate", "--serve", "--model", str(d), "--concurrency", "4", "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["fits"] and info["context"] == 256 and info["kv_cache_bytes"] == 2 * 2 * 4 * 256 * 2 * 8 * 2
    r = CliRunner().invoke(app, ["estimate", "--serve", "--shape", "llama-2-13b", "--max-gpu-memory", "24GiB",
                                 "--concurrency", "16"])  # fmt: skip
    assert r.exit_code == 2 and "What fits" in r.output
    # [Note: a plan that follows the batch]: one request in flight keeps the blocks its idle rows' memory holds
    r = CliRunner().invoke(app, ["estimate", "--serve", "--shape", "llama-2-13b", "--max-gpu-memory", "24GiB",
                                 "--concurrency", "32", "--context", "64"])  # fmt: skip
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "34/40 blocks resident" in text and "one request in flight: 36/40 blocks resident" in text, text


def test_estimate_serve_says_an_encoder_decoder_is_served_otherwise(tmp_path):
    d = make_model_dir(tmp_path / "t5", family="t5", layers=2)
    r = CliRunner().invoke(app, ["estimate", "--serve", "--model", str(d)])
    assert r.exit_code == 2 and "encoder-decoder (T5ForConditionalGeneration)" in r.output, r.output
    assert "hooked mode" in r.output
