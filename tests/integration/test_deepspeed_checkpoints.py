"""Checkpoints across the DeepSpeed boundary (docs/checkpoints.md, "DeepSpeed checkpoints").

Real DeepSpeed 0.19.8 on the CPU (tests/support/deepspeed_script.py, run in subprocesses of its own: one process, and
two data-parallel ranks over gloo) trains a tiny Llama under ZeRO stages 1, 2 and 3 (fp32; bf16 and fp16 too)
with AdamW, a WarmupLR schedule and a client_state, saves, and goes on training. DeepSpeed's AdamW is
``torch_adam`` (torch.optim.AdamW): its CPU Adam and FusedAdam are C++ ops it would compile first. zerofit
loads each folder, and:

- the loaded masters, moments, AdamW step counts, counters, lr, fp16 loss scaler and client_state are
  DeepSpeed's own (its accessors safe_get_full_fp32_param / safe_get_full_optimizer_state), bitwise;
- zerofit's next steps (fp32) are bitwise those of a plain ``torch.optim.AdamW(fused=True)`` loop started from
  DeepSpeed's saved state, zerofit's AdamW being torch's fused kernel. DeepSpeed's own next steps are bitwise
  those of torch.optim.AdamW's default (for-loop) kernel under stages 1 and 2 (under stage 3 DeepSpeed's weights
  differ from that loop's in the last bits: not traced further), so DeepSpeed and zerofit agree to the rounding of
  the two kernels (the losses of the first steps bitwise, the weights to 2e-7);
- a checkpoint of two data-parallel ranks continues in one process (2 micro-batches a step);
- what zerofit cannot map is refused by name, the engine left as it was.

And zerofit's own ``save_checkpoint`` in the middle of an accumulation window (no DeepSpeed needed).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import zerofit
import zerofit.deepspeed as zds
import zerofit.hf
from tests.support import tiny_models as tm
from zerofit.checkpoint import CheckpointMismatchError, CheckpointStateError
from zerofit.checkpoint.deepspeed_format import DeepSpeedCheckpointError, find, read
from zerofit.checkpoint.state import optimizer_entries, weight_entries

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "deepspeed_script.py"
STEPS, MORE = 3, 2
LR, WARMUP = 2e-3, 4
# a Llama whose tensors have odd sizes (33 wide, vocabulary 97): ZeRO pads its partitions over two ranks
ODD = dict(
    hidden_size=33,
    intermediate_size=50,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=8,
    vocab_size=tm.VOCAB,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    attn_implementation="sdpa",
)


def ds_config(stage: int, precision: str = "fp32", G: int = 1, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": G,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": WARMUP, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":  # 2^20 overflows twice before the save (skipped steps), then the scale grows
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2, "hysteresis": 1}
    return {**cfg, **extra}


ONE = {  # one process
    "s1": dict(config=ds_config(1), reload=True),
    "s2": dict(config=ds_config(2), universal=True),
    "s3": dict(config=ds_config(3)),
    "b3": dict(config=ds_config(3, "bf16")),
    "h2": dict(config=ds_config(2, "fp16"), steps=5),
    "g1": dict(config=ds_config(1), groups=True),  # two parameter groups: no weight decay for the vectors
    "f2": dict(config=ds_config(2), freeze=["model.norm.weight"]),
    "m1": dict(config=ds_config(1, G=2), steps=2, more=1, mid=1),  # saved one micro-batch into a window of 2
}
# transformers' Trainer with deepspeed= (the same settings as ds_config's), 5 steps, checkpoint-3 saved
HF_ARGS = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=1,
    learning_rate=LR,
    max_grad_norm=0.0,
    adam_beta2=0.99,
    weight_decay=0.01,
    warmup_steps=WARMUP,
    max_steps=5,
    save_strategy="steps",
    save_steps=3,
    logging_steps=1,
    report_to=[],
    disable_tqdm=True,
    use_cpu=True,
    seed=7,
)
ONE["hf"] = dict(config=ds_config(2), args=HF_ARGS)
TWO = {  # two data-parallel ranks; p3 in sub-groups
    "p2": dict(config=ds_config(2), model=ODD),
    "p3": dict(config=ds_config(3, zero_optimization={"stage": 3, "sub_group_size": 3000}), model=ODD),
}


def _spec(out: Path, runs: dict) -> str:
    import json

    return json.dumps(
        {"out": str(out), "runs": [{"name": n, "steps": STEPS, "more": MORE, **r} for n, r in runs.items()]}
    )


def _run_together(runs: list, logs: list, env: dict) -> tuple[int, Path] | None:
    """The runs as processes side by side: None when every one exits 0, else the first that failed (its exit
    status and log); a failed run ends the others (a rank would wait for its peer in a collective)."""
    procs = []
    for (spec, extra), log in zip(runs, logs):
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPT), spec], env={**env, **extra}, stdout=f, stderr=subprocess.STDOUT
                )
            )
    deadline = time.monotonic() + 800
    first = None
    try:
        while first is None and any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            first = next(((p.returncode, log) for p, log in zip(procs, logs) if p.poll() not in (None, 0)), None)
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if first is None:  # every run ended (or the deadline came): the first that did not exit 0
        first = next(((p.returncode, log) for p, log in zip(procs, logs) if p.returncode != 0), None)
    return first


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    """Every DeepSpeed run, once: one process and two ranks side by side. Their folders and results."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (pip install deepspeed==0.19.8)")
    out = tmp_path_factory.mktemp("deepspeed")
    # one thread each: three processes share the cores, and tiny matrices gain nothing from a second thread
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "DS_BUILD_OPS": "0",
        "TORCH_EXTENSIONS_DIR": str(out / "ext"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    # DeepSpeed's own teardown (a C++ thread left joinable at exit: "terminate called without an active
    # exception") now and then aborts a rank after its results are written, on a busy machine; that is the peer
    # library's exit, not a reading of its checkpoints, so such a crash runs every DeepSpeed run once more
    for attempt in range(2):
        store = out / f"store{attempt}"  # a file rendezvous is used once
        runs = [(_spec(out, ONE), {})] + [
            (_spec(out, TWO), {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "ZF_DS_STORE": str(store)})
            for r in range(2)
        ]
        logs = [out / f"run{i}.{attempt}.log" for i in range(len(runs))]
        failed = _run_together(runs, logs, env)
        if failed is None:
            return out
        code, log = failed
        text = log.read_text()
        if attempt == 0 and code < 0 and "terminate called without an active exception" in text:
            continue
        raise AssertionError(f"{log} (exit {code}): " + text[-4000:])


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# the first test to ask for ``ds`` waits for DeepSpeed's runs (a minute of CPU, more on a busy machine)
deepspeed_runs = pytest.mark.timeout(900)


def _result(ds: Path, name: str) -> dict:
    return torch.load(ds / f"{name}.pt", weights_only=False)


def _model(name: str):
    return LlamaForCausalLM(LlamaConfig(**ODD)) if name in TWO else tm.llama()


def _run(name: str) -> dict:
    return {"steps": STEPS, "more": MORE, **(ONE.get(name) or TWO[name])}


def _groups(model) -> list[dict]:
    """tests/support/deepspeed_script.py's two groups."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.ndim > 1]},
        {"params": [p for _, p in named if p.ndim <= 1], "weight_decay": 0.0},
    ]


def _engine(name: str, door: str = "deepspeed", groups: bool | None = None, **overrides):
    torch.manual_seed(99)  # other initial weights than DeepSpeed's: the load must replace them all
    model, cfg = _model(name), _run(name)["config"]
    groups = _groups(model) if (_run(name).get("groups") if groups is None else groups) else None
    if door == "deepspeed":
        engine, *_ = zds.initialize(model=model, model_parameters=groups, config=cfg, device="cpu", **overrides)
        return engine
    return zerofit.initialize(model, cfg, device="cpu", param_groups=groups, **overrides)


def _tag(ds: Path, name: str) -> Path:
    return ds / name / (ds / name / "latest").read_text().strip()


def _state(engine) -> dict[str, torch.Tensor]:
    engine.wait()
    return {
        e.name: e.base[e.offset : e.offset + e.numel].clone().view(e.shape)
        for e in weight_entries(engine) + optimizer_entries(engine)
    }


def _assert_deepspeeds_state(engine, ref: dict) -> None:
    got = _state(engine)
    for name, (master, exp_avg, exp_avg_sq) in ref["state"].items():
        if name not in got:  # a tied alias DeepSpeed lists too: zerofit keeps its first name
            continue
        for key, want in ((name, master), (f"{name}.exp_avg", exp_avg), (f"{name}.exp_avg_sq", exp_avg_sq)):
            assert torch.equal(got[key], want), key
    assert {float(u.step) for u in engine.units} == set(ref["at_save"]["adam_step"])


def _data(name: str, world: int = 1) -> list[list[dict]]:
    run = _run(name)
    return tm.batches(run["steps"] + run["more"], run["config"]["gradient_accumulation_steps"] * world)[run["steps"] :]


def _warmup_lr(applied: int) -> float:
    """DeepSpeed's WarmupLR (linear, min 0) for the step after ``applied`` applied steps, from its formula:
    get_lr() at last_batch_iteration = applied - 1, gamma = it / max(2, warmup_num_steps)."""
    return LR * min(1.0, max(applied - 1, 0) / max(2, WARMUP))


def _plain(name: str, ref: dict, fused: bool):
    """torch.optim.AdamW over the model's own parameters, started from DeepSpeed's saved state; returns the losses
    and the final weights."""
    model = _model(name)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, fused=True if fused else None
    )
    (step,) = set(ref["at_save"]["adam_step"])
    with torch.no_grad():
        for n, p in params.items():
            master, exp_avg, exp_avg_sq = ref["state"][n]
            p.copy_(master)
            opt.state[p] = {"step": torch.tensor(step), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    losses = []
    for k, mbs in enumerate(_data(name)):
        for g in opt.param_groups:
            g["lr"] = _warmup_lr(int(step) + k)
        opt.zero_grad()
        for b in mbs:
            out = model(**b)
            (out.loss / len(mbs)).backward()
            losses.append(out.loss.item())
        opt.step()
    return losses, {n: p.detach().clone() for n, p in params.items()}


def _continue(engine, name: str, world: int = 1) -> tuple[list[float], dict]:
    losses = [float(x) for mbs in _data(name, world) for x in tm.ds_losses(engine, mbs)]
    return losses, engine.master_state_dict()


# ---------------------------------------------------------------------------------------------- the reader


@pytest.mark.slow
@deepspeed_runs
@pytest.mark.parametrize("name", ["s1", "s2", "s2-universal", "s3", "b3", "h2", "m1", "p2", "p3"])
def test_the_reader_gives_deepspeeds_own_state(ds, name):
    """Every parameter's fp32 master and moments (DeepSpeed's flat partitions, cut by param_shapes and its
    paddings; two ranks' pieces joined; the universal layout), its step count, DeepSpeed's counters and scaler.
    m1 was saved one micro-batch into an accumulation window: it holds the last step's state."""
    base = name.split("-")[0]
    ref = _result(ds, base)
    folder = _tag(ds, base)
    if name.endswith("universal"):
        folder = folder.with_name(folder.name + "_universal")
    assert find(ds / base, folder.name if name.endswith("universal") else None, "zerofit_checkpoint.json") == folder
    ck = read(folder)
    stage = _run(base)["config"]["zero_optimization"]["stage"]
    assert ck.stage == ("universal" if name.endswith("universal") else stage)
    assert ck.dp_world_size == (2 if base in TWO else 1) and ck.ds_version == "0.19.8"
    assert ck.precision == {"b3": "bf16", "h2": "fp16"}.get(base, "fp32")
    for n, (master, exp_avg, exp_avg_sq) in ref["state"].items():
        p = ck.params[ck.aliases.get(n, n)]
        assert p.shape == master.shape, n
        for got, want in ((p.master, master), (p.exp_avg, exp_avg), (p.exp_avg_sq, exp_avg_sq)):
            assert torch.equal(got.tensor().view(p.shape), want), n
        assert p.step == ref["at_save"]["adam_step"][0], n
    assert set(ck.params) | set(ck.aliases) == set(ref["state"]) | {"lm_head.weight"}
    assert (ck.global_steps, ck.skipped_steps) == (ref["at_save"]["global_steps"], ref["at_save"]["skipped_steps"])
    assert ck.lr_scheduler == {"last_batch_iteration": ck.global_steps - ck.skipped_steps - 1}
    if base == "h2":
        assert ck.skipped_steps == 2 and ck.loss_scaler["dynamic"] is True
        for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"):
            assert ck.loss_scaler[k] == ref["at_save"]["scaler"][k], k


# ---------------------------------------------------------------------------------------------- continuing


@pytest.mark.slow
@deepspeed_runs
@pytest.mark.parametrize(
    "name,door", [("s1", "deepspeed"), ("s2", "initialize"), ("s3", "deepspeed"), ("s2-universal", "deepspeed")]
)
def test_a_deepspeed_run_continues_on_zerofit(ds, name, door):
    base = name.split("-")[0]
    ref = _result(ds, base)
    engine = _engine(base, door)
    where = ds / base
    if name.endswith("universal"):
        path, client_state = engine.load_checkpoint(where, tag=_tag(ds, base).name + "_universal")
    else:
        path, client_state = engine.load_checkpoint(where)
    assert Path(path).parent == where
    _assert_deepspeeds_state(engine, ref)
    assert (engine.global_step, engine.global_steps, engine.skipped_steps) == (STEPS, STEPS, 0)
    assert engine.get_lr() == [_warmup_lr(STEPS)]
    assert client_state["epoch"] == 3 and client_state["note"] == base
    assert torch.equal(client_state["seen"], torch.arange(4))
    if "reload" in ref:  # as DeepSpeed's own load_checkpoint returns it: the same keys, the same values
        theirs = ref["reload"]["client_state"]
        assert sorted(client_state) == sorted(theirs)
        for k in ("epoch", "note", "global_samples", "ds_version", "shared_params", "buffer_names"):
            assert client_state[k] == theirs[k], k
        assert ref["reload"]["global_steps"] == engine.global_steps and ref["reload"]["lr"] == engine.get_lr()

    losses, final = _continue(engine, base)
    fused_losses, fused_final = _plain(base, ref, fused=True)
    assert losses == fused_losses  # zerofit: torch's fused AdamW kernel, bitwise
    for n, w in fused_final.items():
        if n in final:
            assert torch.equal(final[n], w), n
    loop_losses, loop_final = _plain(base, ref, fused=False)
    if ref["state"] and base != "s3":  # DeepSpeed (stages 1, 2): torch's default AdamW, bitwise
        assert ref["losses"] == loop_losses
        assert all(torch.equal(ref["final"][n], w) for n, w in loop_final.items())
    assert losses[0] == ref["losses"][0]  # the loaded weights are DeepSpeed's
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-6, atol=0)
    for n, w in final.items():
        torch.testing.assert_close(w, ref["final"][n], rtol=0, atol=2e-7, msg=lambda m, n=n: f"{n}: {m}")
    assert engine.global_steps == ref["global_steps"] and engine.get_lr() == ref["lr"]


