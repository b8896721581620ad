"""zerofit.hf: the Hugging Face Trainer on zerofit's engine, against the plain transformers Trainer (CPU, fp32).

    PYTHONPATH=src .venv/bin/python -m pytest tests/integration/test_hf_trainer.py -q

The same arguments, seed, data and initial weights go to ``transformers.Trainer`` and to ``zerofit.hf.Trainer``;
the logged losses, learning rates and gradient norms, the evaluation losses and the final weights must agree at
fp32 tolerances. The data has 13 sequences, 7 micro-batches of 2 (the last of 1) per epoch with gradient
accumulation 2, so every epoch ends with a short accumulation of a short batch, and labels are partly masked
(-100), so the Trainer's token-count loss normalisation (num_items_in_batch) differs from a plain mean.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, TrainingArguments, default_data_collator
from transformers import Trainer as PlainTrainer

import zerofit.hf
from tests.support import tiny_models as tm
from zerofit.hf import UnsupportedArgumentError, ZerofitTrainerMixin, with_zerofit

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _data(n: int, T: int = 16, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, tm.VOCAB, (T,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(1, T // 2, (1,), generator=g))] = -100  # a prompt without loss, of varying length
        out.append({"input_ids": ids, "labels": labels})
    return out


TRAIN, EVAL = _data(13), _data(4, seed=9)


def _args(out: Path, cls=TrainingArguments, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=2e-3,
        max_grad_norm=0.5,
        num_train_epochs=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=7,
    )
    base.update(kw)
    return cls(**base)


def _train(cls, model, args, train_kwargs: dict | None = None, **kw):
    with _no_deepspeed() if cls is not PlainTrainer else contextlib.nullcontext():
        trainer = cls(
            model=model,
            args=args,
            train_dataset=kw.pop("train_dataset", TRAIN),
            data_collator=default_data_collator,
            **kw,
        )
        trainer.train(**(train_kwargs or {}))
    if cls is not PlainTrainer:
        assert not trainer.is_deepspeed_enabled
    return trainer


@contextlib.contextmanager
def _no_deepspeed():
    """zerofit.hf must train without DeepSpeed: with it installed (the plain Trainer imports it), ``import
    deepspeed`` fails inside this block, so a zerofit run that reached for it would fail."""
    saved = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    for k in saved:
        del sys.modules[k]
    sys.modules["deepspeed"] = None
    try:
        yield
    finally:
        del sys.modules["deepspeed"]
        sys.modules.update(saved)


def _logs(trainer, key: str) -> list[tuple[int, float]]:
    return [(e["step"], e[key]) for e in trainer.state.log_history if key in e]


def _weights(trainer) -> dict[str, torch.Tensor]:
    model = trainer.zerofit_engine.module if isinstance(trainer, ZerofitTrainerMixin) else trainer.model
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same_run(plain, zf, grad_norm: bool = True) -> None:
    for key in ("loss", "eval_loss") + (("grad_norm",) if grad_norm else ()):
        a, b = _logs(plain, key), _logs(zf, key)
        assert [s for s, _ in a] == [s for s, _ in b], key
        if a:
            torch.testing.assert_close(
                torch.tensor([v for _, v in b]), torch.tensor([v for _, v in a]), msg=lambda m, key=key: f"{key}: {m}"
            )
    assert _logs(zf, "learning_rate") == _logs(plain, "learning_rate")  # the same formulas, bitwise
    wa, wb = _weights(plain), _weights(zf)
    assert wa.keys() == wb.keys()
    for n in wa:
        torch.testing.assert_close(wb[n], wa[n], msg=lambda m, n=n: f"{n}: {m}")


# ----------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize(
    "build,sched,warmup,ckpt",
    [
        (tm.llama, "cosine", 0.25, False),
        (tm.qwen2, "constant_with_warmup", 2, True),
        (lambda: tm.llama(tied=False), "linear", 0, False),
    ],
    ids=["llama-cosine", "qwen2-constant_with_warmup-gradient_checkpointing", "llama-untied-linear"],
)
def test_same_losses_and_weights_as_plain_trainer(tmp_path, build, sched, warmup, ckpt):
    torch.manual_seed(0)
    model = build()
    kw = dict(
        lr_scheduler_type=sched, warmup_steps=warmup, eval_strategy="steps", eval_steps=3, gradient_checkpointing=ckpt
    )
    plain = _train(PlainTrainer, copy.deepcopy(model), _args(tmp_path / "plain", **kw), eval_dataset=EVAL)
    zf = _train(zerofit.hf.Trainer, model, _args(tmp_path / "zf", **kw), eval_dataset=EVAL)
    assert zf.state.global_step == plain.state.global_step == 8  # 2 epochs of ceil(7 / 2) steps
    assert len(_logs(zf, "loss")) == 8 and len(_logs(zf, "eval_loss")) == 3
    _assert_same_run(plain, zf)
    assert zf.zerofit_engine.global_step == 8
    # every window of two micro-batches had its forwards made at once ([Note: a window's forwards at once]); the
    # last step of each epoch has one (nothing to gain); the model calls all matched them
    assert zf.zerofit_engine.window_stats == {"announced": 6, "mismatched": 0}
    lrs = [v for _, v in _logs(zf, "learning_rate")]
    assert len(set(lrs)) > 2, lrs  # the schedule moved: a constant lr would not test it
    assert not zf.model.is_gradient_checkpointing  # zerofit checkpoints blocks itself
    assert plain.model.is_gradient_checkpointing == ckpt


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_precision_with_fp32_masters(tmp_path, precision):
    torch.manual_seed(0)
    model = tm.llama()
    ref = _train(PlainTrainer, copy.deepcopy(model), _args(tmp_path / "fp32", max_steps=3))
    zf = _train(zerofit.hf.Trainer, model, _args(tmp_path / precision, max_steps=3, **{precision: True}))
    assert zf.zerofit_engine.config.precision == precision
    assert all(p.dtype == torch.float32 for p in zf.zerofit_engine.module.parameters())
    a, b = [v for _, v in _logs(ref, "loss")], [v for _, v in _logs(zf, "loss")]
    assert a[0] != b[0] and b == pytest.approx(a, rel=2e-2)  # 16-bit rounding, the same training


def test_weight_decay_groups_match_plain_trainer(tmp_path):
    """The Trainer keeps biases and norm weights out of weight decay; zerofit gets the same two groups through
    zerofit.initialize(..., param_groups=...) (needs the engine's parameter groups)."""
    torch.manual_seed(0)
    model = tm.qwen2()
    kw = dict(weight_decay=0.5, max_steps=4)
    plain = _train(PlainTrainer, copy.deepcopy(model), _args(tmp_path / "plain", **kw))
    zf = _train(zerofit.hf.Trainer, model, _args(tmp_path / "zf", **kw))
    _assert_same_run(plain, zf)


def test_subclass_overriding_compute_loss(tmp_path):
    """TRL's trainers override compute_loss: the engine's outputs feed the subclass's own loss, whose gradient the
    engine backpropagates. Here a token-weighted cross-entropy plus a logit penalty, from the logits only."""

    class MyTrainer(PlainTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits = outputs.logits[:, :-1].float()
            target = labels[:, 1:]
            ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
            loss = ce / num_items_in_batch + 1e-3 * logits.pow(2).mean()
            return (loss, outputs) if return_outputs else loss

    Mixed = with_zerofit(MyTrainer)
    assert Mixed.__name__ == "MyTrainer" and Mixed.__mro__[1] is ZerofitTrainerMixin and issubclass(Mixed, MyTrainer)
    assert with_zerofit(Mixed) is Mixed

    class Explicit(ZerofitTrainerMixin, MyTrainer):
        pass

    torch.manual_seed(0)
    model = tm.llama()
    kw = dict(max_steps=5, eval_strategy="steps", eval_steps=5)
    plain = _train(MyTrainer, copy.deepcopy(model), _args(tmp_path / "plain", **kw), eval_dataset=EVAL)
    zf = _train(Mixed, copy.deepcopy(model), _args(tmp_path / "zf", **kw), eval_dataset=EVAL)
    _assert_same_run(plain, zf)
    # the subclass calls the model without the labels: the calls still match the announced micro-batches
    assert zf.zerofit_engine.window_stats == {"announced": 4, "mismatched": 0}  # step 4 ends the epoch: one
    explicit = _train(Explicit, model, _args(tmp_path / "explicit", **dict(kw, max_steps=2)), eval_dataset=EVAL)
    assert _logs(explicit, "loss") == _logs(zf, "loss")[:2]


def test_subclass_that_changes_the_inputs_goes_on_one_forward_at_a_time(tmp_path, caplog):
    """A compute_loss that calls the model with other inputs than the fetched micro-batches: the first announced
    window is dropped at its first call (a warning), the Trainer announces no more, and the run is the plain
    Trainer's with the same subclass."""

    class Shifted(PlainTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = {**inputs, "input_ids": (inputs["input_ids"] + 1) % tm.VOCAB}
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    torch.manual_seed(0)
    model = tm.llama()
    kw = dict(max_steps=3)
    plain = _train(Shifted, copy.deepcopy(model), _args(tmp_path / "plain", **kw))
    with caplog.at_level("WARNING", logger="zerofit"):
        zf = _train(with_zerofit(Shifted), model, _args(tmp_path / "zf", **kw))
    _assert_same_run(plain, zf)
    assert zf.zerofit_engine.window_stats == {"announced": 1, "mismatched": 1}
    assert "other inputs than the next micro-batch" in caplog.text


def test_evaluate_before_training_and_label_smoothing(tmp_path):
    torch.manual_seed(0)
    model = tm.llama()
    kw = dict(label_smoothing_factor=0.1, max_steps=3, eval_strategy="steps", eval_steps=3)
    plain = PlainTrainer(
        model=copy.deepcopy(model),
        args=_args(tmp_path / "plain", **kw),
        train_dataset=TRAIN,
        eval_dataset=EVAL,
        data_collator=default_data_collator,
    )
    zf = zerofit.hf.Trainer(
        model=model,
        args=_args(tmp_path / "zf", **kw),
        train_dataset=TRAIN,
        eval_dataset=EVAL,
        data_collator=default_data_collator,
    )
    before = zf.evaluate()  # builds the engine for the run train() will make
    assert zf.zerofit_engine is not None and zf.zerofit_engine.global_step == 0
    assert before["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-6)
    plain.train()
    zf.train()
    _assert_same_run(plain, zf)
    with pytest.raises(RuntimeError, match="build a new Trainer"):
        zf.train()


# ------------------------------------------------------------------------------------- checkpoints, saving


def test_resume_continues_exactly(tmp_path):
    torch.manual_seed(0)
    model = tm.llama()
    kw = dict(max_steps=6, save_strategy="steps", save_steps=2, save_total_limit=2, num_train_epochs=1)
    full = _train(zerofit.hf.Trainer, copy.deepcopy(model), _args(tmp_path / "full", **kw))
    out = tmp_path / "full"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]  # save_total_limit
    ckpt = out / "checkpoint-4"
    assert (ckpt / "latest").read_text().strip() == "global_step4"
    for name in (
        "global_step4/zerofit_checkpoint.json",
        "model.safetensors",
        "config.json",
        "trainer_state.json",
        "rng_state.pth",
        "training_args.bin",
    ):
        assert (ckpt / name).is_file(), name
    assert not (ckpt / "optimizer.pt").exists() and not (ckpt / "scheduler.pt").exists()

    # a new Trainer, a model with other weights: everything comes from the checkpoint
    torch.manual_seed(123)
    resumed = _train(
        zerofit.hf.Trainer,
        tm.llama(),
        _args(tmp_path / "resumed", **kw),
        train_kwargs={"resume_from_checkpoint": str(ckpt)},
    )
    assert resumed.state.global_step == 6 and resumed.zerofit_engine.global_step == 6
    assert _logs(resumed, "loss")[-2:] == _logs(full, "loss")[-2:]  # steps 5 and 6, bitwise
    assert _logs(resumed, "learning_rate")[-2:] == _logs(full, "learning_rate")[-2:]
    for n, w in _weights(full).items():
        assert torch.equal(_weights(resumed)[n], w), n

    # resume_from_checkpoint=True: the newest checkpoint-N of output_dir
    again = tmp_path / "again"
    shutil.copytree(ckpt, again / "checkpoint-4")
    torch.manual_seed(5)
    latest = _train(zerofit.hf.Trainer, tm.llama(), _args(again, **kw), train_kwargs={"resume_from_checkpoint": True})
    for n, w in _weights(full).items():
        assert torch.equal(_weights(latest)[n], w), n

    # a folder without a zerofit checkpoint is refused before training
    bare = tmp_path / "bare" / "checkpoint-2"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("latest", "global_step*"))
    trainer = zerofit.hf.Trainer(
        model=tm.llama(), args=_args(tmp_path / "bare", **kw), train_dataset=TRAIN, data_collator=default_data_collator
    )
    with pytest.raises(FileNotFoundError, match="no zerofit or DeepSpeed checkpoint"):
        trainer.train(resume_from_checkpoint=str(bare))
    assert trainer.zerofit_engine is None


def test_save_model_round_trip_and_best_model(tmp_path):
    from tests.support.tiny_tokenizer import build_tokenizer

    torch.manual_seed(0)
    kw = dict(
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        learning_rate=0.05,
    )
    tok = build_tokenizer()
    zf = _train(zerofit.hf.Trainer, tm.llama(), _args(tmp_path / "zf", **kw), eval_dataset=EVAL, processing_class=tok)
    evals = dict(_logs(zf, "eval_loss"))
    best_step = min(evals, key=evals.get)
    assert zf.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")
    assert best_step != 4, evals  # the large lr overshoots: loading the best model is visible
    best = AutoModelForCausalLM.from_pretrained(zf.state.best_model_checkpoint)
    trained = zf.zerofit_engine.module  # the best checkpoint's weights were loaded into the engine
    for (n, p), (_, q) in zip(trained.named_parameters(), best.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), n

    out = tmp_path / "exported"
    zf.save_model(str(out))
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.float32
    ids = EVAL[0]["input_ids"][None]
    zf.zerofit_engine.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits)
        assert zf.evaluate()["eval_loss"] == pytest.approx(evals[best_step], rel=1e-6)


# -------------------------------------------------------------------------------------------- deepspeed=


DS_AUTO = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu"},
        "stage3_prefetch_bucket_size": "auto",
        "reduce_bucket_size": "auto",
    },
}


