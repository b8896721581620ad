"""``zerofit deepspeed train.py ...``: DeepSpeed's launcher for one process, with the script unchanged.

::

    zerofit deepspeed train.py --deepspeed_config ds.json          # where DeepSpeed has `deepspeed train.py ...`
    zerofit deepspeed --num_gpus 1 train.py --deepspeed --deepspeed_config ds.json
    zerofit deepspeed --module mypkg.train --lr 1e-4

The script runs in this process, after ``zerofit.deepspeed.alias`` is installed, so its ``import deepspeed``
and ``from deepspeed.<path> import ...`` lines are zerofit's. It runs as DeepSpeed's launcher runs one rank
(deepspeed/launcher/runner.py and launch.py, 0.19.8): the environment has ``RANK=0``, ``LOCAL_RANK=0``,
``WORLD_SIZE=1``, ``LOCAL_SIZE=1``, ``CROSS_RANK=0``, ``CROSS_SIZE=1``, ``MASTER_ADDR`` and ``MASTER_PORT``;
the script's arguments are ``--local_rank=0`` (unless ``--no_local_rank``) followed by the user's; and, as
with ``python train.py``, ``sys.argv[0]`` is the script and ``sys.path[0]`` its folder (``--module``: the
working directory, as ``python -m``). The exit status is the script's.

The launcher's own options, before the script, are DeepSpeed's. Accepted: ``--num_gpus`` /
``--num_accelerators`` and ``--num_nodes`` of 1 (or left out), ``--node_rank 0``, ``--include localhost`` or
``localhost:K`` (one GPU: ``CUDA_VISIBLE_DEVICES=K``, as DeepSpeed sets it), ``--master_addr``,
``--master_port``, ``--module``, ``--no_local_rank``, ``--log_level`` / ``--quiet``; and the options that only
say how other nodes are reached (``--launcher``, ``--launcher_args``, ``--no_ssh``, ``--no_ssh_check``,
``--ssh_port``, ``--venv_script``), which have no effect on one node, as in DeepSpeed. Refused by name: more
than one process (``--num_gpus`` or ``--num_nodes`` above 1, several ``--include`` slots, ``--hostfile``,
``--force_multi``, ``--exclude``), and ``--no_python``, ``--save_pid``, ``--enable_each_rank_log``,
``--autotuning``, ``--bind_cores_to_rank`` / ``--bind_core_list``. zerofit.deepspeed trains in one process:
where DeepSpeed's launcher would start one process per GPU (``--num_gpus`` left out on a machine of
several), this one starts one and says so.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from dataclasses import dataclass, field

from zerofit.engine.faces.deepspeed_names import DeepSpeedUnsupported

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
_ONE = (
    "zerofit deepspeed runs the script in one process (zerofit.deepspeed.initialize trains on one GPU, in one process)"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zerofit deepspeed",
        allow_abbrev=False,
        description="Run a DeepSpeed training script unchanged, in one process: its "
        "`import deepspeed` is zerofit's (zerofit.deepspeed.alias).",
    )
    one = p.add_argument_group("one process (DeepSpeed's launcher options)")
    one.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1, help="1 (or leave it out)")
    one.add_argument("--num_nodes", type=int, default=-1, help="1 (or leave it out)")
    one.add_argument("--node_rank", type=int, default=-1, help="0 (or leave it out)")
    one.add_argument("-i", "--include", default="", help="localhost or localhost:K (the GPU to use)")
    one.add_argument("--master_addr", default="", help="MASTER_ADDR (default 127.0.0.1)")
    one.add_argument("--master_port", type=int, default=TORCH_DISTRIBUTED_DEFAULT_PORT, help="MASTER_PORT")
    one.add_argument("--module", action="store_true", help="run the script as a module, as python -m")
    one.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=0 to the script")
    one.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    one.add_argument("-q", "--quiet", action="store_true", help="print nothing of the launcher's own")
    for name in ("--launcher", "--launcher_args", "--venv_script"):
        one.add_argument(name, default=None, help="no effect on one node")
    one.add_argument("--ssh_port", type=int, default=None, help="no effect on one node")
    for name in ("--no_ssh", "--no_ssh_check"):
        one.add_argument(name, action="store_true", help="no effect on one node")
    refused = p.add_argument_group("refused (several processes, or not this launcher's)")
    refused.add_argument("-H", "--hostfile", default=None)
    refused.add_argument("-e", "--exclude", default="")
    refused.add_argument("--bind_core_list", default=None)
    refused.add_argument("--enable_each_rank_log", default=None)
    refused.add_argument("--autotuning", default="")
    for name in ("--force_multi", "--no_python", "--save_pid", "--bind_cores_to_rank"):
        refused.add_argument(name, action="store_true")
    p.add_argument("user_script", help="the training script (a module name with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


@dataclass(frozen=True)
class Launch:
    """What :func:`main` runs: the script or module, its argv and the environment it adds."""

    script: str
    module: bool
    argv: list[str]  # sys.argv[1:] of the script
    env: dict[str, str] = field(default_factory=dict)
    quiet: bool = False


def plan(argv: list[str]) -> Launch:
    """Read the launcher's options (DeepSpeed's); refuse what needs several processes, by name."""
    a = _parser().parse_args(argv)
    if a.num_gpus not in (-1, 1):
        raise DeepSpeedUnsupported(f"--num_gpus {a.num_gpus}: {_ONE}; pass --num_gpus 1 or leave it out")
    if a.num_nodes not in (-1, 1):
        raise DeepSpeedUnsupported(f"--num_nodes {a.num_nodes}: {_ONE}; pass --num_nodes 1 or leave it out")
    if a.node_rank not in (-1, 0):
        raise DeepSpeedUnsupported(f"--node_rank {a.node_rank}: {_ONE}; the one node is node 0")
    for flag, value in (("--hostfile", a.hostfile), ("--exclude", a.exclude), ("--force_multi", a.force_multi)):
        if value:
            raise DeepSpeedUnsupported(
                f"{flag}: {_ONE} on this host; pick its GPU with --include localhost:K (or CUDA_VISIBLE_DEVICES=K)"
            )
    for flag, value, instead in (
        ("--no_python", a.no_python, "it runs Python scripts in its own process; run other programs yourself"),
        ("--save_pid", a.save_pid, "the script runs in the launcher's process: its pid is the launcher's"),
        ("--enable_each_rank_log", a.enable_each_rank_log, "redirect the output yourself (... > train.log)"),
        ("--autotuning", a.autotuning, "`zerofit estimate` prints the plan zerofit would choose"),
        (
            "--bind_cores_to_rank",
            a.bind_cores_to_rank or a.bind_core_list,
            "bind with numactl or taskset around `zerofit deepspeed`",
        ),
    ):
        if value:
            raise DeepSpeedUnsupported(f"{flag}: zerofit deepspeed does not do this; {instead}")
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_SIZE": "1",
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "MASTER_ADDR": a.master_addr or "127.0.0.1",
        "MASTER_PORT": str(a.master_port),
    }
    if a.include:
        env["CUDA_VISIBLE_DEVICES"] = _one_slot(a.include)
    argv_out = ([] if a.no_local_rank else ["--local_rank=0"]) + list(a.user_args)
    return Launch(a.user_script, a.module, argv_out, env, quiet=a.quiet or a.log_level in ("error", "critical"))


def _one_slot(include: str) -> str:
    host, _, slots = include.partition(":")
    if "@" in include or host not in ("localhost", "127.0.0.1"):
        raise DeepSpeedUnsupported(f"--include {include}: {_ONE} on this host; pass --include localhost:K")
    ids = [s for s in slots.split(",") if s]
    if len(ids) > 1:
        raise DeepSpeedUnsupported(
            f"--include {include}: {len(ids)} GPUs; {_ONE}; pass one, --include localhost:{ids[0]}"
        )
    if not ids:
        return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    if not ids[0].isdigit():
        raise ValueError(f"--include {include}: a GPU slot is a number (localhost:0)")
    return ids[0]


def _status(code) -> int:
    """sys.exit's argument as a process exit status (None: 0; a message: printed, 1)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    """Run the script as one DeepSpeed rank, with ``deepspeed`` aliased to zerofit's; its exit status."""
    launch = plan(argv)
    os.environ.update(launch.env)
    if not launch.quiet:
        what = f"module {launch.script}" if launch.module else launch.script
        print(
            f"zerofit deepspeed: running {what} in this process (rank 0 of 1); `import deepspeed` is zerofit.deepspeed",
            file=sys.stderr,
        )
        _note_other_gpus(launch)
    path = None if launch.module else os.path.abspath(launch.script)
    if path is not None and not os.path.isfile(path):
        raise FileNotFoundError(f"zerofit deepspeed: no script at {launch.script!r} ({path})")
    import zerofit.deepspeed.alias as alias

    alias.install()
    sys.argv = [launch.script, *launch.argv]
    sys.path[0:1] = [os.getcwd() if path is None else os.path.dirname(path)]  # as python -m / python script.py
    try:
        if path is None:
            runpy.run_module(launch.script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        return _status(e.code)
    except KeyboardInterrupt as e:
        _print_script_error(e)
        return 130
    except Exception as e:
        _print_script_error(e)
        return 1
    return 0


def _print_script_error(exc: BaseException) -> None:
    """The traceback as ``python train.py`` prints it: from the script's frame on (no launcher, no runpy)."""
    tb = exc.__traceback__
    while (
        tb is not None
        and tb.tb_next is not None
        and (tb.tb_frame.f_code.co_filename == __file__ or "runpy" in tb.tb_frame.f_code.co_filename)
    ):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def _note_other_gpus(launch: Launch) -> None:
    """Say so where DeepSpeed's launcher would start several processes. Counted without touching CUDA (a
    script may still set CUDA_VISIBLE_DEVICES before it imports torch)."""
    if "CUDA_VISIBLE_DEVICES" in launch.env:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        n = (
            len([d for d in visible.split(",") if d.strip()])
            if visible is not None
            else len(os.listdir("/proc/driver/nvidia/gpus"))
        )
    except OSError:
        n = 0
    if n > 1:
        print(
            f"zerofit deepspeed: {n} GPUs are visible; DeepSpeed's launcher would start one process per GPU, "
            "zerofit starts one, which uses the config's device (cuda: the first); --include localhost:K picks "
            "another",
            file=sys.stderr,
        )
