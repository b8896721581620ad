"""DeepSpeedExamples' training scripts, ported into this folder (each file's docstring: upstream path, commit, and
exactly which lines were replaced and why), run with the one change docs/migration.md names:
``import zerofit.deepspeed.alias`` added as the script's first line (the test writes that copy), or no change at
all through the ``zerofit deepspeed`` launcher. Each runs in its own process (the real DeepSpeed is installed and
imported in this one), on the CPU, under record.py, which watches zerofit's engine from outside (the model at
``initialize``, each training call's inputs, each loss given to ``backward``). The test checks the exit status
0, and compares the losses with the same training written in plain PyTorch (torch.optim.AdamW, clipping by
``clip_grad_norm_``) and, for the learning rate, DeepSpeed 0.19.8's own ``WarmupLR`` stepping that optimizer.

The scripts run as DeepSpeed's launcher starts a rank (``deepspeed script.py``): RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in the environment (cifar10 reads LOCAL_RANK itself); ``zerofit deepspeed`` sets them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.slow  # each case runs a script in a process of its own (tens of seconds)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
ALIAS = "import zerofit.deepspeed.alias  # the one change: `deepspeed` is zerofit's from here on\n"
LAUNCH_ENV = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29511",
}


def run_port(
    name: str, args: list[str], work: Path, launcher: bool = False, files=("standins.py",), launcher_args: tuple = ()
) -> SimpleNamespace:
    """Run the ported script ``name`` in ``work`` (its own process) with the one change (``launcher``: none,
    through ``zerofit deepspeed``); what record.py saw, the exit status and the output."""
    work.mkdir(parents=True, exist_ok=True)
    for f in files:
        src = HERE / f
        (shutil.copytree(src, work / f, dirs_exist_ok=True) if src.is_dir() else shutil.copy(src, work / f))
    text = (HERE / name).read_text()
    script = Path(name).name
    (work / script).write_text(text if launcher else ALIAS + text)
    out = work / "recorded"
    cmd = [sys.executable, str(HERE / "record.py"), str(out)]
    cmd += ["--launcher", *launcher_args, script, *args] if launcher else [script, *args]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}", "PYTHONUNBUFFERED": "1"}
    env.pop("DS_ACCELERATOR", None)
    if not launcher:
        env.update(LAUNCH_ENV)
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    rec = SimpleNamespace(
        rc=r.returncode,
        stdout=r.stdout,
        stderr=r.stderr,
        output=r.stdout + r.stderr,
        losses=json.loads((out / "losses.json").read_text()) if (out / "losses.json").exists() else None,
    )
    if (out / "initial.pt").exists():
        rec.initial = torch.load(out / "initial.pt")
        rec.calls = torch.load(out / "calls.pt")
    return rec


def _ok(rec) -> None:
    assert rec.rc == 0, f"exit status {rec.rc}:\n{rec.output[-6000:]}"


def _real_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")
    return pytest.importorskip("deepspeed")


def _import_port(name: str):
    """The ported module itself (for its model class), imported here with the real DeepSpeed."""
    _real_deepspeed()
    sys.path.insert(0, str(HERE))
    try:
        import importlib

        return importlib.import_module(name)
    finally:
        sys.path.remove(str(HERE))


# ---------------------------------------------------------------------------------------------- cifar10


def _cifar_reference(initial: dict, data: Path, epochs: int) -> list[float]:
    """cifar10_deepspeed.py's training in plain PyTorch: its Net from the same weights, DeepSpeed's loader order
    (a DistributedSampler over one rank, seed 0, the same order every epoch), AdamW with the config's settings,
    clipping at 1.0, and DeepSpeed 0.19.8's WarmupLR stepped after each optimizer step."""
    from deepspeed.runtime.lr_schedules import WarmupLR
    from torch.utils.data import DataLoader, DistributedSampler

    port = _import_port("cifar10_deepspeed")
    import standins

    net = port.Net(SimpleNamespace(moe=False))
    net.load_state_dict(initial["model"])
    transform = standins.transforms.Compose(
        [standins.transforms.ToTensor(), standins.transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))]
    )
    trainset = standins.datasets.CIFAR10(root=str(data), train=True, transform=transform)
    loader = DataLoader(trainset, batch_size=16, sampler=DistributedSampler(trainset, num_replicas=1, rank=0))
    opt = torch.optim.AdamW(net.parameters(), lr=0.001, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    sched = WarmupLR(opt, warmup_min_lr=0, warmup_max_lr=0.001, warmup_num_steps=1000)
    losses = []
    for _ in range(epochs):
        for inputs, labels in loader:
            loss = torch.nn.CrossEntropyLoss()(net(inputs), labels)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
    return losses


def test_cifar10_deepspeed_runs_with_the_alias_line_and_matches_plain_pytorch(tmp_path):
    sys.path.insert(0, str(HERE))
    import standins

    sys.path.remove(str(HERE))

    work = tmp_path / "cifar"
    standins.write_cifar10(work / "data")
    rec = run_port("cifar10_deepspeed.py", ["--epochs", "2", "--dtype", "fp32", "--log-interval", "1"], work)
    _ok(rec)
    assert "Finished Training" in rec.stdout and "Accuracy of the network on the 20 test images" in rec.stdout
    assert len(rec.losses) == 8  # 64 images, train_batch_size 16, 2 epochs
    want = _cifar_reference(rec.initial, work / "data", epochs=2)
    torch.testing.assert_close(torch.tensor(rec.losses), torch.tensor(want), rtol=1e-6, atol=1e-6)
    assert rec.losses[-1] != rec.losses[3]  # the weights moved (WarmupLR's first two steps have lr 0)


def test_cifar10_deepspeed_runs_unchanged_through_the_launcher_in_bf16(tmp_path):
    sys.path.insert(0, str(HERE))
    import standins

    sys.path.remove(str(HERE))

    work = tmp_path / "cifar"
    standins.write_cifar10(work / "data")
    rec = run_port(
        "cifar10_deepspeed.py",
        ["--epochs", "1", "--dtype", "bf16"],
        work,
        launcher=True,
        launcher_args=("--num_gpus", "1"),
    )
    _ok(rec)
    assert "zerofit deepspeed: running cifar10_deepspeed.py" in rec.stderr and "Finished Training" in rec.stdout
    want = _cifar_reference(rec.initial, work / "data", epochs=1)
    # bf16 compute against the fp32 reference: the same training at bf16's resolution
    torch.testing.assert_close(torch.tensor(rec.losses), torch.tensor(want), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------- offload_states


def _simple_reference(
    port, start: dict, calls: list, hidden_dim: int, nlayers: int, lr: float, dtype=torch.float32
) -> list[float]:
    """A script's SimpleModel trained in plain PyTorch on the batches its engine got: AdamW with DeepSpeed's
    Adam defaults (betas (0.9, 0.999), eps 1e-8, weight decay 0, decoupled), clipping at DeepSpeed's default 1.0."""
    model = port.SimpleModel(hidden_dim, nlayers=nlayers)
    model.load_state_dict(start, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for inputs, kwargs in calls:
        x, y = inputs
        loss = model(x.to(dtype), y, **kwargs)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "dtype,extra",
    [("torch.float32", ["--pin_memory"]), ("torch.bfloat16", ["--included_state", "optim_states", "--non_blocking"])],
)
def test_offload_states_runs_with_the_alias_line(tmp_path, dtype, extra):
    """Each iteration: a step, offload_states(), reload_states() (the memory assertions where the device is not the
    host); the training through them is plain PyTorch's on the same batches."""
    args = ["--hidden_dim", "16", "--nlayers", "2", "--iteration", "4", "--warmup", "1", "--dtype", dtype, *extra]
    rec = run_port("offload_states.py", args, tmp_path / "offload", files=())
    _ok(rec)
    assert rec.stdout.count("Memory usage (") == 4 and "Summary: pin_memory=" in rec.stdout
    assert (tmp_path / "offload" / "offload_states.log").read_text().count("\n") == 1
    port = _import_port("offload_states")
    want = _simple_reference(port, rec.initial["start"], rec.calls, 16, 2, lr=1e-6)
    tol = 1e-6 if dtype == "torch.float32" else 2e-2
    torch.testing.assert_close(torch.tensor(rec.losses), torch.tensor(want), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------- HelloDeepSpeed


def _assert_moved_alike(start: dict, final: dict, want: dict, least: float, rel: float = 3e-2) -> None:
    """What training moved each weight by, as the plain PyTorch reference moved it: in bf16 the two round their
    forwards and gradients apart, so each tensor's update agrees to ``rel`` of its norm (not element by element:
    an Adam update near zero can take either sign); and training moved something (``least``)."""
    for n, w in want.items():
        got, ref = final[n] - start[n], w - start[n]
        assert (got - ref).norm() <= rel * ref.norm() + 1e-7, (n, (got - ref).norm().item(), ref.norm().item())
    assert max((final[n] - start[n]).abs().max().item() for n in want) > least


_BERT_SIZES = [
    "--num_layers",
    "2",
    "--num_heads",
    "2",
    "--ff_dim",
    "32",
    "--h_dim",
    "16",
    "--max_seq_length",
    "32",
    "--batch_size",
    "4",
    "--dropout",
    "0",
    "--log_every",
    "1",
]


def _bert_reference(port, initial: dict, calls: list) -> dict[str, torch.Tensor]:
    """train_bert_ds.py's training in plain PyTorch, in bf16 as its config says: fp32 master weights (the
    model's, from the same state) copied into a bf16 copy of the model for each forward and backward, the bf16
    gradients taken back in fp32, clipped at DeepSpeed's default 1.0, AdamW with DeepSpeed's Adam defaults (lr
    1e-4 from the config, weight decay 0). The master weights at the end, by name."""
    import copy

    model = port.create_model(num_layers=2, num_heads=2, ff_dim=32, h_dim=16, dropout=0.0)
    model.load_state_dict(initial["model"])
    master = dict(model.named_parameters())
    low = copy.deepcopy(model).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.values(), lr=1e-4, weight_decay=0.0)
    for inputs, batch in calls:
        with torch.no_grad():
            for n, p in low.named_parameters():
                p.copy_(master[n])
        low.zero_grad()
        low(*inputs, **batch).backward()
        for n, p in low.named_parameters():  # (the encoder's pooler takes no part in the loss: no gradient)
            master[n].grad = None if p.grad is None else p.grad.float()
        torch.nn.utils.clip_grad_norm_(master.values(), 1.0)
        opt.step()
    return {n: p.detach() for n, p in master.items()}


def test_hello_deepspeed_trains_saves_and_resumes(tmp_path):
    """train_bert_ds.py with the alias line: four steps, checkpoints every two (save_checkpoint with its
    client_state), the weights those steps reach as plain PyTorch's; then the same script unchanged through
    ``zerofit deepspeed --load_checkpoint_dir``: load_checkpoint restores those weights exactly, its client_state
    gives the step to go on from, and training goes on."""
    sys.path.insert(0, str(HERE))
    import standins

    sys.path.remove(str(HERE))

    work = tmp_path / "bert"
    work.mkdir()
    cwd = os.getcwd()
    try:
        os.chdir(work)
        standins.write_wikitext("data")
        standins.write_roberta_like_tokenizer("tok")
    finally:
        os.chdir(cwd)
    first = run_port(
        "train_bert_ds.py",
        [
            "--checkpoint_dir",
            "ckpt",
            "--tokenizer",
            "tok",
            "--num_iterations",
            "5",
            "--checkpoint_every",
            "2",
            *_BERT_SIZES,
        ],
        work,
    )
    _ok(first)
    assert len(first.losses) == 4 and first.output.count("Loss: ") == 4
    (exp_dir,) = (work / "ckpt").iterdir()
    assert (exp_dir / "latest").read_text().strip() == "global_step4"
    assert sorted(p.name for p in exp_dir.iterdir() if p.name.startswith("global_step")) == [
        "global_step2",
        "global_step4",
    ]
    port = _import_port("train_bert_ds")
    want = _bert_reference(port, first.initial, first.calls)
    start, final = first.initial["start"], first.initial["final"]
    _assert_moved_alike(start, final, want, least=1e-5)

    second = run_port(
        "train_bert_ds.py",
        ["--load_checkpoint_dir", str(exp_dir), "--num_iterations", "8", "--log_every", "1"],
        work,
        launcher=True,
    )
    _ok(second)
    loaded = second.initial["loaded"]
    assert all(torch.equal(loaded[n], final[n]) for n in final)
    # the last save (after the loop stopped at step 5) holds checkpoint_step 5: steps 6 and 7 follow
    assert len(second.losses) == 2 and second.output.count("Loss: ") == 2
    assert all(0 < loss < 12 for loss in second.losses)


# ---------------------------------------------------------------------------------------------- DeepSpeed-Chat

_DSCHAT_ARGS = [
    "--data_path",
    "local/jsonfile",
    "--data_split",
    "10,0,0",
    "--data_output_path",
    "data_files",
    "--model_name_or_path",
    "sft_base",
    "--per_device_train_batch_size",
    "2",
    "--per_device_eval_batch_size",
    "2",
    "--max_seq_len",
    "32",
    "--learning_rate",
    "1e-3",
    "--num_train_epochs",
    "1",
    "--gradient_accumulation_steps",
    "2",
    "--lr_scheduler_type",
    "cosine",
    "--num_warmup_steps",
    "1",
    "--zero_stage",
    "2",
    "--dtype",
    "bf16",
    "--print_loss",
    "--output_dir",
    "out_model",
]


def _dschat_inputs(work: Path) -> None:
    """A tiny fp32 Llama with a GPT-2-style tokenizer (vocab.json and merges.txt, as a downloaded OPT or GPT-2 has
    them: dschat's save_hf_format calls tokenizer.save_vocabulary, which needs the vocabulary files), and
    local/jsonfile data (data/train.json, data/eval.json: prompt, chosen, rejected)."""
    sys.path.insert(0, str(ROOT))
    from tests.support.model_dirs import make_model_dir

    sys.path.remove(str(ROOT))

    base = make_model_dir(work / "sft_base", dtype=torch.float32)
    tok = json.loads((base / "tokenizer.json").read_text())
    config = json.loads((base / "tokenizer_config.json").read_text())
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    (base / "vocab.json").write_text(json.dumps(tok["model"]["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    (base / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (base / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "GPT2Tokenizer", **{k: config[k] for k in ("bos_token", "eos_token", "pad_token")}}
        )
    )
    (work / "data").mkdir()
    for name, n in (("train", 16), ("eval", 4)):
        rows = [
            {
                "prompt": f"Human: what is {i} plus {i}? Assistant:",
                "chosen": f"It is {2 * i}.",
                "rejected": f"It is {i}.",
            }
            for i in range(n)
        ]
        (work / "data" / f"{name}.json").write_text(json.dumps(rows))


def _dschat_reference(initial: dict, calls: list, model_dir: Path) -> dict[str, torch.Tensor]:
    """Step 1's training in plain PyTorch, bf16 as its config says (as _bert_reference): the same batches, loss / 2
    accumulated over the 2 micro-batches of a step, clipping at 1.0 (dschat's get_train_ds_config), AdamW with
    main.py's settings (lr 1e-3, betas (0.9, 0.95), weight decay 0 for both of its groups), transformers'
    cosine schedule with 1 warm-up step over the 4 steps."""
    import copy

    from transformers import AutoModelForCausalLM, get_scheduler

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.resize_token_embeddings(int(8 * -(-model.config.vocab_size // 8)))
    model.load_state_dict(initial["model"])
    master = dict(model.named_parameters())
    low = copy.deepcopy(model).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.values(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=1, num_training_steps=4)
    for i, (inputs, batch) in enumerate(calls):
        with torch.no_grad():
            for n, p in low.named_parameters():
                p.copy_(master[n])
        if i % 2 == 0:
            low.zero_grad()
        (low(*inputs, **batch).loss / 2).backward()
        if i % 2 == 1:
            for n, p in low.named_parameters():
                master[n].grad = None if p.grad is None else p.grad.float()
            torch.nn.utils.clip_grad_norm_(master.values(), 1.0)
            opt.step()
            sched.step()
    return {n: p.detach() for n, p in master.items()}


def test_deepspeed_chat_step1_sft_runs_with_the_alias_line(tmp_path):
    """DeepSpeed-Chat's step-1 main.py (its dschat.utils beside it) with the alias line: the evaluation pass,
    FusedAdam over its parameter groups with transformers' get_scheduler passed as lr_scheduler, an epoch of the
    tutorial loop (engine(**batch, use_cache=False), backward, step, engine.model for its throughput print,
    engine.tput_timer.update_epoch_count()), the evaluation again and save_hf_format; the weights as plain
    PyTorch's."""
    work = tmp_path / "dschat"
    shutil.copytree(HERE / "dschat_step1" / "dschat", work / "dschat")
    _dschat_inputs(work)
    # --local_rank 0: what DeepSpeed's launcher passes (main.py initializes torch.distributed only with it)
    rec = run_port("dschat_step1/main.py", ["--local_rank", "0", *_DSCHAT_ARGS], work, files=())
    _ok(rec)
    assert len(rec.losses) == 8 and rec.stdout.count("Epoch: 0, Step: ") == 8
    assert rec.stdout.count("ppl: ") == 2 and "saving the final model ..." in rec.stdout
    want = _dschat_reference(rec.initial, rec.calls, work / "sft_base")
    start, final = rec.initial["start"], rec.initial["final"]
    _assert_moved_alike(start, final, want, least=1e-3)
    saved = torch.load(work / "out_model" / "pytorch_model.bin")
    assert all(torch.equal(saved[n], final[n]) for n in final)
