"""DeepSpeed's submodules under zerofit: a DeepSpeed script runs with one change (an alias line, or the launcher).

With ``import zerofit.deepspeed.alias`` (in a subprocess: this process's ``sys.modules`` stays clean, and the
real DeepSpeed is installed here) every ``import deepspeed`` / ``from deepspeed.<path> import ...`` is
zerofit's module itself, never the real DeepSpeed's; ``zerofit deepspeed script.py`` runs an unmodified
DeepSpeed-shaped script (written here) as DeepSpeed's launcher runs one rank. In this process, without the
alias: ``FusedAdam`` / ``DeepSpeedCPUAdam`` are torch's AdamW bitwise, stepped by hand and as the client
optimizer of ``deepspeed.initialize``; ``get_accelerator()``, ``deepspeed.comm``, ``deepspeed.moe.utils``,
``deepspeed.utils``, ``deepspeed.runtime.utils`` and ``deepspeed.zero``'s enums answer as DeepSpeed 0.19.8's
do on the CPU (CUDA where a GPU is); what zerofit does not provide is refused by name.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging import version

import zerofit.deepspeed as zds
from tests.support import tiny_models as tm
from zerofit.deepspeed import DeepSpeedUnsupported, UnsupportedAttribute, UnsupportedModule
from zerofit.deepspeed import accelerator as acc_module
from zerofit.deepspeed import comm as dist
from zerofit.deepspeed.launcher import plan
from zerofit.deepspeed.moe.utils import (
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)
from zerofit.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
_CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0}


def _python(code_or_args: list[str], cwd: Path | None = None, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **env}
    full_env.pop("DS_ACCELERATOR", None)
    return subprocess.run(
        [sys.executable, *code_or_args], cwd=cwd or ROOT, env=full_env, capture_output=True, text=True, timeout=240
    )


def _llama_groups(model, wd: float) -> list[dict]:
    """DeepSpeed-Chat's get_optimizer_grouped_parameters: decay for weights, none for norms."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if "norm" not in n], "weight_decay": wd},
        {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0},
    ]


# ---------------------------------------------------------------------------------------------- the alias

