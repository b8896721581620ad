"""What every tier shares: the bytecode cache of this process and of every process a test starts, and one
torch thread per xdist worker.

The suite starts about a hundred Python processes (ranks, `zerofit train`, DeepSpeed's scripts, ...), each
importing torch and transformers. Where the environment sets ``PYTHONDONTWRITEBYTECODE`` (container images
often do) and the packages were installed without their bytecode (the Makefile's ``pip install
--no-compile``), no process keeps what it compiled, and every one compiles torch's and transformers' modules
anew: ``from transformers import LlamaForCausalLM`` takes 12 s of CPU instead of 5 on 2 cores. Here the
bytecode is written, outside the repository and the environment, under the temp folder, where the processes
of this run and of later ones find it (a ``PYTHONPYCACHEPREFIX`` already set is kept). Nothing a test checks
depends on it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    os.environ.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "zerofit-test-pycache"))
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
    sys.dont_write_bytecode = False

# `make test` runs the suite in two xdist workers, one per core of a CI machine: a worker's torch computes with one
# thread (tiny matrices gain nothing from a second, and two workers of two threads each oversubscribe two cores),
# and so do the processes it starts. The comparisons hold with one thread as with two: the bitwise ones compare
# computations of one process, or of children that run with one thread already (ranks, `zerofit train`, resume).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


import pytest  # noqa: E402


@pytest.fixture
def one_thread():
    """Torch on one thread for the test (as DeepSpeed's processes run; several times faster for tiny matrices on a
    shared machine), its thread count restored after. Modules ask for it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
