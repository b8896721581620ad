#!/usr/bin/env bash
# After an engine change: W2 at 24 GiB (zerofit, with bench/trace.py --gaps), the GPU tests, then W3a (the 7B shape,
# 32 GiB host budget, the rest on the disk; two steps), each run's exit code at the end of its log. Detached:
#
#     setsid bash bench/gpu_after_change.sh RESULTS COMMIT </dev/null >/dev/null 2>&1 &
#
# then poll RESULTS/done (a caller short of time tars what RESULTS holds so far).
set -u
res=$1 commit=$2
mkdir -p "$res"
source bench/gpu_setup.sh > "$res/setup.txt" 2>&1
source bench/gpu_lib.sh
zf_run w2 200 --workload W2 --engines zerofit --steps 4 --cap 24GiB
zf_trace w2
zf_tests gpu_tests 300 tests/test_gpu.py tests/test_split_updates.py
zf_run w3a 300 --workload W2 --engines zerofit --engine-args 'zerofit=--set max_host_memory=32GiB --nvme /tmp/nv' \
  --steps 2 --cap 24GiB
zf_trace w3a
touch "$res/done"
