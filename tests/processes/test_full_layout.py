"""The full layout across nodes ([Note: nodes hold a slice of the state],
src/zerofit/engine/distributed/node_slices.py) on the
CPU (gloo): 2 simulated nodes of 2 ranks and 3 of 1 (each node its own torchrun variables and host arenas), against
plain PyTorch on the global batch; each node's host memory measured holding its slice of the state; checkpoints
saved on N nodes resumed on M and in one process; the layout's words (nodes_layout, FSDP's, DeepSpeed's). Apart from
test_nodes.py so that the several-process modules spread over the two test workers."""

from __future__ import annotations

import pytest
import torch

from tests.processes.test_ranks import (
    _PLACEMENTS,
    STEPS,
    _cfg,
    _check,
    _check_fp16_like_one_process,
    _check_local_means,
    _ok,
    _one_process_then_save,
    _reference,
    _run_spec,
    launch,
)
from tests.support import tiny_models as tm

PAGE = 4096


def _full(spec: dict) -> dict:
    return {**spec, "config": {**spec["config"], "nodes_layout": "full"}}


_RUNS = {
    "offload": _full(_run_spec("offload")),
    "mixed": _full(_run_spec("mixed")),
    "clip": _full(_run_spec("clip")),
    "fp16": _full(_run_spec("fp16")),
    # FSDP's FULL_SHARD given on several nodes names the full layout (no nodes_layout in the config)
    "fsdp-full": {**_run_spec("fsdp-hybrid"), "strategy": "FULL_SHARD"},
    # the node's share measured on a wider model (its pages at the slices' edges a small part), then hybrid's
    "wide-full": {
        "steps": 2,
        "steps_total": 2,
        "model": "llama_wide",
        "config": _cfg(nodes_layout="full", **_PLACEMENTS["offload"]),
    },
    "wide-hybrid": {
        "steps": 2,
        "steps_total": 2,
        "model": "llama_wide",
        "config": _cfg(nodes_layout="hybrid", **_PLACEMENTS["offload"]),
    },
}


@pytest.fixture(scope="module")
def full_nodes(tmp_path_factory):
    """2 simulated nodes of 2 ranks each, the runs of _RUNS in turn (one launch)."""
    tmp = tmp_path_factory.mktemp("full")
    rcs, errs, results = launch(4, {"runs": list(_RUNS.values())}, tmp, timeout=600, per_node=2)
    _ok(rcs, errs)
    return dict(zip(_RUNS, results))


@pytest.mark.parametrize("placement", ["offload", "mixed"])
def test_the_full_layout_on_two_nodes_trains_like_one_process(placement, full_nodes):
    """Each unit is cut into 4 shards, one per rank of both nodes, each node's ranks owning one half of it (its
    slice); losses, weights and moments are plain PyTorch's on the global batch of the 4 ranks."""
    result = full_nodes[placement]
    ref_losses, ref = _reference(4, STEPS)
    _check(result, ref_losses, ref)
    states = result["ranks"]
    assert [st["layout"] for st in states] == ["full"] * 4
    for name, (_, _, numel) in states[0]["shards"].items():
        if numel == 0:
            continue
        cut = sorted(st["shards"][name][:2] for st in states)
        assert [lo for lo, _ in cut][1:] == [hi for _, hi in cut][:-1] and cut[0][0] == 0 and cut[-1][1] == numel
        n0, n1 = states[0]["node_bounds"][name], states[2]["node_bounds"][name]
        assert n0[0] == 0 and n0[1] == n1[0] and n1[1] == numel and states[1]["node_bounds"][name] == n0


def test_fsdp_full_shard_on_two_nodes_is_the_full_layout(full_nodes):
    """``FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, cpu_offload=...)`` on 2 nodes: FSDP shards over
    every rank, so zerofit runs the full layout; plain PyTorch's weights and moments on the global batch."""
    result = full_nodes["fsdp-full"]
    assert {st["layout"] for st in result["ranks"]} == {"full"}
    _check_local_means(result, 4)


def test_the_full_layout_clips_and_skips_overflows_on_every_node(full_nodes):
    """Clipping by the global norm (the squares summed over every rank's shards) and an fp16 overflow on one
    rank's shard skipping the step on every rank of both nodes, as one process on the global batch."""
    ref_losses, ref = _reference(4, STEPS, clip=0.74)
    _check(full_nodes["clip"], ref_losses, ref)
    _check_fp16_like_one_process(full_nodes["fp16"], 4)


