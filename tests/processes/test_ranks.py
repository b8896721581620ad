"""Several ranks on the CPU (gloo), launched as torchrun launches them: the same math as one process.

Each test starts N processes of tests/support/ranks_script.py with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and compares rank 0's per-step losses and final
weights with plain PyTorch training on the same global batch (N x G micro-batches per step), at fp32
tolerances (RELIABILITY.md). 3 ranks make uneven shards (the units' sizes are not multiples of 3).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support import tiny_models as tm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "ranks_script.py"
G = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    world: int,
    spec: dict,
    tmp: Path,
    timeout: float = 240.0,
    env_extra: dict | None = None,
    per_node: int | None = None,
):
    """Run ``world`` ranks; returns (return codes, stderr texts, rank 0's output or None). ``spec["runs"]``: several
    runs in the same processes; the output is then the list of their outputs."""
    out = tmp / f"out-{time.monotonic_ns()}.pt"
    if "runs" in spec:
        spec = {"G": G, **spec, "runs": [{**r, "out": f"{out}.{i}"} for i, r in enumerate(spec["runs"])]}
        rcs, errs = _start(world, spec, timeout, env_extra, per_node)
        return rcs, errs, [_collect(Path(r["out"]), world) for r in spec["runs"]]
    spec = {"G": G, **spec, "out": str(out)}
    rcs, errs = _start(world, spec, timeout, env_extra, per_node)
    return rcs, errs, _collect(out, world)


def _collect(out: Path, world: int):
    outs = [Path(f"{out}.{r}") for r in range(world)]
    if not all(o.exists() for o in outs):
        return None
    result = torch.load(outs[0], weights_only=False)
    result["ranks"] = [torch.load(o, weights_only=False)["state"] for o in outs]
    return result


def _start(world: int, spec: dict, timeout: float, env_extra: dict | None, per_node: int | None = None):
    """``per_node``: ranks per simulated node (torchrun --nnodes world/per_node, each with its --node-rank: the
    node's ranks share its own host arenas); None: one node."""
    port = _port()
    procs = []
    L = per_node or world
    for r in range(world):
        env = {
            **os.environ,
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(r % L),
            "LOCAL_WORLD_SIZE": str(L),
            "GROUP_RANK": str(r // L),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT / "src"), str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
            ),
            **(env_extra or {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), json.dumps(spec)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as e:
            for q in procs:
                q.kill()
            raise AssertionError(f"ranks still running after {timeout} s (a hang)") from e
        errs.append(err)
    return [p.returncode for p in procs], errs


def _cfg(**kw) -> dict:
    base = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": G,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    }
    base.update(kw)
    return base


def _reference(world: int, steps: int, clip: float = 0.0, model: str = "llama", freeze=()):
    """Plain PyTorch on the global batch: per-step losses, final weights and AdamW's exp_avg by name (of the
    parameters it trains: those whose names contain none of ``freeze``)."""
    torch.manual_seed(0)
    ref = getattr(tm, model)()
    for n, p in ref.named_parameters():
        if any(f in n for f in freeze):
            p.requires_grad_(False)
    data = tm.batches(steps, G * world)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    losses = []
    for mbs in data:
        opt.zero_grad()
        total = 0.0
        for mb in mbs:
            loss = ref(**mb).loss
            (loss / len(mbs)).backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        losses.append(total / len(mbs))
    weights = {n: p.detach() for n, p in ref.named_parameters()}
    moments = {n: opt.state[p]["exp_avg"] for n, p in ref.named_parameters() if p.requires_grad}
    return losses, (weights, moments)


def _check(result, ref_losses, ref, rtol=1.3e-6, atol=1e-5):
    weights, moments = ref
    torch.testing.assert_close(torch.tensor(result["state"]["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    for n, w in weights.items():
        torch.testing.assert_close(result["master"][n], w, rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")
        if n in moments:
            torch.testing.assert_close(
                result["exp_avg"][n], moments[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}.exp_avg: {m}"
            )
    assert set(result["exp_avg"]) == set(moments), "optimizer state only for the trained parameters"


def _check_local_means(result, world: int, clip: float = 0.0):
    """A loop whose ranks each report their own micro-batches' mean loss (the DeepSpeed-shaped and the user's
    loops): the weights and moments of plain PyTorch on the global batch, the ranks' mean losses its losses."""
    ref_losses, (weights, moments) = _reference(world, STEPS, clip=clip)
    for n, w in weights.items():
        torch.testing.assert_close(result["master"][n], w, rtol=1.3e-6, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
        torch.testing.assert_close(result["exp_avg"][n], moments[n], rtol=1e-5, atol=1e-7)
    per_rank = torch.tensor([st["losses"] for st in result["ranks"]])  # (ranks, steps): local means
    torch.testing.assert_close(per_rank.mean(0), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    return weights


def _check_fp16_like_one_process(result, world: int, steps: int = 6):
    """The fp16 run (_fp16_cfg): every rank skipped the same steps, at least one, as one process on the global
    batch skips them; its losses and weights to fp16's tolerances."""
    import zerofit

    skipped = [st["skipped"] for st in result["ranks"]]
    assert skipped[0] > 0 and skipped == [skipped[0]] * world, skipped
    torch.manual_seed(0)
    one = zerofit.initialize(tm.llama(), {**_fp16_cfg(), "gradient_accumulation_steps": G * world})
    losses = [one.train_batch(mbs) for mbs in tm.batches(steps, G * world)]
    assert one.skipped_steps == skipped[0]
    torch.testing.assert_close(torch.tensor(result["state"]["losses"]), torch.tensor(losses), rtol=1e-3, atol=1e-3)
    for n, w in one.master_state_dict().items():
        torch.testing.assert_close(result["master"][n], w, rtol=1e-3, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    one.close()


def _one_process_then_save(tmp: Path, cfg: dict, total: int, mbs: int):
    """The start of a checkpoint's journey: plain PyTorch's losses and weights over ``total`` steps of ``mbs``
    micro-batches, and the first 2 of them in one process, saved under ``tmp/ck`` (tag ``one``): (reference losses,
    reference weights, the process's losses)."""
    import zerofit

    torch.manual_seed(0)
    ref = tm.llama()
    ref_losses = tm.reference_train(ref, tm.batches(total, mbs))
    ref_weights = {n: p.detach() for n, p in ref.named_parameters()}
    torch.manual_seed(0)
    one = zerofit.initialize(tm.llama(), {**cfg, "gradient_accumulation_steps": mbs})
    losses = [one.train_batch(b) for b in tm.batches(total, mbs)[:2]]
    one.save_checkpoint(tmp / "ck", tag="one")
    one.close()
    return ref_losses, ref_weights, losses


def _ok(rcs, errs):
    assert rcs == [0] * len(rcs), "\n".join(
        f"rank {i} rc {rc}:\n{e[-3000:]}" for i, (rc, e) in enumerate(zip(rcs, errs))
    )


STEPS = 4
CLIP = 0.05  # the user's loop's clip on ranks: every step clipped (the tiny model's norms are larger)
_PLACEMENTS = {
    # every block streamed, its state in the shared host arena, updated by the CPU worker shard by shard
    "offload": {
        "offload": {"param_device": "cpu", "optimizer_device": "cpu", "resident_blocks": 0, "shell_optimizer": "host"}
    },
    # a resident block and the shell with their optimizer on the device: replicated, gradients all-reduced
    "mixed": {
        "offload": {"param_device": "cpu", "optimizer_device": "cpu", "resident_blocks": 1, "shell_optimizer": "device"}
    },
    # no offload: every unit on the device, its optimizer state sharded ([Note: sharded device state])
    "no-offload": {"offload": {"param_device": "none", "optimizer_device": "none"}},
    # no offload, FULL_SHARD: every block streamed from the GPUs' shards of its state, gathered for each use
    "full-shard": {"offload": {"param_device": "none", "optimizer_device": "none"}, "sharding": "FULL_SHARD"},
    # no offload, NO_SHARD: every unit replicated, as DDP
    "no-offload-replicated": {"offload": {"param_device": "none", "optimizer_device": "none"}, "sharding": "NO_SHARD"},
}


_THREE = ["offload", "mixed", "no-offload", "full-shard", "clip"]  # one launch of 3 ranks runs these in turn
_TWO = [
    "no-offload-replicated",
    "deepspeed-loop",
    "fp16",
    "frozen",
    "lora",
    "fsdp-loop",
    "fsdp2-loop",
    "accelerate-loop",
    "fsdp-loop-clip",
    "fsdp-loop-fp16",
]  # and one of 2 ranks these
_FROZEN = ("embed_tokens", "layers.1.", "q_proj")


def _run_spec(name: str) -> dict:
    if name == "clip":  # clipping by the global norm, speculation held on some steps, rolled back on others
        return {"steps": STEPS, "steps_total": STEPS, "config": _cfg(gradient_clipping=0.74, **_PLACEMENTS["mixed"])}
    if name == "deepspeed-loop":
        return {"steps": STEPS, "steps_total": STEPS, "api": "deepspeed", "config": _cfg(**_PLACEMENTS["mixed"])}
    if name == "frozen":  # frozen parameters: the shell's embedding, a whole block, a projection of each
        return {"steps": STEPS, "steps_total": STEPS, "freeze": list(_FROZEN), "config": _cfg(**_PLACEMENTS["mixed"])}
    if name == "fsdp-loop":  # the user's FSDP-shaped loop (zerofit.fsdp), the engine's window the loop's G
        return {"steps": STEPS, "steps_total": STEPS, "api": "fsdp", "config": _cfg(**_PLACEMENTS["mixed"])}
    if name == "fsdp-loop-clip":  # the model's clip_grad_norm_ on 2 ranks: FSDP's norm over the ranks' shards
        return {
            "steps": STEPS,
            "steps_total": STEPS,
            "api": "fsdp",
            "clip": CLIP,
            "config": _cfg(**_PLACEMENTS["mixed"]),
        }
    if name == "fsdp-loop-fp16":  # MixedPrecision(fp16) with FSDP's ShardedGradScaler, overflowing at first
        cfg = {k: v for k, v in _cfg(**_PLACEMENTS["mixed"]).items() if k != "precision"}
        return {"steps": 6, "steps_total": 6, "api": "fsdp", "scaler": True, "clip": 1.0, "config": cfg}
    if name == "fsdp-hybrid":  # the FSDP-shaped loop with sharding_strategy=HYBRID_SHARD (2 nodes)
        return {
            "steps": STEPS,
            "steps_total": STEPS,
            "api": "fsdp",
            "strategy": "HYBRID_SHARD",
            "config": _cfg(**_PLACEMENTS["mixed"]),
        }
    if name == "accelerate-loop":  # the same wrapper through an Accelerator on 2 processes (MULTI_CPU, gloo)
        return {"steps": STEPS, "steps_total": STEPS, "api": "accelerate", "config": _cfg(**_PLACEMENTS["mixed"])}
    if name == "fsdp2-loop":  # FSDP2-shaped: fully_shard per block and on the model, set_requires_gradient_sync
        return {"steps": STEPS, "steps_total": STEPS, "api": "fsdp2", "config": _cfg(**_PLACEMENTS["mixed"])}
    if name == "lora":  # a PEFT LoRA model: its base frozen, its adapters trained
        return {"steps": STEPS, "steps_total": STEPS, "model": "llama_lora", "config": _cfg(**_PLACEMENTS["mixed"])}
    if name == "fp16":  # a loss scale that overflows at first
        return {"steps": 6, "steps_total": 6, "config": _fp16_cfg()}
    return {"steps": STEPS, "steps_total": STEPS, "config": _cfg(**_PLACEMENTS[name])}


def _fp16_cfg() -> dict:
    return _cfg(
        precision="fp16",
        gradient_clipping=1.0,
        fp16={"initial_scale_power": 32, "loss_scale_window": 2},
        **_PLACEMENTS["mixed"],
    )


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Both shared launches, once per module: {run name: (world, rank 0's output)}."""
    tmp = tmp_path_factory.mktemp("ranks")
    out = {}
    for world, names in ((3, _THREE), (2, _TWO)):
        rcs, errs, results = launch(world, {"runs": [_run_spec(n) for n in names]}, tmp, timeout=400)
        _ok(rcs, errs)
        out.update({n: (world, r) for n, r in zip(names, results)})
    return out


@pytest.mark.parametrize("placement", ["offload", "mixed", "no-offload", "full-shard", "no-offload-replicated"])
def test_ranks_train_like_one_process(placement, launched):
    world, result = launched[placement]
    ref_losses, ref_weights = _reference(world, STEPS)
    _check(result, ref_losses, ref_weights)
    states = result["ranks"]
    for st in states:  # every rank saw the global batch's loss
        assert st["losses"] == states[0]["losses"]
    shards = [st["shards"] for st in states]
    for name, (_, _, numel) in shards[0].items():  # the ranks' shards tile each unit
        assert sorted((s[name][0], s[name][1]) for s in shards)[0][0] == 0
        assert sum(s[name][1] - s[name][0] for s in shards) == numel
    sharded = {
        "offload": 0,
        "mixed": 2,
        "no-offload": len(shards[0]),
        "full-shard": len(shards[0]),
        "no-offload-replicated": 0,
    }[placement]
    assert all(st["sharded_device_units"] == sharded for st in states)
    if placement == "full-shard":
        assert states[0]["streamed"] == len(shards[0]) - 1 and states[0]["shared_mappings"] == 0
    elif placement.startswith("no-offload"):
        assert states[0]["streamed"] == 0 and states[0]["shared_mappings"] == 0
    else:
        assert states[0]["streamed"] == len(shards[0]) - 1 - (placement == "mixed")
        assert all(st["shared_mappings"] >= 1 for st in states)  # the host state is mapped, not copied
    if world == 3:
        assert any(numel % 3 for _, _, numel in shards[0].values()), "3 ranks should make uneven shards"


def test_ranks_leave_frozen_parameters_as_one_process_does(launched):
    """[Note: frozen parameters] on two ranks: the frozen weights (shared host memory, uploaded whole by each
    rank) stay bitwise, the others train as plain PyTorch over the trained parameters."""
    world, result = launched["frozen"]
    ref_losses, ref = _reference(world, STEPS, freeze=_FROZEN)
    _check(result, ref_losses, ref)
    torch.manual_seed(0)
    start = tm.llama()
    for n, p in start.named_parameters():
        if any(f in n for f in _FROZEN):
            assert torch.equal(result["master"][n], p.detach()), n


def test_ranks_train_a_peft_lora_model_as_one_process_does(launched):
    """PEFT LoRA on two ranks: the adapters train as PEFT on plain PyTorch over the global batch does, the frozen
    base (host memory the ranks share) stays bitwise, and only the adapters have optimizer state."""
    pytest.importorskip("peft")
    world, result = launched["lora"]
    ref_losses, ref = _reference(world, STEPS, model="llama_lora")
    _check(result, ref_losses, ref)
    torch.manual_seed(0)
    start = tm.llama_lora()
    frozen = [n for n, p in start.named_parameters() if not p.requires_grad]
    assert frozen and all("lora_" in n for n in result["exp_avg"])
    for n in frozen:
        assert torch.equal(result["master"][n], start.get_parameter(n).detach()), n


def test_ranks_clip_by_the_global_norm(launched):
    """Clipping by the norm of the whole gradient (every rank's shards, host and GPU, and replicated units once),
    with speculative updates on each rank's shard held or rolled back as the global norm decides."""
    world, result = launched["clip"]
    ref_losses, ref_weights = _reference(world, STEPS, clip=0.74)
    _check(result, ref_losses, ref_weights)
    spec = [st["speculation"] for st in result["ranks"]]
    assert all(s == spec[0] for s in spec), spec  # the same decision on every rank
    assert spec[0]["held"] >= 1 and spec[0]["rolled_back"] >= 1, spec[0]


def test_ranks_fp16_overflow_skips_the_step_on_every_rank(launched):
    """fp16 with a loss scale that overflows at first: every rank skips the same steps, and the weights are a
    single process's on the same global batch."""
    world, result = launched["fp16"]
    _check_fp16_like_one_process(result, world)


def test_deepspeed_shaped_loop_on_ranks(launched):
    """`out = engine(**b); engine.backward(out.loss); engine.step()` per micro-batch on 2 ranks: the gradient is
    averaged over the ranks (as DeepSpeed's data parallelism), the same weights as plain PyTorch on the global
    batch; each rank's returned losses are those of its own micro-batches."""
    world, result = launched["deepspeed-loop"]
    _check_local_means(result, world)


@pytest.mark.parametrize("name", ["fsdp-loop", "fsdp2-loop", "accelerate-loop", "fsdp-loop-clip"])
def test_the_users_fsdp_shaped_loop_on_ranks(launched, name):
    """`zerofit.fsdp.FullyShardedDataParallel` (FSDP2's ``fully_shard`` and its ``set_requires_gradient_sync``; the
    wrapper through accelerate's ``prepare``/``accumulate``/``backward`` with accelerate's own MULTI_CPU state) on 2
    gloo ranks, each rank's loop as written (`(loss / G).backward()` per micro-batch, `optimizer.step()`): the
    gradient averaged over the ranks as FSDP averages it, the weights and moments of plain PyTorch on the global
    batch (to rounding: torch's non-fused AdamW there, summed over ranks)."""
    world, result = launched[name]
    weights = _check_local_means(result, world, clip=CLIP if name.endswith("-clip") else 0.0)
    if name.endswith("-clip"):  # the clip mattered: unclipped, the weights are elsewhere
        _, (unclipped, _) = _reference(world, STEPS)
        assert max(float((unclipped[n] - w).abs().max()) for n, w in weights.items()) > 1e-4


def test_the_users_fp16_loop_with_a_sharded_grad_scaler_on_ranks(launched):
    """``MixedPrecision(param_dtype=torch.float16)`` and FSDP's ``ShardedGradScaler`` (scale, unscale_, the model's
    clip_grad_norm_, step, update) on 2 ranks, the first steps overflowing: every rank skips the same steps (each
    rank's overflow check reads its own shards; the ranks' verdicts are shared), and the weights are the engine's
    own fp16 on one process over the global batch with the same scale schedule (to fp16 rounding)."""
    import zerofit

    world, result = launched["fsdp-loop-fp16"]
    skipped = [st["skipped"] for st in result["ranks"]]
    assert skipped[0] > 0 and skipped == [skipped[0]] * world, skipped
    torch.manual_seed(0)
    one = zerofit.initialize(
        tm.llama(),
        _cfg(
            precision="fp16",
            gradient_accumulation_steps=G * world,
            gradient_clipping=1.0,
            fp16={"initial_scale_power": 24, "hysteresis": 1, "loss_scale_window": 1000},
            **_PLACEMENTS["mixed"],
        ),
    )
    losses = [one.train_batch(mbs) for mbs in tm.batches(6, G * world)]
    assert one.skipped_steps == skipped[0]
    per_rank = torch.tensor([st["losses"] for st in result["ranks"]])
    torch.testing.assert_close(per_rank.mean(0), torch.tensor(losses), rtol=1e-3, atol=1e-3)
    for n, w in one.master_state_dict().items():
        torch.testing.assert_close(result["master"][n], w, rtol=1e-3, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    one.close()


def test_a_failing_rank_ends_every_rank_naming_it(tmp_path):
    """Rank 1 gets a bad batch at its second step and raises; rank 0, waiting in a collective, must not hang:
    it fails too, naming rank 1 and the cause."""
    t = time.monotonic()
    rcs, errs, result = launch(
        2, {"steps": 3, "steps_total": 3, "config": _cfg(), "fail_rank": 1, "fail_step": 1}, tmp_path, timeout=120
    )
    assert rcs[0] != 0 and rcs[1] != 0, rcs
    assert "labels must have input_ids" in errs[1]
    assert "another rank failed first (rank 1: BatchError" in errs[0], errs[0][-3000:]
    assert result is None
    assert time.monotonic() - t < 90


def test_checkpoints_resume_across_world_sizes_and_export(tmp_path):
    """4 micro-batches per step throughout: 2 steps in one process (G=4), saved; 2 more on 4 ranks (G=1) from
    that checkpoint, saved; 2 more on 2 ranks (G=2), saved and exported; that checkpoint loaded in one process.
    Losses, weights and moments are those of 6 uninterrupted steps of plain PyTorch, and the exported directory
    loads with from_pretrained. (The ranks of each launch are forked from one process that imported torch once:
    the checkpoints are the subject here; the launches above and below start each rank as its own process.)"""
    from transformers import AutoModelForCausalLM

    import zerofit

    total, mbs = 6, 4
    torch.manual_seed(0)
    ref = tm.llama()
    ref_losses = tm.reference_train(ref, tm.batches(total, mbs))
    ref_weights = {n: p.detach() for n, p in ref.named_parameters()}
    cfg = _cfg(**_PLACEMENTS["mixed"])  # host-sharded blocks, and GPU-sharded state (a block, the shell)
    torch.manual_seed(0)
    one = zerofit.initialize(tm.llama(), {**cfg, "gradient_accumulation_steps": mbs})
    losses = [one.train_batch(b) for b in tm.batches(total, mbs)[:2]]
    one.save_checkpoint(tmp_path / "ck", tag="one")
    one.close()
    rcs, errs, r4 = _launch_forked_once(
        4,
        {
            "G": 1,
            "steps": 2,
            "steps_total": total,
            "first": 2,
            "config": {**cfg, "gradient_accumulation_steps": 1},
            "load": str(tmp_path / "ck"),
            "save": str(tmp_path / "ck"),
            "tag": "four",
        },
        tmp_path / "four",
    )
    _ok(rcs, errs)
    assert (tmp_path / "ck" / "latest").read_text().strip() == "four"
    rcs, errs, r2 = _launch_forked_once(
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
            "export": str(tmp_path / "hf"),
        },
        tmp_path / "two",
    )
    _ok(rcs, errs)
    losses += r4["state"]["losses"] + r2["state"]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1.3e-6, atol=1e-5)
    for n, w in ref_weights.items():
        torch.testing.assert_close(r2["master"][n], w, rtol=1.3e-6, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for n, p in out.named_parameters():
        torch.testing.assert_close(p.detach(), ref_weights[n], rtol=1.3e-6, atol=1e-5)
    back = zerofit.initialize(tm.llama(), {**cfg, "gradient_accumulation_steps": mbs})  # 2 ranks -> 1 process
    back.load_checkpoint(tmp_path / "ck")
    assert back.global_step == total
    for n, w in back.master_state_dict().items():
        torch.testing.assert_close(w, r2["master"][n], rtol=0, atol=0)
    for u in back.units:
        prefix = "" if u.index < 0 else back.adapter.block_prefix(u.index) + "."
        for n, v in u.layout.views(u.exp_avg).items():
            torch.testing.assert_close(v, r2["exp_avg"][prefix + n], rtol=0, atol=0)
    back.close()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("placement", ["offload", "mixed", "full-shard"])
def test_ranks_on_two_gpus_with_nccl(placement, tmp_path):
    """The same run on 2 GPUs (NCCL, streams, pinned shared arenas): fp32 compute, clipping with speculation,
    against plain PyTorch on the CPU at GPU-vs-CPU fp32 tolerances."""
    cfg = _cfg(device="cuda", gradient_clipping=1.16, **_PLACEMENTS[placement])
    rcs, errs, result = launch(
        2, {"steps": STEPS, "steps_total": STEPS, "config": cfg}, tmp_path, env_extra={"OMP_NUM_THREADS": "4"}
    )
    _ok(rcs, errs)
    ref_losses, (weights, _) = _reference(2, STEPS, clip=1.16)
    torch.testing.assert_close(torch.tensor(result["state"]["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    for n, w in weights.items():
        torch.testing.assert_close(result["master"][n], w, rtol=1e-3, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    assert all(st["streamed"] >= 2 for st in result["ranks"])


def test_the_plan_counts_a_shard_of_the_gpu_resident_state():
    """[Note: sharded device state]: with 2 ranks sharing it, a resident unit's fp32 master and moments count
    half on each GPU, so a cap that holds 2 resident blocks alone holds more of them on 2 ranks (NO_SHARD: as
    one rank)."""
    from zerofit.engine.plan.search import BatchShape, ModelShape, make_plan

    shape = ModelShape(
        shell_numel=50_000_000, block_numels=(100_000_000,) * 12, hidden=2048, intermediate=5504, vocab=16000
    )
    kw = dict(
        compute_dtype=torch.bfloat16,
        on_cuda=True,
        host_budget=None,
        deferred_updates=False,
        checkpointing=True,
        stream_params=True,
        resident_blocks=None,
        prefetch_depth=None,
        device_budget=12 << 30,
    )
    one = make_plan(shape, BatchShape(1, 1024, 1), **kw)
    two = make_plan(shape, BatchShape(1, 1024, 1), **kw, shards=2)
    assert two.resident_blocks > one.resident_blocks
    assert two.device_bytes["resident_blocks"] / two.resident_blocks == 100_000_000 * (2 + 4 + 8)
    assert one.device_bytes["resident_blocks"] / one.resident_blocks == 100_000_000 * (2 + 16)


# ---------------------------------------------------------------- [Note: a process group that lives] (ranks.py)


def launch_forked(launches: list[dict], tmp: Path, timeout_each: float = 60.0, timeout: float = 240.0) -> list:
    """Several launches from one process that imports torch, transformers and zerofit once
    (tests/support/ranks_script.py ``--forked``): each launch ``{"world": N, "spec": ..., "agent_store": bool}``
    forks its N ranks with torchrun's environment and a fresh port. Returns per launch (exit statuses, None for a
    rank still running after ``timeout_each``; stderr texts; rank 0's outputs as ``launch`` returns them;
    seconds)."""
    job = {"launches": [], "logs": str(tmp), "result": str(tmp / "forked.json"), "timeout_s": timeout_each}
    for k, ln in enumerate(launches):
        out = tmp / f"forked-{k}.pt"
        spec = {"G": G, **ln["spec"], "runs": [{**r, "out": f"{out}.{i}"} for i, r in enumerate(ln["spec"]["runs"])]}
        job["launches"].append({**ln, "spec": spec})
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
    }
    rc, _, err = _run_session([sys.executable, str(SCRIPT), "--forked", json.dumps(job)], env, timeout)
    assert rc == 0, err[-3000:]
    done = json.loads(Path(job["result"]).read_text())
    out = []
    for k, (ln, res) in enumerate(zip(job["launches"], done)):
        world = ln["world"]
        errs = [(tmp / f"{k}.{r}").read_text() for r in range(world)]
        out.append((res["codes"], errs, [_collect(Path(r["out"]), world) for r in ln["spec"]["runs"]], res["seconds"]))
    return out


def _launch_forked_once(world: int, spec: dict, tmp: Path) -> tuple:
    """``launch(world, spec, tmp)`` with the ranks forked from one process that imported torch, transformers and
    zerofit once (``launch_forked``), not started as processes of their own: (exit statuses, stderr texts, rank
    0's output)."""
    tmp.mkdir(parents=True, exist_ok=True)
    ((codes, errs, (result,), _),) = launch_forked(
        [{"world": world, "agent_store": False, "spec": {"runs": [spec]}}], tmp, timeout_each=240.0, timeout=300.0
    )
    return codes, errs, result


def _run_session(cmd: list, env: dict, timeout: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``cmd`` in a process group of its own (``start_new_session``): past ``timeout``
    (a hang) the whole group is killed (the ranks torchrun or the forked launcher started too), then the test fails."""
    p = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise AssertionError(f"{cmd[1:4]} still running after {timeout} s (a hang)") from None
    return p.returncode, out, err


_LIVES = 2  # steps per engine
_LIMIT_S = 90  # a launch of three engines still running after this long hangs (it takes 3 to 12 s)


def _engines(n: int = 3, **last) -> list[dict]:
    """``n`` runs of ``_LIVES`` steps from the same start (each a new engine of a new model); ``last``: the last's."""
    one = {"steps": _LIVES, "steps_total": _LIVES, "config": _cfg()}
    return [one] * (n - 1) + [{**one, **last}]


@functools.cache
def _lives_reference(world: int):
    return _reference(world, _LIVES)


def _check_engines(codes, errs, results, seconds, world: int, reused: bool):
    """Every rank exited 0 in bounded time; every engine's losses (and rank 0's weights) are plain PyTorch's on
    the global batch; ``reused``: every engine after the first ran in the group the first one made (the same
    group object, no group made after the first engine's three), else each in a new group."""
    assert None not in codes, f"ranks still running after {_LIMIT_S} s (a hang): {codes}\n" + "\n".join(
        e[-2000:] for e in errs
    )
    _ok(codes, errs)
    assert seconds < _LIMIT_S
    ref_losses, (weights, _) = _lives_reference(world)
    for k, result in enumerate(results):
        assert result is not None, f"engine {k} wrote nothing"
        for st in result["ranks"]:
            torch.testing.assert_close(
                torch.tensor(st["losses"]),
                torch.tensor(ref_losses),
                rtol=1.3e-6,
                atol=1e-5,
                msg=lambda m, k=k: f"engine {k}: {m}",
            )
        for n, w in weights.items():
            torch.testing.assert_close(
                result["master"][n], w, rtol=1.3e-6, atol=1e-5, msg=lambda m, k=k, n=n: f"{k} {n}: {m}"
            )
    for st in (st for r in results[1:] for st in r["ranks"]):
        assert st["same_group"] == [reused], st["same_group"]
    # one failure monitor per process, whatever the engines before ([Note: a failing rank])
    assert [st["monitors"] for r in results for st in r["ranks"]] == [1] * len(results) * world
    groups = [st["groups"] for r in results for st in r["ranks"]]
    counts = [st["group_count"] for r in results for st in r["ranks"]]
    # the default group and zerofit's two; in a new group, the destroyed group's subgroups went with it
    assert counts == [3] * len(counts), counts
    if reused:
        assert groups == [groups[0]] * len(groups), groups
    assert not any("another rank failed" in e for e in errs), errs


_FORKED = [  # (name, world, group, agent store): one forked launch each, repeats of the same test in a row
    ("engine-2", 2, "engine", False),
    ("engine-2", 2, "engine", False),
    ("engine-2", 2, "engine", False),
    ("engine-3", 3, "engine", False),
    ("engine-3", 3, "engine", False),
    ("destroys-2", 2, "user-destroys", False),
    ("destroys-2", 2, "user-destroys", False),
    ("destroys-3", 3, "user-destroys", False),
    ("agent-engine-2", 2, "engine", True),
    ("agent-destroys-2", 2, "user-destroys", True),
    ("agent-destroys-2", 2, "user-destroys", True),
]


@pytest.fixture(scope="module")
def forked_launches(tmp_path_factory):
    """[Note: a process group that lives]: every launch of ``_FORKED`` (its ranks forked from one process that
    imported torch once, each ending through the interpreter's exit, the last engine left for it to release)
    and one of a failed engine followed by one that trains: {name: [(codes, errs, results, seconds), ...]}."""
    tmp = tmp_path_factory.mktemp("lives")
    launches = [
        {"world": w, "agent_store": agent, "spec": {"group": g, "runs": _engines(leave_open=True)}}
        for _, w, g, agent in _FORKED
    ]
    # engine 1 fails on every rank (a bad batch at its first step, caught); engine 2 must not fail for it
    fail = {"steps": _LIVES, "steps_total": _LIVES, "config": _cfg(), "fail_rank": "all", "fail_step": 0, "catch": True}
    launches.append(
        {"world": 2, "agent_store": True, "spec": {"group": "engine", "runs": [fail] + _engines(2, linger_s=2.5)}}
    )
    t = time.monotonic()
    done = launch_forked(launches, tmp, timeout_each=_LIMIT_S, timeout=900)
    out: dict[str, list] = {}
    for (name, *_), res in zip(_FORKED + [("failed-first",)], done):
        out.setdefault(name, []).append(res)
    out["seconds"] = time.monotonic() - t
    return out


@pytest.mark.parametrize("name", ["engine-2", "engine-3"])
def test_engines_in_a_row_reuse_the_group_the_first_one_made(name, forked_launches):
    """Three engines one after another in the same 2 (3) ranks, zerofit making the process group (the script never
    calls init_process_group): each trains as plain PyTorch, in the one group the first engine made, and every
    rank exits 0; in several launches in a row (a second init_process_group used to refuse or hang at random)."""
    runs = forked_launches[name]
    assert len(runs) >= 2
    for codes, errs, results, seconds in runs:
        _check_engines(codes, errs, results, seconds, world=len(codes), reused=True)


@pytest.mark.parametrize("name", ["destroys-2", "destroys-3"])
def test_a_group_the_program_destroys_between_engines_is_made_again(name, forked_launches):
    """The script calls dist.destroy_process_group() after each engine: the next engine makes a new group (over
    the store zerofit kept, under a prefix of its own) and trains as plain PyTorch; every rank exits 0."""
    for codes, errs, results, seconds in forked_launches[name]:
        _check_engines(codes, errs, results, seconds, world=len(codes), reused=False)


def test_engines_in_a_row_with_torchruns_agent_store(forked_launches):
    """As torchrun runs its ranks (``TORCHELASTIC_USE_AGENT_STORE=True``: the store is another process's and
    keeps every key of the job): engines in a row reuse the group; a group destroyed between engines is made
    again under keys no earlier group used."""
    for name, reused in (("agent-engine-2", True), ("agent-destroys-2", False)):
        for codes, errs, results, seconds in forked_launches[name]:
            _check_engines(codes, errs, results, seconds, world=len(codes), reused=reused)


def test_an_earlier_engines_failure_does_not_fail_a_later_one(forked_launches):
    """[Note: a failing rank] per engine (torchrun's agent store, which keeps every key of the job): engine 1 fails
    on every rank (a bad batch; the store records the first rank's failure); engines 2 and 3 then train in the
    same ranks, stay open while their failure monitors poll, and no monitor takes engine 1's failure for theirs."""
    ((codes, errs, results, seconds),) = forked_launches["failed-first"]
    _ok(codes, errs)
    first = results[0]
    assert first is not None and all(st == {"error": True} for st in first["ranks"]), first
    assert "labels must have input_ids" in first["error"] or "another rank failed first" in first["error"], first
    later = [e.split("ranks_script: run 1 starts", 1)[1] for e in errs]
    _check_engines(codes, later, results[1:], seconds, world=2, reused=True)


def test_engines_in_a_row_under_torchrun(tmp_path):
    """The same three engines in a row under torchrun itself (``torch.distributed.run --standalone``: 2 processes
    of their own, the agent's store), the last one left open for the interpreter's exit (its finalizer, then
    zerofit's destroying the group): torchrun exits 0 (every rank did), in bounded time."""
    out = tmp_path / "torchrun.pt"
    runs = _engines(leave_open=True)
    spec = {"G": G, "group": "engine", "runs": [{**r, "out": f"{out}.{i}"} for i, r in enumerate(runs)]}
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    )
    t = time.monotonic()
    rc, _, err = _run_session(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPT),
            json.dumps(spec),
        ],
        env,
        timeout=240,
    )
    assert rc == 0, err[-4000:]
    results = [_collect(Path(r["out"]), 2) for r in spec["runs"]]
    _check_engines([0, 0], [err] * 2, results, 0.0, world=2, reused=True)
    assert time.monotonic() - t < 240