@pytest.mark.slow
@deepspeed_runs
@pytest.mark.parametrize("name", ["b3", "h2"])
def test_bf16_and_fp16_runs_continue(ds, name, caplog):
    """bf16 (stage 3) and fp16 (stage 2, with skipped steps): the state and, in fp16, DeepSpeed's dynamic loss
    scaler are loaded exactly; the first step's loss is DeepSpeed's bitwise, the next ones agree to the
    rounding of their different 16-bit gradient paths (DeepSpeed keeps 16-bit gradients, zerofit fp32 ones)."""
    ref = _result(ds, name)
    engine = _engine(name, "initialize")
    with caplog.at_level(logging.WARNING, logger="zerofit"):
        engine.load_checkpoint(ds / name)
    assert "differen" not in caplog.text and "other AdamW" not in caplog.text  # the same settings and groups
    _assert_deepspeeds_state(engine, ref)
    at = ref["at_save"]
    assert (engine.global_steps, engine.skipped_steps) == (at["global_steps"], at["skipped_steps"])
    assert engine.global_step == at["global_steps"] - at["skipped_steps"]
    if name == "h2":
        s = engine.scaler.state_dict()
        assert at["skipped_steps"] == 2 and s["skipped_steps"] == 2
        assert {k: s[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")} == {
            k: at["scaler"][k] for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
        }
    losses, final = _continue(engine, name)
    assert losses[0] == ref["losses"][0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-3, atol=0)
    for n, w in final.items():
        torch.testing.assert_close(w, ref["final"][n], rtol=0, atol=5e-3 if name == "h2" else 1e-4)


@pytest.mark.slow
@deepspeed_runs
@pytest.mark.parametrize("name", ["p2", "p3"])
def test_two_ranks_continue_in_one_process(ds, name, caplog):
    """A checkpoint of two data-parallel ranks (stage 2: the ranks' slices of each flat group; stage 3: every
    parameter in two padded halves) continues in one process, the two ranks' micro-batches as one window."""
    ref = _result(ds, name)
    engine = _engine(name, gradient_accumulation_steps=2, train_batch_size=4)
    with caplog.at_level(logging.INFO, logger="zerofit"):
        engine.load_checkpoint(ds / name)
    assert "different" not in caplog.text  # 2 ranks x 1 micro-batch there, 2 micro-batches here: the same batch
    assert "saved by 2 data-parallel ranks with 1 micro-batches each, loaded in 1 process(es) with 2" in caplog.text
    _assert_deepspeeds_state(engine, ref)
    losses, final = _continue(engine, name, world=2)
    ranks = [x for pair in zip(*[[ref["rank_losses"][r][k] for k in range(MORE)] for r in range(2)]) for x in pair]
    assert losses[:2] == ranks[:2]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ranks), rtol=1e-6, atol=0)
    for n, w in final.items():
        torch.testing.assert_close(w, ref["final"][n], rtol=0, atol=2e-7)