_ALIAS_CHECKS = r"""
import importlib, json, sys, types
import torch
import zerofit.deepspeed.alias as alias
import deepspeed
import zerofit.deepspeed as zds
from deepspeed.accelerator import get_accelerator
from deepspeed import get_accelerator as top_get_accelerator
from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam
from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam as CPUAdam2
import deepspeed.comm as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer, is_moe_param
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.compression.helper import recursive_getattr, recursive_setattr
from deepspeed.utils import logger, log_dist
from deepspeed.runtime.utils import see_memory_usage
from deepspeed import DeepSpeedEngine
from zerofit.deepspeed.names import zerofit_module

out = {"deepspeed_is_zerofit": deepspeed is zds, "spec": deepspeed.__spec__.name,
       "version": deepspeed.__version__, "accelerator": type(get_accelerator()).__name__,
       "same_get_accelerator": get_accelerator is top_get_accelerator, "cpu_adam_same": CPUAdam2 is DeepSpeedCPUAdam,
       "runtime_zero_is_zero": deepspeed.runtime.zero is deepspeed.zero,
       "attr_chain": deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.NOT_AVAILABLE.name,
       "ranks": [dist.get_rank(), dist.get_world_size()], "same": {}, "refused": {}}
for name in ("deepspeed.accelerator", "deepspeed.comm", "deepspeed.comm.comm", "deepspeed.ops", "deepspeed.ops.adam",
             "deepspeed.ops.adam.fused_adam", "deepspeed.moe", "deepspeed.moe.utils", "deepspeed.runtime",
             "deepspeed.runtime.utils", "deepspeed.runtime.engine", "deepspeed.runtime.lr_schedules",
             "deepspeed.runtime.zero",
             "deepspeed.runtime.zero.partition_parameters", "deepspeed.zero", "deepspeed.utils",
             "deepspeed.utils.logging", "deepspeed.compression.helper"):
    m = importlib.import_module(name)
    out["same"][name] = m is importlib.import_module(zerofit_module(name)) and m.__spec__.name == zerofit_module(name)
for stmt in ("import deepspeed.ops.lamb", "from deepspeed.moe.layer import MoE",
             "import deepspeed.utils.zero_to_fp32", "from deepspeed.runtime.config import DeepSpeedConfig",
             "import deepspeed.accelerator.real_accelerator"):
    try:
        exec(stmt)
        out["refused"][stmt] = None
    except ImportError as e:
        out["refused"][stmt] = [type(e).__name__, str(e)]
out["loaded"] = sorted(n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed."))
out["real_deepspeed_files"] = [n for n, m in list(sys.modules.items())
                               if "site-packages/deepspeed" in str(getattr(m, "__file__", "") or "")]
# Hugging Face's save_pretrained unwraps the model with accelerate's extract_model_from_parallel, which imports
# deepspeed.DeepSpeedEngine whenever DeepSpeed is installed (it is, here): under the alias, zerofit's
from accelerate.utils import extract_model_from_parallel
plain = torch.nn.Linear(2, 2)
out["unwrap"] = extract_model_from_parallel(plain) is plain
alias.uninstall()
out["after_uninstall"] = [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]
sys.modules["deepspeed"] = types.ModuleType("deepspeed")        # stands for the real DeepSpeed, imported first
try:
    alias.install()
    out["install_after_real"] = None
except ImportError as e:
    out["install_after_real"] = str(e)
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow  # a subprocess that imports torch and accelerate: 8-16 s on 2 busy cores
def test_alias_makes_every_deepspeed_import_zerofits_and_never_the_real_one():
    r = _python(["-c", _ALIAS_CHECKS])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    assert out["deepspeed_is_zerofit"] and out["spec"] == "zerofit.deepspeed"  # zerofit's own spec restored
    assert out["version"] == "0.19.8+zerofit"
    assert out["accelerator"] == ("CUDA_Accelerator" if CUDA else "CPU_Accelerator")
    assert out["same_get_accelerator"] and out["cpu_adam_same"] and out["runtime_zero_is_zero"]
    assert out["attr_chain"] == "NOT_AVAILABLE" and out["ranks"] == [0, 1]
    assert all(out["same"].values()), out["same"]
    for stmt, err in out["refused"].items():
        assert err is not None and err[0] == "UnsupportedModule", (stmt, err)
        assert "zerofit's deepspeed has no module deepspeed." in err[1], err[1]
    assert "FusedAdam" in out["refused"]["import deepspeed.ops.lamb"][1]
    assert "get_accelerator" in out["refused"]["import deepspeed.accelerator.real_accelerator"][1]
    assert "deepspeed.comm" in out["loaded"] and "deepspeed.runtime.zero" in out["loaded"]
    assert out["real_deepspeed_files"] == []  # the real DeepSpeed (installed here) was never read
    assert out["unwrap"]
    assert out["after_uninstall"] == []
    assert "imported already" in out["install_after_real"] and "zerofit.deepspeed.alias" in out["install_after_real"]


# ---------------------------------------------------------------------------------------------- the launcher

_MODEL = '''
class TinyLM(torch.nn.Module):
    """An embedding, residual MLP blocks, a head; forward(input_ids, labels) returns the loss."""

    def __init__(self, vocab=64, d=16, n=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d),
                                                              torch.nn.GELU(), torch.nn.Linear(2 * d, d))
                                          for _ in range(n))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def batches(steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        yield {"input_ids": ids, "labels": ids}


def groups_of(model):
    """DeepSpeed-Chat's get_optimizer_grouped_parameters: weight decay on the matrices, none on norms and biases."""
    return [{"params": [p for p in model.parameters() if p.ndim == 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim != 2], "weight_decay": 0.0}]
'''

_SCRIPT = (
    r'''
