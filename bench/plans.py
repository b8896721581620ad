"""The plans zerofit chooses for the benchmark workloads on the GPU machine, computed here (no GPU): for checking a
planner change before device time is spent on it.

    python3 bench/plans.py [WORKLOAD:CAP[:HOST] ...]

The GPU machine's budgets: the cap less the CUDA context (0.58 GiB: ``estimate`` reads the free memory there; its
plans at a 24 GiB cap were made against 23.42 GiB), the host budget its runs' plans had (111.4-112.2 GiB: 112) unless
the workload sets one, 63.9 GiB free on its disk. The W6 workloads (LoRA) are planned over their frozen base."""

import sys
from unittest import mock

import common
from zerofit.engine.disk import swapfile as disk
from zerofit.estimate import estimate

CONTEXT = 0.58  # GiB the CUDA context takes from the cap on the H200 (mem_get_info there)
RUNS = ["W1:24", "W1:8", "W2:24", "W2-ga32:24:32", "W1-ga32:24:40", "W3:24:108", "W3-mb1:8:108", "W6a:24", "W6b:8"]


def plan(workload: str, cap: float, host: float | None) -> str:
    w = common.WORKLOADS[workload]
    model = common.build_meta(w)  # its family's model (Llama, T5, the U-Net) on the meta device
    cfg = common.zerofit_config(w, w.lora) | {
        "max_gpu_memory": f"{cap - CONTEXT:.2f}GiB",
        "max_host_memory": f"{host or 112}GiB",
    }
    if host:
        cfg["offload"] = {"optimizer_device": "nvme", "nvme_path": "/tmp"}
    with mock.patch.object(disk, "_free", lambda path: int(63.9 * 2**30)):
        L = common.LORA  # W6: LoRA over the frozen base, as engine_zerofit.py's --estimate plans it
        est = estimate(
            model,
            cfg,
            measure=False,
            gpu=True,
            lora=dict(r=L.r, alpha=L.alpha, targets=list(L.targets)) if w.lora else None,
        )
    if est.plan is None:
        return f"{workload} {cap} GiB: refused: {est.refusal.splitlines()[0]}"
    return f"{workload} {cap} GiB host {host or 112}: {est.plan.describe()}  gpu {est.gpu_bytes / 2**30:.2f} GiB"


if __name__ == "__main__":
    for run in sys.argv[1:] or RUNS:
        name, cap, *host = run.split(":")
        print(plan(name, float(cap), float(host[0]) if host else None), flush=True)