@pytest.mark.slow
@deepspeed_runs
def test_a_hugging_face_deepspeed_run_resumes_on_zerofit_hf(ds, tmp_path):
    """transformers' Trainer with deepspeed= saved checkpoint-3 (DeepSpeed's folder beside the Trainer's state);
    zerofit.hf's Trainer, with the same arguments, resumes from it: steps 4 and 5 log DeepSpeed's losses, and the
    weights end where DeepSpeed's did (to the AdamW kernels' rounding)."""
    from transformers import TrainingArguments, default_data_collator

    ref = _result(ds, "hf")
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=ds_config(2), **HF_ARGS)
    torch.manual_seed(99)
    data = [{"input_ids": r, "labels": r} for mbs in tm.batches(6, 1) for r in mbs[0]["input_ids"]]  # as the script's
    trainer = zerofit.hf.Trainer(model=tm.llama(), args=args, train_dataset=data, data_collator=default_data_collator)
    trainer.train(resume_from_checkpoint=str(ds / "hf" / "checkpoint-3"))
    assert trainer.state.global_step == 5 and trainer.zerofit_engine.global_step == 5

    def logged(history, key):
        return [(e["step"], e[key]) for e in history if key in e and e["step"] > 3]

    # (the logged learning rates are not compared: transformers + DeepSpeed logs the next step's lr, DeepSpeed's
    # scheduler having stepped, zerofit.hf the lr of the step taken; the lr used is the same, as the losses show)
    mine, theirs = logged(trainer.state.log_history, "loss"), logged(ref["log_history"], "loss")
    assert [s for s, _ in mine] == [4, 5] and mine[0] == theirs[0]
    torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs), rtol=1e-6, atol=0)
    final = trainer.zerofit_engine.master_state_dict()
    for n, w in final.items():
        torch.testing.assert_close(w, ref["final"][n], rtol=0, atol=2e-7)


