"""Launchers and several nodes on the CPU (gloo): accelerate's and Lightning's launches of the user's loop, srun,
torchrun's restarts, `zerofit doctor --inter-node`, and 2 simulated nodes of 2 ranks each ([Note: nodes hold the
state whole], src/zerofit/engine/distributed/ranks.py: each node its own torchrun variables and host arenas) against
plain
PyTorch on the global batch. Apart from test_ranks.py (whose launch helpers and references they use) so that the
two several-process modules run on the two test workers at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.processes.test_ranks import (
    _PLACEMENTS,
    ROOT,
    SCRIPT,
    STEPS,
    G,
    _cfg,
    _check,
    _check_fp16_like_one_process,
    _check_local_means,
    _collect,
    _ok,
    _one_process_then_save,
    _port,
    _reference,
    _run_spec,
    launch,
)
from tests.support import tiny_models as tm

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict:
    """A launcher's environment: this one without torchrun's variables, one thread, src/ and the root importable."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    )
    return env


def test_the_accelerate_loop_under_accelerate_launch(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (on a machine without a GPU: accelerate's MULTI_CPU over
    gloo, through torchrun) of the accelerate loop over `zerofit.fsdp`, unchanged: both ranks exit 0 and train the
    global batch as plain PyTorch does."""
    out = tmp_path / "out.pt"
    spec = {"G": G, **_run_spec("accelerate-loop"), "out": str(out)}
    env = _env()
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_port()),
        str(SCRIPT),
        json.dumps(spec),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    result = _collect(out, 2)
    assert result is not None, p.stderr[-3000:]
    _check_local_means(result, 2)


@pytest.mark.parametrize("kind", ["", "fabric-"], ids=["trainer", "fabric"])
def test_a_lightning_module_on_two_ranks_trains_as_lightnings_own_ddp(tmp_path, kind):
    """``Trainer(strategy="ddp", devices=2)`` under torchrun, the model wrapped in ``configure_model`` (the one change):
    Lightning leaves the module unwrapped (no DDP: the engine averages over the ranks), accumulation, clipping and the
    lr scheduler as written; the losses and weights of the same module under Lightning's own DDP, to fp32 rounding
    (DDP's all-reduce and torch's per-parameter clip norm against the engine's average and FSDP's norm). Fabric's
    DDP strategy the same way (``fabric.setup(FSDP(model), opt)``, ``no_backward_sync``, ``clip_gradients``)."""
    script = ROOT / "tests" / "support" / "lightning_ranks.py"
    env = _env()
    got = {}
    for mode in ("wrap", "plain"):
        out = tmp_path / mode
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            kind + mode,
            str(out),
        ]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stderr[-4000:]
        got[mode] = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    assert got["wrap"][0]["wrapped"] == ("FullyShardedDataParallel" if kind else "LM")
    assert got["plain"][0]["wrapped"] == "DistributedDataParallel"
    for r in range(2):  # each rank's micro-batches (Lightning's DistributedSampler), 8 rows each
        assert len(got["wrap"][r]["losses"]) == 4
        torch.testing.assert_close(
            torch.tensor(got["wrap"][r]["losses"]), torch.tensor(got["plain"][r]["losses"]), rtol=1e-5, atol=1e-5
        )
    mine, theirs = got["wrap"][0]["weights"], got["plain"][0]["weights"]
    assert mine.keys() == theirs.keys()
    for n, w in theirs.items():
        torch.testing.assert_close(mine[n], w, rtol=1.3e-6, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def _srun(tmp_path, tasks: int, nodes: int, timeout: float = 120):
    """``tasks`` processes with the variables ``srun --nodes NODES --ntasks TASKS`` sets (on this one host), none
    of torchrun's: (return codes, stderr texts, the outputs' path)."""
    out = tmp_path / "srun"
    script = ROOT / "tests" / "support" / "srun_script.py"
    base = _env()
    per_node = tasks // nodes
    job = str(_port() - 15000)  # the job's id: every task derives the same port from it
    procs = []
    for r in range(tasks):
        env = {
            **base,
            "SLURM_PROCID": str(r),
            "SLURM_NTASKS": str(tasks),
            "SLURM_LOCALID": str(r % per_node),
            "SLURM_NODEID": str(r // per_node),
            "SLURM_NNODES": str(nodes),
            "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_ID": job,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(out), str(STEPS), str(G)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    errs = [p.communicate(timeout=timeout)[1] for p in procs]
    return [p.returncode for p in procs], errs, out


def test_srun_tasks_on_one_node_are_the_ranks(tmp_path):
    """[Note: srun is a launcher too]: 2 tasks with SLURM's variables only; the engine makes the group from them
    (rank, world, the first host of the node list, a port from the job id) and trains as plain PyTorch on the global
    batch; the user's script reads no rank."""
    rcs, errs, out = _srun(tmp_path, tasks=2, nodes=1)
    _ok(rcs, errs)
    result = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    assert all(r["world"] == 2 for r in result) and [r["env_rank"] for r in result] == ["0", "1"]
    ref_losses, (weights, _) = _reference(2, STEPS)
    for n, w in weights.items():
        torch.testing.assert_close(result[0]["master"][n], w, rtol=1.3e-6, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    torch.testing.assert_close(torch.tensor(result[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)


def test_an_srun_job_over_two_nodes_trains_as_one_process(tmp_path):
    """Two nodes of one task each ([Note: nodes hold the state whole]): each node's host state whole, the
    gradients all-reduced across the nodes; plain PyTorch on the global batch."""
    rcs, errs, out = _srun(tmp_path, tasks=2, nodes=2)
    _ok(rcs, errs)
    result = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    ref_losses, (weights, _) = _reference(2, STEPS)
    for n, w in weights.items():
        torch.testing.assert_close(result[0]["master"][n], w, rtol=1.3e-6, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    torch.testing.assert_close(torch.tensor(result[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)


_NODES = ["offload", "mixed", "clip", "fp16", "fsdp-hybrid"]  # one launch of 2 simulated nodes x 2 ranks runs these


@pytest.fixture(scope="module")
def on_nodes(tmp_path_factory):
    """2 simulated nodes of 2 ranks each (4 processes, torchrun's variables per node), the runs of _NODES."""
    tmp = tmp_path_factory.mktemp("nodes")
    rcs, errs, results = launch(4, {"runs": [_run_spec(n) for n in _NODES]}, tmp, timeout=600, per_node=2)
    _ok(rcs, errs)
    return dict(zip(_NODES, results))


@pytest.mark.parametrize("placement", ["offload", "mixed"])
def test_two_nodes_train_like_one_process(placement, on_nodes):
    """[Note: nodes hold the state whole]: each node's 2 ranks shard its own copy of the host state (the shards
    tile each unit inside the node), every node maps arenas of its own, and the weights, moments and losses are
    plain PyTorch's on the global batch of 4 ranks."""
    result = on_nodes[placement]
    ref_losses, ref_weights = _reference(4, STEPS)
    _check(result, ref_losses, ref_weights)
    states = result["ranks"]
    assert [st["shards"] for st in states[:2]] == [st["shards"] for st in states[2:]]  # the same cut per node
    for name, (_, _, numel) in states[0]["shards"].items():
        assert sum(st["shards"][name][1] - st["shards"][name][0] for st in states[:2]) == numel
    inodes = [set(st["inodes"]) for st in states]
    assert inodes[0] == inodes[1] and inodes[2] == inodes[3] and not inodes[0] & inodes[2], inodes


def test_the_fsdp_shaped_loop_with_hybrid_shard_on_two_nodes(on_nodes):
    """``FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, cpu_offload=...)`` on 2 nodes of 2 ranks: FSDP's
    word for the layout zerofit runs there; plain PyTorch's weights and moments on the global batch."""
    _check_local_means(on_nodes["fsdp-hybrid"], 4)


def test_two_nodes_clip_and_skip_overflows_together(on_nodes):
    """Clipping by the global norm and an fp16 overflow on 2 nodes: the norm over the node's shards of the
    gradients reduced over every rank; every rank skips the same steps."""
    world, result = 4, on_nodes["clip"]
    ref_losses, ref_weights = _reference(world, STEPS, clip=0.74)
    _check(result, ref_losses, ref_weights)
    _check_fp16_like_one_process(on_nodes["fp16"], world)


def test_a_failing_node_ends_every_rank_naming_its_rank_and_node(tmp_path):
    """2 simulated nodes of 2 ranks: rank 3 (node 1) gets a bad batch and raises; every rank of both nodes fails
    within a bounded time, naming the rank and its node."""
    t = time.monotonic()
    rcs, errs, result = launch(
        4,
        {"steps": 3, "steps_total": 3, "config": _cfg(), "fail_rank": 3, "fail_step": 1},
        tmp_path,
        timeout=120,
        per_node=2,
    )
    assert all(rc != 0 for rc in rcs), rcs
    assert "labels must have input_ids" in errs[3]
    for r in (0, 1, 2):
        assert "another rank failed first (rank 3 (node 1): BatchError" in errs[r], errs[r][-3000:]
    assert result is None and time.monotonic() - t < 90


def test_a_killed_node_ends_every_rank_naming_its_rank_and_node(tmp_path):
    """[Note: a rank that dies]: 2 simulated nodes of 2 ranks in the full layout (the raising rank's test above runs
    the hybrid one); rank 2 (node 1) is killed (SIGKILL: it records nothing) in its second step. Every other rank
    fails within a bounded time, naming rank 2 and its node as the one that stopped answering, not itself."""
    t = time.monotonic()
    rcs, errs, result = launch(
        4,
        {"steps": 3, "steps_total": 3, "config": _cfg(nodes_layout="full"), "kill_rank": 2, "kill_step": 1},
        tmp_path,
        timeout=150,
        per_node=2,
    )
    assert rcs[2] == -9, rcs
    assert all(rc not in (0, None) for rc in rcs), rcs
    for r in (0, 1, 3):
        assert "rank 2 (node 1): stopped answering" in errs[r], errs[r][-3000:]
    assert result is None and time.monotonic() - t < 120


def test_zerofit_doctor_measures_the_bandwidth_between_the_nodes():
    """`torchrun --nnodes 2 --node-rank i ... -m zerofit.cli doctor --inter-node --json` on each of 2 simulated
    nodes: rank 0 prints the all-reduce bandwidth between them (what `zerofit estimate --inter-node-gbps` takes);
    launched on one node it is refused, exit 2, saying how to launch it."""
    env = _env()
    port = _port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--nproc-per-node",
                "1",
                "-m",
                "zerofit.cli",
                "doctor",
                "--inter-node",
                "--json",
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:]
    r = json.loads(outs[0][0])
    assert r["nodes"] == 2 and r["ranks_per_node"] == 1 and r["gb_per_s_per_node"] > 0 and r["seconds"] > 0
    assert outs[1][0].strip() == ""  # rank 0 alone prints
    p = subprocess.run(
        [sys.executable, "-m", "zerofit.cli", "doctor", "--inter-node"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "launch on 2 nodes or more" in p.stderr + p.stdout


def test_torchrun_c10d_rendezvous_across_two_nodes_trains_as_one_process(tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id J`, started
    once per simulated node with no node rank (the rendezvous numbers the nodes; the workers' store is the agent's):
    the engine forms its group from what torchrun sets and the two nodes train as one process on the global batch."""
    script = ROOT / "tests" / "support" / "restart_script.py"
    env = _env()
    out, ck = tmp_path / "out", tmp_path / "ck"
    port = _port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "zf33",
                str(script),
                str(out),
                str(ck),
                "3",
                str(G),
                "-1",
                "0",
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    result = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    ref_losses, (weights, _) = _reference(2, 3)
    torch.testing.assert_close(torch.tensor(result[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    for n, w in weights.items():
        torch.testing.assert_close(result[0]["master"][n], w, rtol=1.3e-6, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_torchrun_max_restarts_resumes_from_the_last_checkpoint(tmp_path):
    """`torchrun --max-restarts 1`, a checkpoint after every step: rank 1 raises after step 3 of 5 on the first
    attempt; every rank fails, torchrun restarts them, the second attempt loads the latest checkpoint (step 3) and
    trains steps 4 and 5: the final weights are 5 uninterrupted steps of plain PyTorch on the global batch."""
    script = ROOT / "tests" / "support" / "restart_script.py"
    env = _env()
    out, ck = tmp_path / "out", tmp_path / "ck"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            str(script),
            str(out),
            str(ck),
            "5",
            str(G),
            "1",
            "3",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    assert "the test's injected failure" in p.stderr
    result = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    assert [(r["attempt"], r["first"], len(r["losses"])) for r in result] == [(1, 3, 2), (1, 3, 2)]
    ref_losses, (weights, _) = _reference(2, 5)
    torch.testing.assert_close(torch.tensor(result[0]["losses"]), torch.tensor(ref_losses[3:]), rtol=1e-5, atol=1e-5)
    for n, w in weights.items():
        torch.testing.assert_close(result[0]["master"][n], w, rtol=1.3e-6, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_a_checkpoint_saved_on_two_nodes_resumes_on_one_node_and_one_process(tmp_path):
    """4 micro-batches per step throughout: 2 steps in one process, saved; 2 more on 2 nodes of 2 ranks (G=1) from
    it, saved and exported; 2 more on one node of 2 ranks (G=2) from that; the last checkpoint in one process. The
    losses and weights of 6 uninterrupted steps of plain PyTorch; the export from the nodes loads with
    from_pretrained."""
    from transformers import AutoModelForCausalLM

    import zerofit

    total, mbs = 6, 4
    cfg = _cfg(**_PLACEMENTS["mixed"])
    ref_losses, ref_weights, losses = _one_process_then_save(tmp_path, cfg, total, mbs)
    rcs, errs, nodes = launch(
        4,
        {
            "G": 1,
            "steps": 2,
            "steps_total": total,
            "first": 2,
            "config": {**cfg, "gradient_accumulation_steps": 1},
            "load": str(tmp_path / "ck"),
            "save": str(tmp_path / "ck"),
            "tag": "nodes",
            "export": str(tmp_path / "hf"),
        },
        tmp_path,
        timeout=300,
        per_node=2,
    )
    _ok(rcs, errs)
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    exported = {n: p.detach().clone() for n, p in out.named_parameters()}
    for n, w in nodes["master"].items():
        torch.testing.assert_close(exported[n], w, rtol=0, atol=0)
    rcs, errs, two = launch(
        2,
        {
            "G": 2,
            "steps": 2,
            "steps_total": total,
            "first": 4,
            "config": {**cfg, "gradient_accumulation_steps": 2},
            "load": str(tmp_path / "ck"),
            "save": str(tmp_path / "ck"),
            "tag": "two",
        },
        tmp_path,
        timeout=300,
    )
    _ok(rcs, errs)
    losses += nodes["state"]["losses"] + two["state"]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1.3e-6, atol=1e-5)
    for n, w in ref_weights.items():
        torch.testing.assert_close(two["master"][n], w, rtol=1.3e-6, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    back = zerofit.initialize(tm.llama(), {**cfg, "gradient_accumulation_steps": mbs})
    back.load_checkpoint(tmp_path / "ck")
    assert back.global_step == total
    assert all(torch.equal(w, two["master"][n]) for n, w in back.master_state_dict().items())
    back.close()