def test_deepspeed_json_trains_like_plain_trainer(tmp_path):
    """A Hugging Face recipe's ZeRO-3 offload JSON without optimizer or scheduler sections: transformers then
    uses the arguments' AdamW and schedule, so the run equals plain Trainer's."""
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS_AUTO))
    torch.manual_seed(0)
    model = tm.llama()
    kw = dict(max_steps=4, warmup_steps=1)
    plain = _train(PlainTrainer, copy.deepcopy(model), _args(tmp_path / "plain", **kw))
    zf = _train(zerofit.hf.Trainer, model, _args(tmp_path / "zf", deepspeed=str(path), **kw))
    assert zf.args.deepspeed == str(path) and zf.args.deepspeed_plugin is None
    cfg = zf.zerofit_engine.config
    assert (cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.gradient_clipping, cfg.precision) == (
        2,
        2,
        0.5,
        "fp32",
    )
    assert (cfg.offload.param_device, cfg.offload.optimizer_device) == ("cpu", "cpu")
    _assert_same_run(plain, zf)


def test_deepspeed_json_sections_filled_from_arguments(tmp_path):
    ds = dict(
        DS_AUTO,
        optimizer={"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        scheduler={
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
    )
    args = _args(
        tmp_path / "zf",
        deepspeed=json.dumps(ds),
        max_steps=3,
        warmup_steps=0.5,
        adam_beta2=0.95,
        adam_epsilon=1e-6,
        weight_decay=0.0,
        bf16=False,
        lr_scheduler_type="polynomial",
        optim="adafactor",
    )
    # optim and lr_scheduler_type are not refused: the JSON's sections replace them, as under DeepSpeed
    zf = _train(zerofit.hf.Trainer, tm.llama(), args)
    cfg = zf.zerofit_engine.config
    assert (cfg.optimizer.lr, cfg.optimizer.betas, cfg.optimizer.eps) == (2e-3, (0.9, 0.95), 1e-6)
    assert (cfg.scheduler.type, cfg.scheduler.total_steps, cfg.scheduler.warmup_steps) == ("WarmupDecayLR", 3, 2)
    assert cfg.scheduler.warmup_max_lr == 2e-3 and cfg.scheduler.warmup_min_lr == 0.0
    assert zf.zerofit_engine.global_step == 3


def test_deepspeed_json_mismatch_and_the_plain_trainer_guard(tmp_path):
    args = _args(tmp_path / "zf", deepspeed=dict(DS_AUTO, gradient_accumulation_steps=4), max_steps=2)
    trainer = zerofit.hf.Trainer(model=tm.llama(), args=args, train_dataset=TRAIN, data_collator=default_data_collator)
    with pytest.raises(ValueError, match=r"ds gradient_accumulation_steps=4 vs hf gradient_accumulation_steps=2"):
        trainer.train()
    assert trainer.state.global_step == 0
    with pytest.raises(UnsupportedArgumentError, match="neither an existing JSON file") as err:
        zerofit.hf.Trainer(
            model=tm.llama(), args=_args(tmp_path / "zf", deepspeed=str(tmp_path / "missing.json")), train_dataset=TRAIN
        )
    assert err.value.field == "deepspeed"
    # deepspeed= was taken over by zerofit: transformers' own Trainer must not silently train without it
    with pytest.raises(ValueError, match="not zerofit's Trainer"):
        PlainTrainer(model=tm.llama(), args=_args(tmp_path / "p", deepspeed=DS_AUTO), train_dataset=TRAIN)


# ------------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "field,value",
    [
        ("torch_compile", True),
        ("optim", "adamw_bnb_8bit"),
        ("optim", "sgd"),
        ("lr_scheduler_type", "polynomial"),
        ("lr_scheduler_kwargs", {"num_cycles": 2}),
        ("neftune_noise_alpha", 5.0),
        ("auto_find_batch_size", True),
        ("bf16_full_eval", True),
        ("use_liger_kernel", True),
        ("debug", "underflow_overflow"),
        ("fsdp", "full_shard"),
    ],
)
def test_refused_arguments_name_the_field(tmp_path, field, value):
    args = _args(tmp_path, **{field: value})
    with pytest.raises(UnsupportedArgumentError, match=re.escape(field)) as err:
        zerofit.hf.Trainer(model=tm.llama(), args=args, train_dataset=TRAIN)
    assert err.value.field == field