@pytest.mark.slow
@deepspeed_runs
def test_parameter_groups(ds, caplog):
    """g1 (stage 1) had its vectors in a group without weight decay, a flat group of their own: with the same
    groups it loads and continues as DeepSpeed does; one group for all (weight decay 0.01) is warned about,
    naming them. (DeepSpeed's own accessor of the moments fails for this run, so the masters are compared with
    DeepSpeed's zero_to_fp32, and the moments through the steps that follow.)"""
    ref = _result(ds, "g1")
    ck = read(_tag(ds, "g1"))
    assert len(ck.groups) == 2 and ck.groups[1]["weight_decay"] == 0.0
    assert {p.group for n, p in ck.params.items()} == {0, 1}
    engine = _engine("g1")
    with caplog.at_level(logging.WARNING, logger="zerofit"):
        engine.load_checkpoint(ds / "g1")
    assert "other AdamW" not in caplog.text
    got = _state(engine)
    for n, (master, _, _) in ref["state"].items():
        assert torch.equal(got[n], master), n
    losses, final = _continue(engine, "g1")
    assert losses[0] == ref["losses"][0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-6, atol=0)
    for n, w in final.items():
        torch.testing.assert_close(w, ref["final"][n], rtol=0, atol=2e-7)

    caplog.clear()
    engine = _engine("g1", groups=False)
    with caplog.at_level(logging.WARNING, logger="zerofit"):
        engine.load_checkpoint(ds / "g1")
    assert "with other AdamW betas, eps or weight_decay" in caplog.text
    for n in (
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
    ):
        assert n in caplog.text, n
    assert "and 1 more" in caplog.text and "model.embed_tokens.weight" not in caplog.text
    assert torch.equal(_state(engine)["model.norm.weight"], ref["state"]["model.norm.weight"][0])


