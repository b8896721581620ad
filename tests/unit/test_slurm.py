"""[Note: srun is a launcher too] (src/zerofit/engine/distributed/slurm.py): SLURM's variables as torchrun's."""

from __future__ import annotations

import pytest

from zerofit.engine.distributed import slurm


@pytest.mark.parametrize(
    "nodelist,first",
    [
        ("node7", "node7"),
        ("gpu[03-05,09],cpu1", "gpu03"),
        ("a-b[1,3]", "a-b1"),
        ("c[010-012]", "c010"),
        ("x1,x2", "x1"),
    ],
)
def test_the_first_host_of_a_node_list(nodelist, first):
    assert slurm.first_host(nodelist) == first


def test_the_tasks_on_this_node():
    assert slurm.tasks_on_this_node({"SLURM_NTASKS_PER_NODE": "8"}) == 8
    spec = {"SLURM_TASKS_PER_NODE": "4(x2),3"}
    assert [slurm.tasks_on_this_node({**spec, "SLURM_NODEID": str(n)}) for n in range(3)] == [4, 4, 3]
    assert slurm.tasks_on_this_node({}) is None


def test_srun_variables_become_torchruns_and_set_ones_stay():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "3",
        "SLURM_TASKS_PER_NODE": "4",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "123456",
    }
    assert slurm.adopt(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07",
    }
    assert env["MASTER_PORT"] == str(15000 + 123456 % 20000)
    torchrun = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "RANK": "2", "WORLD_SIZE": "8"}  # torchrun inside srun
    assert not slurm.adopt(torchrun) and torchrun["RANK"] == "2" and "MASTER_ADDR" not in torchrun
    one = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}  # one task: nothing to make
    assert not slurm.adopt(one) and "RANK" not in one
    mine = {**env, "MASTER_PORT": "29999"}
    del mine["RANK"]
    assert slurm.adopt(mine) and mine["MASTER_PORT"] == "29999"