def test_refused_trainer_arguments(tmp_path):
    model = tm.llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedArgumentError, match=r"Trainer\(optimizers=") as err:
        zerofit.hf.Trainer(model=model, args=_args(tmp_path), train_dataset=TRAIN, optimizers=(opt, None))
    assert "AdamW" in str(err.value)
    with pytest.raises(UnsupportedArgumentError, match=r"Trainer\(model_init="):
        zerofit.hf.Trainer(model_init=lambda: tm.llama(), args=_args(tmp_path), train_dataset=TRAIN)
    # frozen parameters are no longer refused: tests/integration/test_frozen.py trains them against the plain Trainer


def test_every_training_arguments_field_has_a_status():
    from zerofit.hf.arguments import FIELDS, HONOURED, MAPPED, NOT_APPLICABLE, REFUSED, TRAINER

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert names == set(FIELDS), names ^ set(FIELDS)
    assert {s for s, _ in FIELDS.values()} <= {HONOURED, MAPPED, TRAINER, NOT_APPLICABLE, REFUSED}
    doc = (ROOT / "docs" / "hf_trainer.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (\S+) \|", doc, flags=re.M))
    assert rows == {n: s for n, (s, _) in FIELDS.items()}, "docs/hf_trainer.md's table is FIELDS (regenerate it)"