@pytest.mark.slow
@deepspeed_runs
def test_a_parameter_deepspeed_froze(ds):
    """f2 froze model.norm.weight (frozen_param_shapes / frozen_param_fragments, no optimizer state): an engine
    that trains it is refused with the moments, by name; the weights alone load, that one's value included."""
    ref = _result(ds, "f2")
    assert read(_tag(ds, "f2")).params["model.norm.weight"].frozen
    engine = _engine("f2")
    before = _state(engine)
    with pytest.raises(CheckpointMismatchError, match=r"DeepSpeed did not train model.norm.weight \(frozen there"):
        engine.load_checkpoint(ds / "f2")
    assert all(torch.equal(_state(engine)[k], v) for k, v in before.items())
    engine.load_checkpoint(ds / "f2", load_optimizer_states=False)
    got = _state(engine)
    for n, (master, _, _) in ref["state"].items():
        assert torch.equal(got[n], master), n


@pytest.mark.slow
@deepspeed_runs
def test_weights_only(ds):
    """load_optimizer_states=False: the masters from DeepSpeed's fp32 partitions; moments and steps stay."""
    ref = _result(ds, "s3")
    engine = _engine("s3")
    before = _state(engine)
    engine.load_checkpoint(ds / "s3", load_optimizer_states=False)
    got = _state(engine)
    for n, (master, _, _) in ref["state"].items():
        assert torch.equal(got[n], master), n
        assert torch.equal(got[f"{n}.exp_avg"], before[f"{n}.exp_avg"]), n
    assert {float(u.step) for u in engine.units} == {0.0}