def test_each_node_holds_its_slice_of_the_host_state(full_nodes):
    """The bytes each node's shared arenas hold (their memfds' allocated pages, read by its local rank 0), after
    training and after a whole-state read (master_state_dict gathers every slice, then hands the others back): the
    hybrid layout holds the whole master and moments (12 B per trained parameter) on each node; the full layout
    each node's slice of the streamed blocks' (its half), a page at most either side of each slice's three buffers,
    and the shell (resident: whole)."""
    wide = {k: full_nodes[f"wide-{k}"]["ranks"] for k in ("full", "hybrid")}
    shards = wide["full"][0]["shards"]
    whole = sum(numel for _, _, numel in shards.values()) * 12
    for st in (wide["hybrid"][0], wide["hybrid"][2]):
        assert whole <= st["held"] <= whole + 4 * PAGE and st["held_after_read"] == st["held"]
    for node in (0, 1):
        st = wide["full"][2 * node]
        sliced = sum((hi - lo) * 12 for name, (lo, hi) in st["node_bounds"].items() if name != "shell")
        shell = shards["shell"][2] * 12
        edges = 2 * 3 * PAGE * (len(shards) - 1)
        assert sliced + shell - edges <= st["held"] <= sliced + shell + edges + 4 * PAGE, (node, st["held"], sliced)
        assert st["held_after_read"] <= sliced + shell + edges + 4 * PAGE
        assert st["held"] < 0.6 * wide["hybrid"][2 * node]["held"]
    assert wide["full"][1]["held"] is None  # local rank 0 reads its node's


def test_three_nodes_in_both_layouts(tmp_path):
    """3 simulated nodes of one rank each: the full layout (clipped) and the hybrid one, in the same processes, as
    plain PyTorch on the global batch of 3; an fp16 overflow in the full layout skipped by every node, as one
    process skips it."""
    runs = [
        _full(_run_spec("clip")),
        {**_run_spec("offload"), "config": {**_run_spec("offload")["config"], "nodes_layout": "hybrid"}},
        _full(_run_spec("fp16")),
    ]
    rcs, errs, (full, hybrid, fp16) = launch(3, {"runs": runs}, tmp_path, timeout=400, per_node=1)
    _ok(rcs, errs)
    assert {st["layout"] for st in full["ranks"]} == {"full"} and {st["layout"] for st in hybrid["ranks"]} == {"hybrid"}
    _check(full, *_reference(3, STEPS, clip=0.74))
    _check(hybrid, *_reference(3, STEPS))
    _check_fp16_like_one_process(fp16, 3)


def test_a_full_layout_checkpoint_moves_between_node_counts(tmp_path):
    """6 micro-batches per step throughout: 2 steps in one process, saved; 2 on 3 nodes of one rank in the full
    layout from it, saved and exported; 2 on 2 nodes of one rank (full) from that, saved; the last checkpoint
    loaded in one process: the losses and weights of 6 uninterrupted steps of plain PyTorch, the export the weights
    the 3 nodes held."""
    from transformers import AutoModelForCausalLM

    import zerofit

    total, mbs = 6, 6
    cfg = _cfg(**_PLACEMENTS["offload"])
    ref_losses, ref_weights, losses = _one_process_then_save(tmp_path, cfg, total, mbs)
    full = {**cfg, "nodes_layout": "full"}
    rcs, errs, three = launch(
        3,
        {
            "G": 2,
            "steps": 2,
            "steps_total": total,
            "first": 2,
            "config": {**full, "gradient_accumulation_steps": 2},
            "load": str(tmp_path / "ck"),
            "save": str(tmp_path / "ck"),
            "tag": "three",
            "export": str(tmp_path / "hf"),
        },
        tmp_path,
        timeout=300,
        per_node=1,
    )
    _ok(rcs, errs)
    assert {st["layout"] for st in three["ranks"]} == {"full"}
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    exported = {n: p.detach().clone() for n, p in out.named_parameters()}
    for n, w in three["master"].items():
        torch.testing.assert_close(exported[n], w, rtol=0, atol=0)
    rcs, errs, two = launch(
        2,
        {
            "G": 3,
            "steps": 2,
            "steps_total": total,
            "first": 4,
            "config": {**full, "gradient_accumulation_steps": 3},
            "load": str(tmp_path / "ck"),
            "save": str(tmp_path / "ck"),
            "tag": "two",
        },
        tmp_path,
        timeout=300,
        per_node=1,
    )
    _ok(rcs, errs)
    losses += three["state"]["losses"] + two["state"]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1.3e-6, atol=1e-5)
    for n, w in ref_weights.items():
        torch.testing.assert_close(two["master"][n], w, rtol=1.3e-6, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    back = zerofit.initialize(tm.llama(), {**cfg, "gradient_accumulation_steps": mbs})
    back.load_checkpoint(tmp_path / "ck")
    assert back.global_step == total
    assert all(torch.equal(w, two["master"][n]) for n, w in back.master_state_dict().items())
    back.close()