def test_a_field_zerofit_does_not_know_is_refused_unless_default(tmp_path, monkeypatch):
    """What a newer transformers' new field meets: refused when set, accepted at its default."""
    from zerofit.hf import arguments

    monkeypatch.delitem(arguments.FIELDS, "logging_first_step")
    with pytest.raises(UnsupportedArgumentError, match="logging_first_step=True: zerofit.hf does not know") as err:
        zerofit.hf.Trainer(model=tm.llama(), args=_args(tmp_path, logging_first_step=True), train_dataset=TRAIN)
    assert err.value.field == "logging_first_step"
    zerofit.hf.Trainer(model=tm.llama(), args=_args(tmp_path), train_dataset=TRAIN)


def test_torchrun_two_ranks_like_the_plain_trainer_with_ddp(tmp_path):
    """`torchrun --nproc-per-node 2` of a Trainer script (gloo, CPU): zerofit.hf.Trainer on 2 ranks logs the
    losses and gradient norms the plain Trainer logs with DDP in the same ranks, and ends with its weights
    (docs/ranks.md)."""
    import os
    import subprocess

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
    }
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = tmp_path / "run"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(ROOT / "tests" / "support" / "hf_ranks_script.py"),
            str(out),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    for r in (0, 1):
        res = torch.load(f"{out}.{r}", weights_only=False)
        assert res["world"] == 2
        # several ranks announce no windows: a window one rank dropped would desynchronize their collectives
        assert res["windows"] == {"announced": 0, "mismatched": 0}
        plain, zf = res["logs"]["plain"], res["logs"]["zerofit"]
        assert [s for s, _, _ in zf] == [s for s, _, _ in plain] and len(zf) == 4
        torch.testing.assert_close(torch.tensor([x[1:] for x in zf]), torch.tensor([x[1:] for x in plain]))
        for n, w in res["weights"]["plain"].items():
            torch.testing.assert_close(res["weights"]["zerofit"][n], w, msg=lambda m, r=r, n=n: f"rank {r} {n}: {m}")


