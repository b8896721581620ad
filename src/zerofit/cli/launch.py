"""``zerofit train --gpus N [--nnodes M --node-rank i --master-addr A --master-port P]``: the same command again
under torchrun, on this host or as one node of several (docs/ranks.md)."""

from __future__ import annotations

import subprocess
import sys

LAUNCH_OPTIONS = ("--gpus", "--nnodes", "--node-rank", "--master-addr", "--master-port")


def relaunch(
    gpus: int, nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: int = 29500
) -> int:
    """This command again under torchrun, ``gpus`` ranks on this host (the process group comes from its
    environment: docs/ranks.md); with ``nnodes`` > 1, this host as node ``node_rank`` of a run that meets at
    ``master_addr:master_port`` (each node runs the same command with its own --node-rank). Returns torchrun's
    exit status (non-zero when any rank failed)."""
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a in LAUNCH_OPTIONS:
            skip = True
            continue
        if not a.startswith(tuple(f"{o}=" for o in LAUNCH_OPTIONS)):
            argv.append(a)
    where = (
        ["--standalone"]
        if nnodes == 1
        else [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
        ]
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc-per-node={gpus}",
        "-m",
        "zerofit.cli",
        *argv,
    ]
    return subprocess.call(cmd)
