"""``zerofit estimate --nnodes N``: the two layouts across nodes side by side ([Note: the nodes' layout],
engine/plan/engine_plan.py), each with its host bytes per node, the bytes that cross the nodes per step and, given their
bandwidth, the step they predict; and which is faster.

[Note: what crosses the nodes]
Per node and step, with n nodes (f = (n-1)/n, a ring's share; P the host-optimized trained parameters, R the
device-optimized ones, replicated):

- hybrid ([Note: nodes hold the state whole], engine/distributed/ranks.py): every gradient all-reduced across the
nodes, each
  rank its shard: 2 f x 4 B x (P + R), on the compute stream in the backward (Sharding.reduce_scatter runs it
  there, after the node's reduce-scatter), so it lengthens the backward's compute;
- full ([Note: nodes hold a slice of the state], engine/distributed/node_slices.py): each streamed block's 16-bit
weights
  gathered over every rank at each use (the forward's upload and the backward's, and again for a recomputed
  input), f x compute-dtype bytes each, on the upload stream after the rank's shard went up (so they lengthen the
  uploads); a resident host-optimized shell's 16-bit weights gathered after its update; the gradients
  reduce-scattered over every rank, f x 4 B x P, on the compute stream; the replicated units' all-reduced, 2 f x 4 B
  x R. Each node's CPU updates 1/n of the host state and its ranks upload 1/n of each block.

So for one use of each block per pass their bytes are about equal (bf16: 8 f B per parameter both), and the full
layout's CPU optimizer and uploads per node are 1/n of the hybrid's: it is faster where those bind and the
network keeps up; the hybrid layout where the network is slow (its bytes all in the backward, none in the
forward) and wherever each node must hold a whole checkpointable state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zerofit.engine.plan.search import Plan, fmt_bytes


@dataclass
class NodeTraffic:
    """Bytes one node sends across the nodes per step, by where in the step they go."""

    gather_fwd: int = 0  # the forward's weight gathers (full): on the upload stream
    gather_bwd: int = 0  # the backward's (and recomputed inputs')
    grads: int = 0  # gradients all-reduced (hybrid) or reduce-scattered (full): the backward's compute stream

    @property
    def total(self) -> int:
        return self.gather_fwd + self.gather_bwd + self.grads

    def seconds(self, gb_per_s: float | None) -> NodeTraffic | None:
        """The same parts in seconds at ``gb_per_s``; None without a bandwidth."""
        if not gb_per_s:
            return None
        b = gb_per_s * 1e9
        return NodeTraffic(self.gather_fwd / b, self.gather_bwd / b, self.grads / b)


def traffic(layout: str, shape, plan: Plan, nnodes: int, compute_bytes: int, recomputed=()) -> NodeTraffic:
    """[Note: what crosses the nodes] for ``plan`` (one node's) on ``nnodes`` nodes."""
    if nnodes <= 1:
        return NodeTraffic()
    f = (nnodes - 1) / nnodes
    n, L = shape.block_numels, len(shape.block_numels)
    streamed = range(plan.resident_blocks, L)
    host = sum(n[i] for i in streamed) + (0 if plan.shell_optimizer_on_device else shape.shell_numel)
    replicated = shape.shell_numel + sum(n) - host
    if layout == "hybrid":
        return NodeTraffic(grads=int(2 * f * 4 * (host + replicated)))
    per_pass = sum(n[i] for i in streamed) * compute_bytes
    again = sum(n[i] for i in recomputed if i >= plan.resident_blocks) * compute_bytes
    shell16 = 0 if plan.shell_optimizer_on_device else shape.shell_numel * compute_bytes
    return NodeTraffic(
        gather_fwd=int(f * per_pass),
        gather_bwd=int(f * (per_pass + again + shell16)),
        grads=int(f * 4 * host + 2 * f * 4 * replicated),
    )


@dataclass
class LayoutEstimate:
    """One layout on the estimate's nodes: its plan (one node's), host bytes per node, the bytes across the nodes
    per step, and its step (where predicted), or why it does not fit."""

    name: str
    plan: Plan | None
    host_bytes: int
    traffic: NodeTraffic
    step: float | None = None
    refusal: str | None = None

    def to_dict(self) -> dict:
        return {
            "plan": self.plan.describe() if self.plan else None,
            "host_bytes": self.host_bytes,
            "inter_node_bytes": self.traffic.total,
            "inter_node": asdict(self.traffic),
            "step": self.step,
            "refusal": self.refusal,
        }


WHAT = {
    "hybrid": "each node holds the whole state; every gradient all-reduced across the nodes",
    "full": "each node holds 1/{n} of the host state; weights gathered over every rank at each use, gradients "
    "reduce-scattered",
}


def faster(layouts: dict[str, LayoutEstimate]) -> str | None:
    """The layout with the shorter predicted step, where both are predicted."""
    timed = {k: v.step for k, v in layouts.items() if v.step is not None and v.refusal is None}
    return min(timed, key=timed.get) if len(timed) == 2 else None


def render(
    nnodes: int, ranks: int, chosen: str, asked: str, layouts: dict[str, LayoutEstimate], gb_per_s: float | None
) -> list[str]:
    """The estimate's lines on the nodes: each layout, then which is faster (or what it needs to say)."""
    lines = [
        f"nodes        {nnodes} x {ranks} rank{'s' if ranks > 1 else ''}: the {chosen} layout (nodes_layout "
        f"{asked}); the layouts (docs/ranks.md):"
    ]
    for name in ("hybrid", "full"):
        le = layouts.get(name)
        if le is None:
            continue
        if le.refusal is not None:
            lines.append(f"  {name:<7} does not fit: {le.refusal.splitlines()[0]}")
            continue
        t = le.traffic.seconds(gb_per_s)
        lines.append(
            f"  {name:<7} {WHAT[name].format(n=nnodes)}: host plan {fmt_bytes(le.plan.host_total)} per node, "
            f"{fmt_bytes(le.traffic.total)} across the nodes per node and step"
            + (f" ({t.total:.2f} s at {gb_per_s:g} GB/s)" if t is not None else "")
            + (f"; step {le.step:.2f} s" if le.step is not None else "")
        )
    best = faster(layouts)
    if best is not None:
        other = layouts["full" if best == "hybrid" else "hybrid"]
        lines.append(f"  faster: {best} ({layouts[best].step:.2f} s per step against {other.step:.2f} s)")
    elif not gb_per_s:
        lines.append("  which is faster: give --inter-node-gbps (zerofit doctor --inter-node measures it)")
    elif all(le.refusal is None for le in layouts.values()):
        lines.append("  which is faster: the steps are predicted on the training machine's GPU")
    return lines