def test_the_trainers_optimizer_and_schedule_report_what_each_group_gets():
    """The Trainer's optimizer and scheduler are the engine's one torch.optim-shaped view: each parameter group's
    lr, betas, eps and weight decay as the engine applies them ([Note: group learning rates]), the same as the
    DeepSpeed door reports (engine.optimizer), before and after steps; with groups of their own lr too."""
    from zerofit.hf.trainer import EngineOptimizer, EngineSchedule

    torch.manual_seed(0)
    model = tm.qwen2()
    names = [n for n, _ in model.named_parameters()]
    own = [n for n in names if "down_proj" in n]
    groups = [
        {"params": [n for n in names if n not in own], "weight_decay": 0.1},
        {"params": own, "lr": 4e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)},
    ]
    cfg = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
        "scheduler": {"type": "hf_linear", "warmup_steps": 2, "total_steps": 10},
    }
    engine = zerofit.initialize(model, cfg, param_groups=groups)
    opt, sched = EngineOptimizer(engine, model), EngineSchedule(engine)
    batch = [{"input_ids": torch.randint(0, tm.VOCAB, (2, 16)), "labels": torch.randint(0, tm.VOCAB, (2, 16))}]
    for step in range(4):
        factor = step / 2 if step < 2 else (10 - step) / 8  # hf_linear: warm up 2 steps, decay to step 10
        want = [1e-3 * factor, 4e-3 * factor]
        got = opt.param_groups
        assert [g["lr"] for g in got] == pytest.approx(want, rel=1e-12)
        ds = engine.optimizer.param_groups
        for g, d, w in zip(got, ds, (0.1, 0.0)):
            assert (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) == (
                d["lr"],
                tuple(d["betas"]),
                d["eps"],
                d["weight_decay"],
            )
            assert g["weight_decay"] == w
        assert sched.get_last_lr() == [g["lr"] for g in ds] == engine.get_lr()
        engine.train_batch(batch)
        sched.step()
    engine.close()


