"""Release never raises (it runs at interpreter exit): an arena whose unpinning fails is logged by what it is, a
host arena by its bytes, a node's slices (no single tensor) by name, and the release goes on."""

from __future__ import annotations

import logging

import torch

from zerofit.engine.device import Device
from zerofit.engine.distributed.node_slices import NodeSlices
from zerofit.engine.lifecycle import EngineResources
from zerofit.engine.memory.store import HostArena


class _FailingArena(HostArena):
    def close(self) -> None:
        raise RuntimeError("unpin failed")


class _FailingSlices(NodeSlices):
    def __init__(self) -> None:  # no device or ranks needed: only its close is called
        pass

    def close(self) -> None:
        raise RuntimeError("unpin failed")


def test_a_failed_unpin_is_logged_by_what_it_was_and_release_goes_on(caplog):
    closed = []

    class _Arena(HostArena):
        def close(self) -> None:
            closed.append(self)

    last = _Arena(4, torch.float32, False)
    res = EngineResources(
        Device(torch.device("cpu")), arenas=[_FailingArena(8, torch.float32, False), _FailingSlices(), last]
    )
    with caplog.at_level(logging.WARNING, logger="zerofit"):
        res.release()
    said = [r.getMessage() for r in caplog.records]
    assert any("unpinning 32 bytes of host memory failed" in m for m in said), said
    assert any("unpinning the node's slices of host memory failed" in m for m in said), said
    assert closed == [last] and res.released
