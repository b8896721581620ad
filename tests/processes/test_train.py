"""`zerofit train --model DIR --data PATH...`: a real fine-tuning run end to end, on the CPU.

A model directory (sharded bf16 safetensors, tokenizer) and files of every data format in; metrics,
checkpoints and a Hugging Face model out; Ctrl-C saves and exits 130; --resume continues bitwise exactly
where the interrupted run stopped (a new process, the same losses and final weights as one straight run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from tests.support.model_dirs import make_model_dir, write_data
from tests.support.train_cli import train_args
from zerofit.cli import app

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    model = make_model_dir(root / "model", "llama", torch.bfloat16)
    data = write_data(root / "data")
    return root, model, data


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _model_weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_finetune_end_to_end(workspace):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, model, data = workspace
    run = root / "run-e2e"
    res = CliRunner().invoke(
        app, train_args(model, data, run, "--steps", "6", "--save-every", "2", "--eval-every", "3", "--keep", "2")
    )
    assert res.exit_code == 0, res.output
    recs = _records(run)
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in evals] == [3, 6] and all(r["eval_perplexity"] > 1 for r in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] + 0.5  # finite, sane
    assert {"lr", "grad_norm", "tokens_per_s", "host_rss_bytes"} <= set(train[0])
    assert any((run / "tensorboard").iterdir())
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["global_step4", "global_step6"]  # --keep 2 removed global_step2
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step6"
    out = run / "model"
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert all(t.dtype == torch.bfloat16 for t in _model_weights(out).values())  # the model directory's dtype
    exported = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert next(exported.parameters()).dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    before = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        assert exported(ids, labels=ids).loss < before(ids, labels=ids).loss  # it learned the training text


def test_errors_exit_2_and_name_the_problem(workspace, tmp_path):
    root, model, data = workspace
    r = CliRunner().invoke(app, ["train", "--model", str(model), "--output", str(tmp_path / "x")])
    assert r.exit_code == 2 and "--data" in r.output
    r = CliRunner().invoke(app, train_args(tmp_path / "nope", data, tmp_path / "x", "--steps", "1"))
    assert r.exit_code == 2 and "nope: does not exist" in r.output
    r = CliRunner().invoke(app, train_args(model, [tmp_path / "missing.jsonl"], tmp_path / "x", "--steps", "1"))
    assert r.exit_code == 2 and "missing.jsonl" in r.output


def _cli(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    code = "import sys; from zerofit.cli import app; app(sys.argv[1:], prog_name='zerofit')"
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def test_ctrl_c_saves_and_resume_is_exact(workspace):
    """Straight: 200 steps. Interrupted: SIGINT after step 3 is logged (the step finishes, a checkpoint is saved,
    exit 130), then --resume in a new process to step 200. Same losses, bitwise, and the same exported weights.
    (200, not 8: a step of this toy takes ~8 ms on a fast machine, and 8 steps could end before the signal.)"""
    root, model, data = workspace
    straight, broken = root / "straight", root / "broken"
    steps = 200
    common = ("--steps", str(steps), "--eval-every", "0", "--keep", "3")
    p = _cli(train_args(model, data, straight, *common))
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out

    p = _cli(train_args(model, data, broken, *common))
    deadline = time.time() + 180
    while time.time() < deadline:
        m = broken / "metrics.jsonl"
        if m.is_file() and sum('"loss"' in line for line in m.read_text().splitlines()) >= 3:
            break
        assert p.poll() is None, p.communicate()[0]
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 130, out
    stopped = max(r["step"] for r in _records(broken) if "loss" in r)
    assert 3 <= stopped < steps, out
    assert (broken / "checkpoints" / "latest").read_text().strip() == f"global_step{stopped}"
    assert not (broken / "model").exists()

    p = _cli(train_args(model, data, broken, *common, "--resume"))
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out
    a = [(r["step"], r["loss"]) for r in _records(straight) if "loss" in r]
    b = [(r["step"], r["loss"]) for r in _records(broken) if "loss" in r]
    assert b == a, (a, b)  # bitwise: json keeps every float exactly
    wa, wb = _model_weights(straight / "model"), _model_weights(broken / "model")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_every_train_option_reaches_the_run(workspace, tmp_path, monkeypatch):
    """The CLI is a thin layer: each option lands in TrainOptions (a flag accepted but dropped fails here)."""
    import zerofit.train as train_pkg

    root, model, data = workspace
    seen = {}
    monkeypatch.setattr(
        train_pkg,
        "run_training",
        lambda opts, console, **kw: seen.setdefault("opts", opts) and (_ for _ in ()).throw(SystemExit(0)),
    )
    CliRunner().invoke(
        app,
        train_args(
            model,
            data,
            tmp_path / "o",
            "--steps",
            "3",
            "--epochs",
            "2",
            "--warmup-steps",
            "1",
            "--max-host-memory",
            "8GiB",
            "--nvme",
            str(tmp_path / "nv"),
            "--seed",
            "5",
            "--eval-every",
            "2",
            "--eval-windows",
            "3",
            "--save-every",
            "2",
            "--keep",
            "4",
            "--no-save-at-end",
            "--resume",
            "--no-save-on-interrupt",
            "--no-export",
            "--export-dtype",
            "fp16",
            "--deterministic",
        ),
    )
    o = seen["opts"]
    assert (o.steps, o.epochs, o.warmup_steps, o.max_host_memory, o.seed) == (3, 2.0, 1, "8GiB", 5)
    assert o.nvme == str(tmp_path / "nv")
    from zerofit.train.run import resolve_config

    off = resolve_config(o, torch.device("cpu")).config.offload
    assert (off.optimizer_device, off.param_device, off.nvme_path) == ("nvme", "nvme", str(tmp_path / "nv"))
    assert (o.eval_every, o.eval_windows, o.save_every, o.keep, o.save_at_end, o.resume) == (2, 3, 2, 4, False, True)
    assert (o.save_on_interrupt, o.export, o.export_dtype, o.deterministic, o.progress) == (
        False,
        False,
        "fp16",
        True,
        False,
    )
    assert (o.seq_len, o.micro_batch_size, o.grad_accum, o.lr, o.precision, o.eval_size) == (32, 2, 2, 1e-3, "fp32", 2)


def test_two_nodes_of_one_rank_train_like_one_process(workspace):
    """`zerofit train --nnodes 2 --node-rank i --master-addr 127.0.0.1 --master-port P` started once per node (two
    commands on this host, each torchrun's node; gloo on the CPU), 1 micro-batch per rank and step: the same losses
    and exported weights as one process with 2 ([Note: nodes hold the state whole])."""
    import socket

    root, model, data = workspace
    one, two = root / "run-one-n", root / "run-two-n"
    base = ["--steps", "3", "--export-dtype", "fp32", "--eval-size", "2"]
    res = CliRunner().invoke(app, train_args(model, data, one, *base))
    assert res.exit_code == 0, res.output
    args = train_args(model, data, two, *base)
    args[args.index("--grad-accum") + 1] = "1"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "src")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("WORLD_SIZE", None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "zerofit.cli",
                *args,
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=400) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][0][-3000:] + outs[0][1][-3000:] + outs[1][1][-2000:]
    l1 = [r["loss"] for r in _records(one) if "loss" in r]
    l2 = [r["loss"] for r in _records(two) if "loss" in r]
    assert len(l2) == 3
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1.3e-6, atol=1e-5)
    w1, w2 = _model_weights(one / "model"), _model_weights(two / "model")
    for n in w1:
        torch.testing.assert_close(w2[n], w1[n], rtol=1.3e-6, atol=1e-5)


def test_two_ranks_train_like_one_process(workspace):
    """`zerofit train --gpus 2` (torchrun, gloo on the CPU) with 1 micro-batch per rank and step trains on the
    same global batches as one process with 2: the same losses and exported weights, at fp32 tolerances; rank 0
    alone writes the metrics, checkpoints and the model."""
    root, model, data = workspace
    one, two = root / "run-one", root / "run-two"
    base = ["--steps", "3", "--export-dtype", "fp32", "--eval-size", "2"]
    res = CliRunner().invoke(app, train_args(model, data, one, *base))
    assert res.exit_code == 0, res.output
    args = [a if a != "2" or i == 0 else a for i, a in enumerate(train_args(model, data, two, *base))]
    args[args.index("--grad-accum") + 1] = "1"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "src")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("WORLD_SIZE", None)
    p = subprocess.run(
        [sys.executable, "-m", "zerofit.cli", *args, "--gpus", "2"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-2000:]
    l1 = [r["loss"] for r in _records(one) if "loss" in r]
    l2 = [r["loss"] for r in _records(two) if "loss" in r]
    assert len(l2) == 3
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1.3e-6, atol=1e-5)
    w1, w2 = _model_weights(one / "model"), _model_weights(two / "model")
    assert w1.keys() == w2.keys()
    for n in w1:
        torch.testing.assert_close(w2[n], w1[n], rtol=1.3e-6, atol=1e-5)
    assert (two / "checkpoints" / "latest").read_text().strip() == "global_step3"
    assert not (two / "ranks" / "rank1" / "tensorboard").exists()
