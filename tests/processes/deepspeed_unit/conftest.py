"""The ported DeepSpeed unit tests (unit/, DeepSpeed's tests/unit layout) install ``import zerofit.deepspeed.alias``:
they run only in their own pytest process (test_deepspeed_unit_ports.py starts it with ZEROFIT_DS_UNIT_PORT=1),
never in the suite's, where the real DeepSpeed is imported.

In that process: DeepSpeed's CPU accelerator reports fp16 unsupported where torch's mkldnn has no fp16 kernels
(this machine), which skips DeepSpeed's fp16 cases (test_fp16.py skips its whole module); zerofit trains fp16 on
the CPU (its loss scaler is the same on every device), so here its accelerator says fp16 is supported and those
cases run instead of skipping."""

import os

if os.environ.get("ZEROFIT_DS_UNIT_PORT") != "1":
    collect_ignore = ["unit"]
else:
    from zerofit.deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True
