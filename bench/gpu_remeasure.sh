#!/usr/bin/env bash
# The compute-bound runs again after a planner or estimate change, each against its prediction, on one GPU,
# detached from the device call that starts it (the runs take longer than one call):
#
#     setsid bash bench/gpu_remeasure.sh RESULTS COMMIT </dev/null >/dev/null 2>&1 &
#
# then poll RESULTS/done. W1 at 24 GiB (zerofit and the in-GPU plain run), W1 at 8 GiB (zerofit), W2 (both),
# each with `zerofit estimate`'s prediction made first in a process of its own; then where W1 at 8 GiB's GPU memory
# peaks (bench/mem_peak.py, unless MEMPEAK=0); then the GPU tests if TESTS=1. Each run's exit code ends its log; RESULTS.tgz holds them.
set -u
res=$1 commit=$2
mkdir -p "$res"
source bench/gpu_setup.sh > "$res/setup.txt" 2>&1
source bench/gpu_lib.sh
zf_run w1 220 --workload W1 --engines plain,zerofit --engine-args 'zerofit=--estimate' --steps 4 --cap 24GiB
zf_run w1_8 160 --workload W1 --engines zerofit --engine-args 'zerofit=--estimate' --steps 4 --cap 8GiB
zf_run w2 260 --workload W2 --engines plain,zerofit --engine-args 'zerofit=--estimate' --steps 4 --cap 24GiB
if [ "${MEMPEAK:-1}" = 1 ]; then
  timeout 150 python3 bench/mem_peak.py W1 8GiB 1 > "$res/mem_peak_w1_8.txt" 2>&1
  echo "rc=$?" >> "$res/mem_peak_w1_8.txt"
fi
if [ "${TESTS:-0}" = 1 ]; then
  zf_tests gpu_tests 300 tests/test_gpu.py tests/test_split_updates.py
fi
tar czf "$res.tgz" -C "$res" .
touch "$res/done"
