"""One rank of a multi-process CPU (gloo) run, launched by tests/processes/test_ranks.py the way torchrun would.

Arguments: a JSON spec. Every rank trains the same tiny model on its part of each global batch (rank r takes
micro-batches r*G .. r*G+G-1 of the step's N*G) and writes, as rank 0, losses and final fp32 weights (and
moments) to ``out``. Optional: load a checkpoint first, save one at the end, raise on one rank at one step.

``--forked JOB``: several launches from this one process, which pays the imports once (tests/processes/test_ranks.py,
``launch_forked``): see :func:`forked`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zerofit  # noqa: E402
from tests.support import tiny_models as tm  # noqa: E402

_SEEN: list = []  # the default group of every run so far


def main(spec: dict) -> None:
    """One spec, or ``{"runs": [spec, ...]}``: each run in turn in the same processes (the imports are paid
    once); run i writes ``<its out>.<rank>``. ``"group"`` says who makes the process group of the runs:

    - ``"script"`` (the default): this script, once, before the first run; destroyed after the last.
    - ``"engine"``: ``zerofit.initialize`` (the script never calls ``init_process_group``), and the group
      lives for the process: every engine after the first finds it and reuses it.
    - ``"user-destroys"``: as ``"engine"``, and the script calls ``dist.destroy_process_group()`` after each
      run: the next engine makes a new group.

    A run with ``"catch": true`` expects its engine to fail (``fail_rank``: a rank, or ``"all"``): the script
    writes the error's text and goes on with the next run. ``"linger_s"``: seconds the engine stays open after
    its run (its failure monitor polls meanwhile). ``"leave_open": true``: the engine is not closed (the
    interpreter's exit releases it). Each run starts with a line ``ranks_script: run i starts`` on stderr."""
    runs = spec.pop("runs", None)
    if runs is None:
        run(spec)
        return
    dist = torch.distributed
    group = spec.pop("group", "script")
    if group == "script":
        dist.init_process_group("gloo" if all(r["config"].get("device") == "cpu" for r in runs) else "nccl")
    for i, r in enumerate(runs):
        if group == "user-destroys" or (group == "engine" and i == 0):
            assert not dist.is_initialized(), "a process group is left over"
        print(f"ranks_script: run {i} starts", file=sys.stderr, flush=True)
        run({**spec, **r})
        if group == "engine":
            assert dist.is_initialized(), "the engine's close destroyed the process group it made"
        elif group == "user-destroys":
            dist.destroy_process_group()
    if group == "script":
        dist.destroy_process_group()


def run(spec: dict) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(spec.get("model_seed", 0))
    model = getattr(tm, spec.get("model", "llama"))()
    for n, p in model.named_parameters():  # frozen parameters ([Note: frozen parameters])
        if any(f in n for f in spec.get("freeze", ())):
            p.requires_grad_(False)
    G = spec["G"]
    data = tm.batches(spec["steps_total"], G * world, seed=spec.get("data_seed", 1))[
        spec.get("first", 0) : spec.get("first", 0) + spec["steps"]
    ]
    earlier = _state_mappings()
    if spec.get("api") in (
        "fsdp",
        "accelerate",
    ):  # the user's FSDP-shaped loop (zerofit.fsdp: [Note: the user's loop ...])
        from torch.distributed.fsdp import CPUOffload

        if spec["api"] == "accelerate":
            import accelerate  # noqa: F401  (imported before the wrap, as its scripts do)
        from zerofit.fsdp import FullyShardedDataParallel as FSDP

        mp = None
        if spec.get("scaler"):  # fp16 with FSDP's ShardedGradScaler, as FSDP's fp16 recipe writes it
            from torch.distributed.fsdp import MixedPrecision
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            mp = MixedPrecision(param_dtype=torch.float16)
            spec = {**spec, "_scaler": ShardedGradScaler(device="cpu", init_scale=2.0**24, growth_interval=1000)}
        strategy = None
        if spec.get("strategy"):  # FSDP's ShardingStrategy by name (HYBRID_SHARD on several nodes)
            from torch.distributed.fsdp import ShardingStrategy

            strategy = ShardingStrategy[spec["strategy"]]
        wrapper = FSDP(
            model,
            cpu_offload=CPUOffload(offload_params=True),
            mixed_precision=mp,
            sharding_strategy=strategy,
            zerofit_config=spec["config"],
        )
        opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
        if spec["api"] == "accelerate":  # the accelerate loop: prepare, accumulate, backward, step
            from accelerate import Accelerator

            acc = Accelerator(cpu=True, gradient_accumulation_steps=G)
            assert acc.num_processes == world and acc.distributed_type.name == "MULTI_CPU"
            wrapper, opt = acc.prepare(wrapper, opt)
            assert hasattr(wrapper, "zerofit_engine"), type(wrapper)  # not wrapped in DDP
            spec = {**spec, "_acc": acc}
        spec = {**spec, "_wrapper": wrapper, "_opt": opt}
        engine = wrapper.zerofit_engine
    elif spec.get("api") == "fsdp2":  # FSDP2-shaped: fully_shard on each block, then on the model
        from torch.distributed.fsdp import CPUOffloadPolicy

        from zerofit.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        wrapper = fully_shard(model, offload_policy=CPUOffloadPolicy(), zerofit_config=spec["config"])
        spec = {
            **spec,
            "_wrapper": wrapper,
            "_opt": torch.optim.AdamW(wrapper.parameters(), lr=1e-3, weight_decay=0.01, fused=True),
        }
        engine = wrapper.zerofit_engine
    else:
        engine = zerofit.initialize(model, spec["config"])
    assert engine.ranks.world == world and engine.config.world_size == world
    if spec.get("catch"):
        try:
            train(engine, spec, data, rank, G)
        except Exception as e:  # noqa: BLE001 - the run expects its engine to fail: record how
            torch.save({"error": f"{type(e).__name__}: {e}", "state": {"error": True}}, f"{spec['out']}.{rank}")
            engine.close()
            return
        raise AssertionError("the run expected its engine to fail, and it trained")
    if spec.get("load"):
        engine.load_checkpoint(spec["load"])
    losses = train(engine, spec, data, rank, G)
    if spec.get("save"):
        engine.save_checkpoint(spec["save"], tag=spec.get("tag"))
    if spec.get("export"):
        engine.save_pretrained(spec["export"], dtype="fp32")
    engine.wait()
    if spec.get("_scaler") is not None:
        spec["_wrapper"](**data[0][:1][0])  # a forward settles the last step: applied or skipped
    state = {
        "losses": losses,
        "skipped": engine.skipped_steps,
        "threads": torch.get_num_threads(),
        "speculation": dict(engine.speculation_stats),
    }
    # the host state is in one shared mapping per arena (memfd), not copied per rank: this run's mappings (an
    # earlier run's engine, closed, may sit in a reference cycle with its arena mapped until the collector runs)
    state["shared_mappings"] = sum(1 for inode in _state_mappings(unique=False) if inode not in earlier)
    state["inodes"] = sorted(_state_mappings() - earlier)  # which arenas (a node's own: [Note: nodes ...])
    state["shards"] = {u.name: (u.shard.lo, u.shard.hi, u.numel) for u in engine.units}
    # [Note: nodes hold a slice of the state]: the layout, and the bytes the node's arenas hold (local rank 0)
    state["layout"], state["held"] = engine.ranks.layout, engine.ranks.held_bytes()
    state["node_bounds"] = {u.name: engine.ranks.node_bounds(u.numel) for u in engine.units}
    state["streamed"] = sum(1 for u in engine.blocks if u.home.name == "STREAMED")
    c10d = torch.distributed.distributed_c10d  # the groups the engine used (by name), and how many exist
    state["groups"] = [
        c10d._get_process_group_name(g)
        for g in (c10d._get_default_group(), engine.ranks.gather_group, engine.ranks.reduce_group)
    ]
    state["group_count"] = len(c10d._world.pg_map)
    state["monitors"] = sum("zerofit" in t.name and "monitor" in t.name for t in threading.enumerate())
    state["same_group"] = [c10d._get_default_group() is g for g in _SEEN[-1:]]  # as the previous run's
    _SEEN.append(c10d._get_default_group())
    master = engine.master_state_dict()  # a collective: every rank reads the weights together
    state["held_after_read"] = engine.ranks.held_bytes()  # the whole-state read's gathered slices handed back
    out = {"state": state}
    state["sharded_device_units"] = sum(u.shard.state for u in engine.units)
    with engine.sharding.full_state(
        engine.units, write_back=False
    ):  # whole moments of GPU-sharded units (a collective)
        if rank == 0:
            moments = {}
            for u in engine.units:
                prefix = "" if u.index < 0 else engine.adapter.block_prefix(u.index) + "."
                for n, v in u.layout.views(u.exp_avg).items():
                    moments[prefix + n] = v.detach().to("cpu", copy=True)
            out.update(master=master, exp_avg=moments)
    torch.save(out, f"{spec['out']}.{rank}")
    time.sleep(spec.get("linger_s", 0))
    if not spec.get("leave_open"):
        engine.close()


def _state_mappings(unique: bool = True):
    """The inodes of this process's mappings of zerofit's shared host state (memfd), one per mapping or a set."""
    with open("/proc/self/maps") as f:
        inodes = [line.split()[4] for line in f if "memfd:zerofit-state" in line]
    return set(inodes) if unique else inodes


def train(engine, spec: dict, data: list, rank: int, G: int) -> list[float]:
    """The run's steps on this rank's micro-batches; the losses."""
    losses = []
    for step, mbs in enumerate(data):
        mine = mbs[rank * G : (rank + 1) * G]
        if spec.get("kill_rank") == rank and spec.get("kill_step") == step:  # [Note: a rank that dies]
            time.sleep(2.5)  # its heartbeat heard by every rank first
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.get("fail_rank") in (rank, "all") and spec.get("fail_step") == step:
            mine = [{"input_ids": mine[0]["input_ids"][:, :3], "labels": mine[0]["labels"]}] + mine[1:]  # bad batch
        if spec.get("api") in ("fsdp", "fsdp2"):  # model(**b); (loss / G).backward(); clip; optimizer.step()
            total = 0.0
            scaler = spec.get("_scaler")
            for i, b in enumerate(mine):
                if spec["api"] == "fsdp2":  # FSDP2's own accumulation switch, as its users write it
                    spec["_wrapper"].set_requires_gradient_sync(i == len(mine) - 1)
                loss = spec["_wrapper"](**b).loss
                (scaler.scale(loss / len(mine)) if scaler is not None else loss / len(mine)).backward()
                total += loss.item()
            if scaler is not None:  # unscale_, clip, step (skipped on an overflow), update
                scaler.unscale_(spec["_opt"])
                spec["_wrapper"].clip_grad_norm_(spec["clip"]) if spec.get("clip") else None
                scaler.step(spec["_opt"])
                scaler.update()
                spec["_opt"].zero_grad()
                losses.append(total / len(mine))
                continue
            if spec.get("clip"):
                if spec["api"] == "fsdp":
                    spec["_wrapper"].clip_grad_norm_(spec["clip"])
                else:
                    torch.nn.utils.clip_grad_norm_(spec["_wrapper"].parameters(), spec["clip"])
            spec["_opt"].step()
            spec["_opt"].zero_grad()
            losses.append(total / len(mine))
        elif spec.get("api") == "accelerate":  # with accumulate(model): forward, backward, step, zero_grad
            acc, total = spec["_acc"], 0.0
            for b in mine:
                with acc.accumulate(spec["_wrapper"]):
                    loss = spec["_wrapper"](**b).loss
                    acc.backward(loss)
                    spec["_opt"].step()
                    spec["_opt"].zero_grad()
                total += loss.item()
            losses.append(total / len(mine))
        elif spec.get("api") == "deepspeed":  # engine(**b); backward(loss); step() per micro-batch
            total = 0.0
            for b in mine:
                out = engine(**b)
                engine.backward(out.loss)
                engine.step()
                total += float(out.loss)
            losses.append(total / len(mine))
        else:
            losses.append(engine.train_batch(mine))
    return losses


def forked(job: dict) -> None:
    """``job["launches"]``: launches one after another, each of ``world`` ranks forked from this process (which
    imported torch, transformers and zerofit once and runs no torch op itself), with torchrun's environment and a
    fresh ``MASTER_PORT``. ``"agent_store": true`` (a launch's): as torchrun does, a process other than the ranks
    (a fork too) hosts the TCPStore and the ranks get ``TORCHELASTIC_USE_AGENT_STORE=True``. A rank's stderr and
    stdout go to ``<logs>/<launch>.<rank>``; it ends as a process does, through the interpreter's exit
    (SystemExit unwinds the fork's copy of this stack). Writes ``job["result"]``: per launch the ranks' exit statuses
    (None: still running after ``timeout_s``, killed) and its seconds."""
    import gc
    import signal
    import socket

    results = []
    for i, launch in enumerate(job["launches"]):
        world = launch["world"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        t = time.monotonic()
        agent = None
        if launch.get("agent_store"):
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
            agent = _fork_store(port, world)
        pids = []
        gc.freeze()  # the forks' exits do not copy every page of the imported modules (copy-on-write)
        sys.stdout.flush()
        sys.stderr.flush()
        for r in range(world):
            pid = os.fork()
            if pid == 0:  # the rank: nothing below returns into the launching loop
                if agent is not None:
                    os.close(agent[1])
                os.environ.update(env, RANK=str(r), LOCAL_RANK=str(r))
                fd = os.open(f"{job['logs']}/{i}.{r}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                main(json.loads(json.dumps(launch["spec"])))
                sys.exit(0)
            pids.append(pid)
        deadline = t + job["timeout_s"]
        codes: list[int | None] = [None] * world
        while None in codes and time.monotonic() < deadline:
            for k, pid in enumerate(pids):
                if codes[k] is None:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[k] = os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        for k, pid in enumerate(pids):
            if codes[k] is None:  # a hang: end it
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        if agent is not None:
            os.close(agent[1])  # the store's process ends when its pipe closes
            os.waitpid(agent[0], 0)
        results.append({"codes": codes, "seconds": time.monotonic() - t})
    with open(job["result"], "w") as f:
        json.dump(results, f)


def _fork_store(port: int, world: int) -> tuple[int, int]:
    """torchrun's agent: a process that hosts the TCPStore on ``port`` until the pipe it returns is closed."""
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(stop_w)
        store = torch.distributed.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
        os.write(ready_w, b"1")
        os.read(stop_r, 1)  # blocks until the launcher closes its end
        del store
        os._exit(0)
    os.close(ready_w)
    os.close(stop_r)
    os.read(ready_r, 1)
    os.close(ready_r)
    return pid, stop_w


if __name__ == "__main__":
    if sys.argv[1] == "--forked":
        forked(json.loads(sys.argv[2]))
    else:
        spec = json.loads(sys.argv[1])
        made_by_accelerate = spec.get("api") == "accelerate"
        main(spec)
        # the group accelerate's loop made, torn down before the interpreter's own teardown, as PyTorch asks of every
        # distributed script: there gloo's threads were seen to abort the process now and then ("terminate called
        # without an active exception"), as under Lightning (lightning_ranks.py)
        if made_by_accelerate and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