"""A DeepSpeed training script, as DeepSpeedExamples write them: nothing in it names zerofit."""
import argparse, json, logging, os, sys
import torch
from packaging import version
import deepspeed
import deepspeed.comm as dist
from deepspeed import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import log_dist
'''
    + _MODEL
    + r"""
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--offload", action="store_true")
parser.add_argument("--out", required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
assert version.parse(deepspeed.__version__) >= version.parse("0.9"), deepspeed.__version__
if args.local_rank == -1:
    device = torch.device(get_accelerator().device_name())
else:
    get_accelerator().set_device(args.local_rank)
    device = torch.device(get_accelerator().device_name(), args.local_rank)
    deepspeed.init_distributed()
args.global_rank = torch.distributed.get_rank()
torch.distributed.barrier()
get_accelerator().manual_seed_all(0)

Adam = DeepSpeedCPUAdam if args.offload else FusedAdam         # DeepSpeed-Chat's choice
torch.manual_seed(0)
model = TinyLM()
groups = split_params_into_different_moe_groups_for_optimizer(groups_of(model))
z3 = [p for p in model.parameters() if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
assert z3 == []
optimizer = Adam(groups, lr=1e-3, betas=(0.9, 0.95))
engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, args=args, dist_init_required=True)
assert isinstance(engine, deepspeed.DeepSpeedEngine)
losses = []
for step, batch in enumerate(batches(3)):
    batch = {k: v.to(device) for k, v in batch.items()}
    loss = engine(**batch)
    engine.backward(loss)
    engine.step()
    buf = torch.tensor([loss.item()], device=get_accelerator().current_device_name())
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    log_dist(f"step {step} loss {buf.item()}", ranks=[0], level=logging.WARNING)
    losses.append(loss.item())
engine.destroy()
dist.barrier()
json.dump({"losses": losses, "optimizer": Adam.__name__, "argv": sys.argv[1:], "name": deepspeed.__name__,
           "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR",
                                                  "MASTER_PORT")},
           "rank": dist.get_rank(), "world": dist.get_world_size()}, open(args.out, "w"))
"""
)


def _script_model_adamw_losses() -> list[float]:
    """The script's training in this process, with torch.optim.AdamW as the client optimizer (on the device the
    script's engine takes: the config's default, a GPU where there is one)."""
    space = {"torch": torch}
    exec(_MODEL, space)
    torch.manual_seed(0)
    model = space["TinyLM"]()
    opt = torch.optim.AdamW(space["groups_of"](model), lr=1e-3, betas=(0.9, 0.95))
    engine, *_ = zds.initialize(model=model, optimizer=opt, config={**_CFG, "zero_optimization": {"stage": 2}})
    try:
        losses = []
        for batch in space["batches"](3):
            loss = engine(**batch)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses
    finally:
        engine.close()


def _engine_run(make_optimizer, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """zerofit.deepspeed.initialize with ``make_optimizer(groups)`` as the client optimizer: the per-step
    losses and the final weights."""
    torch.manual_seed(0)
    model = tm.llama(layers=2)
    engine, *_ = zds.initialize(
        model=model, optimizer=make_optimizer(_llama_groups(model, 0.1)), config=_CFG, device="cpu"
    )
    try:
        losses = [loss.item() for loss in tm.ds_losses(engine, [mbs[0] for mbs in tm.batches(steps, 1)])]
        return losses, {k: v.clone() for k, v in engine.module.state_dict().items()}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def adamw_run():
    """The engine given a torch.optim.AdamW (the reference the DeepSpeed classes must equal bitwise)."""
    return _engine_run(lambda g: torch.optim.AdamW(g, lr=1e-3, betas=(0.9, 0.95)))


def _torch_adamw_losses(steps: int) -> list[float]:
    """The same training with torch.optim.AdamW, the textbook loop."""
    torch.manual_seed(0)
    model = tm.llama(layers=2)
    opt = torch.optim.AdamW(_llama_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
    losses = []
    for mbs in tm.batches(steps, 1):
        opt.zero_grad()
        loss = model(**mbs[0]).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow  # a subprocess: torch, zerofit and a training run, 15-40 s on 2 busy cores
def test_launcher_runs_an_unmodified_deepspeed_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps({**_CFG, "zero_optimization": {"stage": 2}}))
    out = tmp_path / "out.json"
    r = _python(
        [
            "-m",
            "zerofit.cli",
            "deepspeed",
            "--num_gpus",
            "1",
            str(script),
            "--deepspeed",
            "--deepspeed_config",
            "ds.json",
            "--offload",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())
    assert got["name"] == "zerofit.deepspeed" and got["rank"] == 0 and got["world"] == 1
    assert got["argv"] == [
        "--local_rank=0",
        "--deepspeed",
        "--deepspeed_config",
        "ds.json",
        "--offload",
        "--out",
        str(out),
    ]
    assert got["env"] == {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    assert got["optimizer"] == "DeepSpeedCPUAdam"
    assert got["losses"] == _script_model_adamw_losses()  # bitwise: torch.optim.AdamW's settings, fp32
    assert "[Rank 0] step 2 loss" in r.stdout  # log_dist through DeepSpeed's logger
    assert "running" in r.stderr and "rank 0 of 1" in r.stderr


def test_launcher_passes_the_scripts_exit_status_and_error(tmp_path):
    """The launcher in a process of its own (in this one, real DeepSpeed may be imported already, and the alias
    refuses to shadow it): the script's own exit status, and its own traceback."""
    code = (
        "import sys; from zerofit.deepspeed import alias; from zerofit.deepspeed.launcher import main\n"
        "try:\n    sys.exit(main(sys.argv[1:]))\nfinally:\n    alias.uninstall(); assert not alias.installed()\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_SIZE",
            "CROSS_RANK",
            "CROSS_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    exits, fails = tmp_path / "exits.py", tmp_path / "fails.py"
    exits.write_text("import os, sys\nprint(sys.argv[1:], os.environ['RANK'], sys.path[0])\nsys.exit(3)\n")
    fails.write_text("def f():\n    raise ValueError('boom')\nf()\n")
    r = subprocess.run(
        [sys.executable, "-c", code, "-q", str(exits), "--x"], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 3, r.stderr
    assert r.stdout == f"['--local_rank=0', '--x'] 0 {tmp_path}\n"
    r = subprocess.run(
        [sys.executable, "-c", code, "-q", "--no_local_rank", str(fails)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert f'Traceback (most recent call last):\n  File "{fails}"' in r.stderr and "ValueError: boom" in r.stderr


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--num_gpus", "2", "t.py"], "--num_gpus 2: zerofit deepspeed runs the script in one process"),
        (["--num_nodes", "2", "t.py"], "--num_nodes 2"),
        (["--include", "localhost:0,1", "t.py"], "2 GPUs"),
        (["--include", "worker-1:0", "t.py"], "--include worker-1:0"),
        (["--hostfile", "hosts", "t.py"], "--hostfile"),
        (["--force_multi", "t.py"], "--force_multi"),
        (["--no_python", "t.py"], "--no_python"),
        (["--autotuning", "tune", "t.py"], "zerofit estimate"),
        (["--enable_each_rank_log", "logs", "t.py"], "--enable_each_rank_log"),
    ],
)
def test_launcher_refuses_several_processes_by_name(argv, match):
    with pytest.raises(DeepSpeedUnsupported, match=match):
        plan(argv)


def test_cli_subcommand_refuses_by_name_with_exit_2_and_has_the_launchers_help():
    from typer.testing import CliRunner

    from zerofit.cli import app

    r = CliRunner().invoke(app, ["deepspeed", "--num_gpus", "2", "train.py", "--deepspeed_config", "ds.json"])
    assert r.exit_code == 2 and "--num_gpus 2: zerofit deepspeed runs the script in one process" in r.output
    r = CliRunner().invoke(app, ["deepspeed", "--help"])
    assert r.exit_code == 0 and "usage: zerofit deepspeed" in r.output and "--num_gpus" in r.output
    assert "deepspeed" in CliRunner().invoke(app, ["--help"]).output


def test_launcher_options_as_deepspeeds_runner_reads_them():
    p = plan(
        [
            "--num_gpus",
            "1",
            "--num_nodes",
            "1",
            "--include",
            "localhost:1",
            "--master_port",
            "29600",
            "--no_ssh",
            "train.py",
            "--num_gpus",
            "4",
            "--lr",
            "1e-4",
        ]
    )
    assert p.script == "train.py" and not p.module
    assert p.argv == ["--local_rank=0", "--num_gpus", "4", "--lr", "1e-4"]  # after the script: the script's
    assert p.env["CUDA_VISIBLE_DEVICES"] == "1" and p.env["MASTER_PORT"] == "29600" and p.env["WORLD_SIZE"] == "1"
    p = plan(["--no_local_rank", "--module", "pkg.train"])
    assert p.module and p.script == "pkg.train" and p.argv == [] and "CUDA_VISIBLE_DEVICES" not in p.env


# ---------------------------------------------------------------------------------------------- ops.adam


def _step_by_hand(opt_factory, steps: int = 4) -> list[torch.Tensor]:
    """``steps`` optimizer steps on random gradients, two groups (weight decay on the matrices only)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    named = list(model.named_parameters())
    opt = opt_factory(
        [
            {"params": [p for n, p in named if p.ndim == 2], "weight_decay": 0.1},
            {"params": [p for n, p in named if p.ndim == 1], "weight_decay": 0.0},
        ]
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "make",
    [
        lambda groups: FusedAdam(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-6),
        lambda groups: DeepSpeedCPUAdam(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-6),
    ],
    ids=["FusedAdam", "DeepSpeedCPUAdam"],
)
def test_adam_classes_step_as_torch_adamw_bitwise(make):
    want = _step_by_hand(lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.9, 0.95), eps=1e-6))
    got = _step_by_hand(make)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_adam_w_mode_false_is_torch_adam_with_l2():
    want = _step_by_hand(lambda g: torch.optim.Adam(g, lr=1e-2))
    assert all(
        torch.equal(a, b) for a, b in zip(_step_by_hand(lambda g: FusedAdam(g, lr=1e-2, adam_w_mode=False)), want)
    )
    assert all(
        torch.equal(a, b) for a, b in zip(_step_by_hand(lambda g: DeepSpeedCPUAdam(g, lr=1e-2, adamw_mode=False)), want)
    )
    # DeepSpeed's defaults: no weight decay (torch.optim.AdamW's is 0.01)
    assert FusedAdam(torch.nn.Linear(2, 2).parameters()).param_groups[0]["weight_decay"] == 0.0


def test_adam_classes_refuse_what_neither_torch_nor_zerofit_does():
    params = list(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(DeepSpeedUnsupported, match=r"FusedAdam\(amsgrad=True\)"):
        FusedAdam(params, amsgrad=True)
    with pytest.raises(RuntimeError, match="AMSGrad"):  # DeepSpeed raises a RuntimeError for it
        DeepSpeedCPUAdam(params, amsgrad=True)
    with pytest.raises(DeepSpeedUnsupported, match="bias_correction=False"):
        FusedAdam(params, bias_correction=False)
    with pytest.raises(DeepSpeedUnsupported, match="bias_correction=False"):
        DeepSpeedCPUAdam([{"params": params, "bias_correction": False}])
    with pytest.raises(DeepSpeedUnsupported, match="fp32_optimizer_states=False"):
        DeepSpeedCPUAdam(params, fp32_optimizer_states=False)
    with pytest.raises(RuntimeError, match="call step\\(\\) with no arguments"):
        FusedAdam(params).step(scale=2.0)


def test_adam_classes_as_client_optimizer_train_as_torch_adamw(adamw_run):
    """Through zerofit.deepspeed.initialize: FusedAdam and DeepSpeedCPUAdam give the engine their groups and
    hyperparameters exactly as a torch.optim.AdamW does: losses and final weights bitwise those of the engine
    given torch.optim.AdamW (which follows the textbook torch.optim.AdamW loop at fp32 rounding); Adam with L2
    weight decay (adam_w_mode=False, weight_decay > 0) is refused by name."""
    ref_losses, ref_weights = adamw_run
    torch.testing.assert_close(torch.tensor(ref_losses), torch.tensor(_torch_adamw_losses(3)), rtol=1.3e-6, atol=0)
    for make in (
        lambda g: FusedAdam(g, lr=1e-3, betas=(0.9, 0.95)),
        lambda g: DeepSpeedCPUAdam(g, lr=1e-3, betas=(0.9, 0.95)),
    ):
        losses, weights = _engine_run(make)
        assert losses == ref_losses
        assert weights.keys() == ref_weights.keys() and all(torch.equal(weights[k], ref_weights[k]) for k in weights)

    model = tm.llama(layers=2)
    with pytest.raises(DeepSpeedUnsupported, match=r"FusedAdam\.param_groups\[0\]: Adam with weight_decay=0\.1"):
        zds.initialize(
            model=model, optimizer=FusedAdam(_llama_groups(model, 0.1), adam_w_mode=False), config=_CFG, device="cpu"
        )


# ---------------------------------------------------------------------------------------------- accelerator


@pytest.fixture
def fresh_accelerator(monkeypatch):
    monkeypatch.setattr(acc_module, "_accelerator", None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    yield acc_module
    acc_module._accelerator = None


def test_cpu_accelerator_answers_as_deepspeeds(fresh_accelerator, monkeypatch):
    import psutil

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("LOCAL_RANK", "0")
    a = fresh_accelerator.get_accelerator()
    assert type(a).__name__ == "CPU_Accelerator" and a is fresh_accelerator.get_accelerator()
    assert (a.device_name(), a.device_name(0), a.current_device_name(), a.current_device()) == ("cpu", "cpu", "cpu", 0)
    assert a.device_count() == 1 and a.is_available() and a.communication_backend_name() == "gloo"
    assert a.device(0) is None and a.Stream is None and a.Event is None and a.current_stream() is None
    assert a.set_device(0) is None and a.synchronize() is None and a.empty_cache() is None
    assert a.is_bf16_supported() and torch.float in a.supported_dtypes() and a.is_synchronized_device()
    with a.stream(None):
        pass
    a.manual_seed_all(123)
    x = torch.randn(4)
    a.manual_seed(123)
    assert torch.equal(torch.randn(4), x) and a.initial_seed() == 123
    rss = psutil.Process().memory_info().rss
    current = a.memory_allocated()
    assert abs(current - rss) < 64 << 20 and a.max_memory_allocated() >= current
    a.reset_peak_memory_stats()
    stats = a.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0
    assert a.total_memory() == psutil.virtual_memory().total
    t = torch.ones(3)
    assert a.on_accelerator(t) and a.pin_memory(t) is t and a.pin_empty(2, 3, dtype=torch.bfloat16).shape == (2, 3)
    assert a.FloatTensor is torch.FloatTensor and a.lazy_call(lambda: 7) == 7
    env = {}
    a.set_visible_devices_envs(env, [2])
    assert env == {"CUDA_VISIBLE_DEVICES": "2"}
    for name in ("create_op_builder", "op_builder_dir", "amp"):
        with pytest.raises(UnsupportedAttribute, match=f"zerofit's accelerator has no {name}"):
            getattr(a, name)
    assert not hasattr(a, "amp")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_cuda_accelerator_answers_as_deepspeeds(fresh_accelerator):
    a = fresh_accelerator.get_accelerator()
    assert type(a).__name__ == "CUDA_Accelerator"
    assert (a.device_name(), a.device_name(0)) == ("cuda", "cuda:0")
    a.set_device(0)
    assert a.current_device() == 0 and a.current_device_name() == "cuda:0"
    assert a.device_count() == torch.cuda.device_count() and a.communication_backend_name() == "nccl"
    assert a.device(0) == torch.device("cuda", 0) and a.Stream is torch.cuda.Stream and a.Event is torch.cuda.Event
    x = torch.ones(1 << 20, device="cuda")
    assert a.memory_allocated() == torch.cuda.memory_allocated() >= x.numel() * 4
    assert a.max_memory_allocated() == torch.cuda.max_memory_allocated()
    assert 0 < a.available_memory() <= a.total_memory() == torch.cuda.get_device_properties(0).total_memory
    assert a.on_accelerator(x) and not a.on_accelerator(x.cpu())
    assert a.pin_memory(torch.ones(4)).is_pinned() and a.pin_empty(8, dtype=torch.float).is_pinned()
    a.manual_seed_all(5)
    y = torch.randn(4, device="cuda")
    a.manual_seed(5)
    assert torch.equal(torch.randn(4, device="cuda"), y)
    s = a.Stream()
    with a.stream(s):
        z = x * 2
    a.synchronize()
    assert float(z[0]) == 2.0 and a.BFloat16Tensor([1.0]).device.type == "cuda"


def test_accelerator_choice_follows_ds_accelerator(fresh_accelerator, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    a = fresh_accelerator.get_accelerator()
    assert type(a).__name__ == "CUDA_Accelerator" and a.is_available() == CUDA  # as DeepSpeed: asked for, built
    fresh_accelerator._accelerator = None
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(DeepSpeedUnsupported, match="DS_ACCELERATOR='xpu'"):
        fresh_accelerator.get_accelerator()
    with pytest.raises(DeepSpeedUnsupported, match="set_accelerator"):
        fresh_accelerator.set_accelerator(object())


# ---------------------------------------------------------------------------------------------- comm


def test_comm_is_torch_distributed_for_one_process(monkeypatch):
    import torch.distributed as tdist

    assert not tdist.is_initialized()
    monkeypatch.setenv("LOCAL_RANK", "0")
    dev = "cuda" if CUDA else "cpu"  # nccl with a GPU (as DeepSpeed), gloo on the CPU
    try:
        assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == (0, 1, 0)  # no group needed
        assert not dist.is_initialized()
        dist.barrier()  # a collective makes the one-process group, as initialize() would
        assert dist.is_initialized() and tdist.get_world_size() == 1 and tdist.get_rank() == 0
        assert tdist.get_backend() == ("nccl" if CUDA else "gloo")
        x = torch.arange(4.0, device=dev)
        dist.all_reduce(x, op=dist.ReduceOp.SUM, log_name="sum", prof=False)  # DeepSpeed's keywords too
        dist.all_reduce(x, op=tdist.ReduceOp.MAX)
        assert torch.equal(x, torch.arange(4.0, device=dev))
        out = [torch.zeros(4, device=dev)]
        dist.all_gather(out, x)
        assert torch.equal(out[0], x)
        flat = torch.zeros(4, device=dev)
        dist.all_gather_into_tensor(flat, x)
        assert torch.equal(flat, x)
        dist.broadcast(x, src=0)
        assert dist.get_global_rank(None, 0) == 0 and dist.get_all_ranks_from_group() == [0]
        objs = [None]
        dist.all_gather_object(objs, {"a": 1})
        assert objs == [{"a": 1}]
        for name in ("send", "batch_isend_irecv", "log_summary", "configure"):
            with pytest.raises(UnsupportedAttribute, match=f"zerofit's deepspeed.comm has no {name}"):
                getattr(dist, name)
        with pytest.raises(ValueError, match="UNUSED"):
            dist.all_reduce(x, op=dist.ReduceOp.UNUSED)
    finally:
        dist.destroy_process_group()
    assert not tdist.is_initialized()


# ---------------------------------------------------------------------------------------------- the rest


def test_moe_helpers_return_plain_groups_as_deepspeed():
    model = tm.llama(layers=1)
    params = list(model.parameters())
    groups = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "parameters"})
    assert len(groups) == 1 and groups[0]["name"] == "parameters" and groups[0]["params"] == params
    chat = _llama_groups(model, 0.1)
    same = split_params_into_different_moe_groups_for_optimizer(chat)
    assert same is chat and [g["weight_decay"] for g in same] == [0.1, 0.0]
    assert not any(is_moe_param(p) for p in params) and has_moe_layers(model) == (False, 0)
    params[0].allreduce = False  # what DeepSpeed's MoE layer marks an expert parameter with
    try:
        with pytest.raises(DeepSpeedUnsupported, match="expert parameters"):
            split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "p"})
    finally:
        del params[0].allreduce
    with pytest.raises(UnsupportedAttribute, match="zerofit's deepspeed.moe has no layer: .*--moe"):
        _ = zds.moe.layer


def test_zero_names_scripts_touch():
    from zerofit.deepspeed.zero import offload_config, partition_parameters

    assert zds.zero.ZeroParamStatus is partition_parameters.ZeroParamStatus
    assert partition_parameters.GatheredParameters is zds.zero.GatheredParameters
    assert partition_parameters.Init is zds.zero.Init
    assert [s.name for s in partition_parameters.ZeroParamStatus] == ["AVAILABLE", "NOT_AVAILABLE", "INFLIGHT"]
    assert offload_config.OffloadDeviceEnum.cpu == "cpu"
    assert [e.name for e in offload_config.OffloadStateTypeEnum] == [
        "optim_states",
        "hp_params",
        "lp_params",
        "lp_grads",
        "contiguous_grad_buffer",
    ]
    with pytest.raises(UnsupportedAttribute, match="deepspeed.zero has no TiledLinear"):
        _ = zds.zero.TiledLinear


def test_utils_logger_log_dist_and_helpers(capsys):
    from zerofit.deepspeed.compression.helper import recursive_getattr, recursive_setattr
    from zerofit.deepspeed.runtime.utils import see_memory_usage
    from zerofit.deepspeed.utils import RepeatingLoader, log_dist, logger

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append((record.levelno, record.getMessage()))
    logger.addHandler(handler)
    try:
        assert logger.name == "DeepSpeed" and logger.level == logging.WARNING and not logger.propagate
        log_dist("quiet", ranks=[0])  # INFO: below DeepSpeed's default level
        log_dist("hello", ranks=[0], level=logging.WARNING)
    finally:
        logger.removeHandler(handler)
    assert seen == [(logging.WARNING, "[Rank -1] hello")]  # no process group: every rank logs, as -1
    assert list(zip(range(5), RepeatingLoader([1, 2]))) == [(0, 1), (1, 2), (2, 1), (3, 2), (4, 1)]
    model = tm.llama(layers=1)
    mlp = recursive_getattr(model, "model.layers.0.mlp")
    assert mlp is model.model.layers[0].mlp
    recursive_setattr(model, "model.layers.0.mlp", torch.nn.Identity())
    assert isinstance(model.model.layers[0].mlp, torch.nn.Identity)
    see_memory_usage("before", force=False)
    see_memory_usage("after", force=True)
    printed = capsys.readouterr().out
    assert "before" not in printed and "after\nMA " in printed and "CPU Virtual Memory:  used = " in printed


def test_version_passes_deepspeed_version_checks():
    v = version.parse(zds.__version__)
    assert v >= version.parse("0.9") and v >= version.parse("0.19.8") and v < version.parse("0.19.9")
    assert v.release == (0, 19, 8) and v.local == "zerofit"
    assert (zds.__version_major__, zds.__version_minor__, zds.__version_patch__) == (0, 19, 8)
    assert zds.HAS_TRITON is False


def test_deepspeed_engine_is_the_type_of_zerofits_engines():
    engine, *_ = zds.initialize(model=tm.llama(layers=1), config={"train_micro_batch_size_per_gpu": 2}, device="cpu")
    try:
        assert isinstance(engine, zds.DeepSpeedEngine) and not isinstance(engine.module, zds.DeepSpeedEngine)
        assert issubclass(type(engine), zds.DeepSpeedEngine) and not issubclass(torch.nn.Module, zds.DeepSpeedEngine)
    finally:
        engine.close()
    with pytest.raises(DeepSpeedUnsupported, match="deepspeed.initialize"):
        zds.DeepSpeedEngine()


@pytest.mark.parametrize(
    "where, name, match",
    [
        (zds, "init_inference", "engine.module"),
        (zds, "PipelineModule", "one process"),
        (zds, "checkpointing", "activation_checkpointing"),
        (zds, "inference", "engine.module"),
        (zds.ops, "lamb", "FusedAdam"),
        (zds.ops, "DeepSpeedTransformerLayer", "does not replace"),
        (zds.ops.adam, "ZenFlowCPUAdam", "AdamW"),
        (zds.runtime, "config", "ZerofitConfig"),
        (zds.utils, "safe_get_full_fp32_param", "engine.module"),
        (zds.utils, "set_z3_leaf_modules", "drop the call"),
        (zds.utils, "groups", "one process"),
        (zds.runtime.utils, "clip_grad_norm_", "gradient_clipping"),
    ],
)
def test_names_without_an_equivalent_are_refused_by_name(where, name, match):
    with pytest.raises(UnsupportedAttribute, match=f"has no {name}: .*{match}"):
        getattr(where, name)
    assert not hasattr(where, name)


def test_unsupported_modules_are_import_errors_naming_themselves():
    from zerofit.deepspeed.names import unsupported_module

    err = unsupported_module("deepspeed.ops.lamb.fused_lamb")
    assert isinstance(err, ImportError) and isinstance(err, DeepSpeedUnsupported) and isinstance(err, UnsupportedModule)
    assert err.name == "deepspeed.ops.lamb.fused_lamb" and "FusedAdam" in str(err)  # the package's hint
    assert "docs/migration.md" in str(unsupported_module("deepspeed.something_new"))