def test_seq2seq_trainer_on_an_encoder_decoder_in_the_hooked_mode(tmp_path):
    """``with_zerofit(Seq2SeqTrainer)`` over T5 with its blocks streamed in the hooked mode ([Note: the hooked mode],
    engine/model/hooked.py; ``zerofit_config``): targets shorter than the inputs, masked in part, clipped; the same
    losses, norms and weights as transformers' own Seq2SeqTrainer."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4)
    cfg.decoder_start_token_id = cfg.pad_token_id = 0
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    data = []
    for _ in range(9):
        labels = torch.randint(1, 128, (6,), generator=g)
        labels[4:] = -100
        data.append({"input_ids": torch.randint(1, 128, (10,), generator=g), "labels": labels})
    runs = []
    for cls, m, out in ((Seq2SeqTrainer, ref, "plain"), (with_zerofit(Seq2SeqTrainer), model, "zf")):
        args = _args(tmp_path / out, Seq2SeqTrainingArguments, num_train_epochs=1)
        kw = {"zerofit_config": {"adapter": "hooked", "hooked_units": ["T5Block"]}} if out == "zf" else {}
        with _no_deepspeed() if out == "zf" else contextlib.nullcontext():
            trainer = cls(model=m, args=args, train_dataset=data, data_collator=default_data_collator, **kw)
            trainer.train()
        runs.append(trainer)
    plain, zf = runs
    assert zf.zerofit_engine.adapter.hooked and len(zf.zerofit_engine.blocks) == 4
    _assert_same_run(plain, zf)
