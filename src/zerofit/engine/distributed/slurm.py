"""SLURM's launch as torchrun's environment (one node).

[Note: srun is a launcher too]
``srun --ntasks-per-node N python train.py`` starts N processes with SLURM's variables (``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_JOB_NODELIST``, ``SLURM_JOB_ID``) and none of
torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), which
the engine's process group reads (``env://``). :func:`adopt` fills the missing torchrun variables from SLURM's
before the group is made, as Lightning's SLURMEnvironment and DeepSpeed's launcher do: the rank is the task's, the
rendezvous host is the first host of the job's node list (SLURM's compressed form, ``node[01-04,07]``, expanded),
the port ``MASTER_PORT`` if the job sets it, else one derived from the job id (every task of the job computes the
same). Variables already set (a torchrun inside srun, or the user's own) are left as they are. A job over several
nodes is then refused by the ranks' own check (the host state is one host's).
"""

from __future__ import annotations

import os
import re

__all__ = ["adopt", "first_host", "tasks_on_this_node"]

_PORT_BASE, _PORT_SPAN = 15000, 20000


def first_host(nodelist: str) -> str:
    """The first host of SLURM's node list: ``"gpu[03-05,09],cpu1"`` -> ``"gpu03"``, zero padding kept."""
    nodelist = nodelist.strip()
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if m is None:
        raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r}: not a node list")
    prefix, ranges = m.group(1), m.group(3)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def tasks_on_this_node(env) -> int | None:
    """The tasks SLURM runs on this node: ``SLURM_NTASKS_PER_NODE``, else this node's entry of
    ``SLURM_TASKS_PER_NODE`` (``"4(x2),3"``: 4 on each of the first two nodes, then 3), else None."""
    if env.get("SLURM_NTASKS_PER_NODE"):
        return int(env["SLURM_NTASKS_PER_NODE"])
    spec = env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    node = int(env.get("SLURM_NODEID", "0"))
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(\(x(\d+)\))?", part.strip())
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(3) or 1)
    return counts[node] if node < len(counts) else None


def adopt(env=None) -> bool:
    """Under ``srun`` without torchrun's variables, set them from SLURM's (the Note); whether it did."""
    env = os.environ if env is None else env
    if "SLURM_PROCID" not in env or "RANK" in env or int(env.get("SLURM_NTASKS", "1")) <= 1:
        return False
    world = int(env["SLURM_NTASKS"])
    local = tasks_on_this_node(env)
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = str(world)
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    env.setdefault("LOCAL_WORLD_SIZE", str(local if local is not None else world))
    env.setdefault("MASTER_ADDR", first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
    env.setdefault("MASTER_PORT", str(_PORT_BASE + int(env.get("SLURM_JOB_ID", "0")) % _PORT_SPAN))
    return True