# ---------------------------------------------------------------------------------------------- refusals


def _copy(ds: Path, name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(ds / name, dst)
    return dst / (dst / "latest").read_text().strip()


@pytest.mark.slow
@deepspeed_runs
def test_what_cannot_map_is_refused_by_name(ds, tmp_path):
    engine = _engine("s1")
    before = _state(engine)

    def refused(where, error, *words):
        with pytest.raises(error) as e:
            engine.load_checkpoint(where)
        for w in words:
            assert w in str(e.value), (w, str(e.value))
        after = _state(engine)  # nothing was written into the engine
        assert all(torch.equal(after[k], v) for k, v in before.items())

    folder = _copy(ds, "s1", tmp_path / "mp")
    shutil.copy(folder / "mp_rank_00_model_states.pt", folder / "mp_rank_01_model_states.pt")
    refused(folder.parent, DeepSpeedCheckpointError, "2 model-parallel", "mp_rank 00, 01", "ds_to_universal")
    folder = _copy(ds, "s1", tmp_path / "moe")
    (folder / "layer_0_expert_0_mp_rank_00_model_states.pt").write_bytes(b"")
    refused(folder.parent, DeepSpeedCheckpointError, "mixture-of-experts", "layer_0_expert_0_mp_rank_00")
    folder = _copy(ds, "s1", tmp_path / "pipe")
    (folder / "layer_01-model_00-model_states.pt").write_bytes(b"")
    refused(folder.parent, DeepSpeedCheckpointError, "pipeline-parallel", "layer_01-model_00")
    folder = _copy(ds, "s1", tmp_path / "cut")
    optim = folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:5000])
    refused(folder.parent, DeepSpeedCheckpointError, str(optim), "not readable")
    optim.unlink()
    refused(folder.parent, DeepSpeedCheckpointError, "1 data-parallel rank", "found ranks none")

    # another model: the names and shapes that differ are listed, and nothing is loaded
    for model, words in (
        (tm.llama(layers=2), ["not in this model: model.layers.2."]),
        (tm.llama(tied=False), ["lm_head.weight: tied to model.embed_tokens.weight"]),
        (
            LlamaForCausalLM(LlamaConfig(**ODD)),
            [
                "model.embed_tokens.weight: (97, 32) in the checkpoint, (97, 33) in this model",
                "not in this model: model.layers.2.",
            ],
        ),
    ):
        other = zerofit.initialize(model, ds_config(1), device="cpu")
        mine = _state(other)
        with pytest.raises(CheckpointMismatchError) as e:
            other.load_checkpoint(ds / "s1")
        for w in words + ["another model", "Build the engine from the model the checkpoint was trained with"]:
            assert w in str(e.value), (w, str(e.value))
        assert all(torch.equal(_state(other)[k], v) for k, v in mine.items())


# ---------------------------------------------------------------------------------------------- mid-window saves

G = 4
_VARIANTS = {
    "resident": {},
    # blocks streamed from host memory, updated by the CPU worker (deferred under clipping), a host-optimized shell
    "streamed-bf16-clipped": {
        "precision": "bf16",
        "gradient_clipping": 0.05,
        "offload": {"resident_blocks": 0, "shell_optimizer": "host"},
    },
}


def _zf_config(extra: dict) -> dict:
    return {
        "device": "cpu",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": G,
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01},
        **extra,
    }


@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_a_save_in_the_middle_of_a_window(variant, tmp_path, caplog):
    """[Note: a save in the middle of an accumulation window] (checkpoint/state.py): saved 2 micro-batches (and a
    forward) into a window of 4, as DeepSpeed saves: the last step's weights and optimizer state. The saving
    engine's window goes on: its losses, weights, moments and steps are bitwise those of the same run without
    the save. The loaded engine holds the state of the last step and says what became of the window."""
    data = tm.batches(3, G)

    def run(save: bool):
        torch.manual_seed(0)
        engine = zerofit.initialize(tm.llama(dropout=0.1), _zf_config(_VARIANTS[variant]))  # dropout: RNG too
        losses = [float(x) for x in tm.ds_losses(engine, data[0])]
        at_step = _state(engine)
        losses += [float(x) for x in tm.ds_losses(engine, data[1][:2])]
        out = engine(**data[1][2])
        if save:
            engine.save_checkpoint(tmp_path)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
        losses += [float(x) for x in tm.ds_losses(engine, data[1][3:] + data[2])]
        return losses, _state(engine), [float(u.step) for u in engine.units], at_step

    plain, saved = run(False), run(True)
    assert saved[0] == plain[0]
    assert saved[2] == plain[2] == [3.0] * len(plain[2])
    assert all(torch.equal(saved[1][k], v) for k, v in plain[1].items())

    torch.manual_seed(5)
    fresh = zerofit.initialize(tm.llama(dropout=0.1), _zf_config(_VARIANTS[variant]))
    with caplog.at_level(logging.WARNING, logger="zerofit"):
        fresh.load_checkpoint(tmp_path)
    assert (
        "the checkpoint was saved 2 micro-batches into an accumulation window of 4 (and a forward without its "
        "backward); their gradients were not saved: the loaded engine starts a new window"
    ) in caplog.text
    loaded = _state(fresh)
    assert all(torch.equal(loaded[k], v) for k, v in saved[3].items())
    assert fresh.global_step == 1 and {float(u.step) for u in fresh.units} == {1.0}
    assert fresh.is_gradient_accumulation_boundary() is False and fresh.micro_steps == G  # a new window


def test_a_window_save_when_the_step_has_begun_or_a_load_mid_window_are_refused(tmp_path):
    """Between the boundary's backward() and its step() a streaming engine is updating its blocks: refused,
    with what to do. A load in the middle of a window is refused (the held gradients are of the old weights)."""
    engine = zerofit.initialize(tm.llama(), _zf_config({}))
    mbs = tm.batches(1, G)[0]
    for b in mbs[:-1]:
        out = engine(**b)
        engine.backward(out.loss)
        engine.step()
    engine.save_checkpoint(tmp_path, tag="early")
    out = engine(**mbs[-1])
    engine.backward(out.loss)
    with pytest.raises(
        CheckpointStateError,
        match="between the accumulation boundary's backward"
        r"\(\) and its step\(\) \(4 micro-batches\).*Call engine.step",
    ):
        engine.save_checkpoint(tmp_path)
    engine.step()
    assert engine.global_step == 1 and Path(engine.save_checkpoint(tmp_path)).name == "global_step1"
    out = engine(**mbs[0])
    engine.backward(out.loss)
    with pytest.raises(CheckpointStateError, match="1 micro-batches since the last optimizer step"):
        engine.load_checkpoint(tmp_path, tag="early")
