#!/usr/bin/env bash
# W1 at 8 GiB against its prediction, where its GPU memory peaks, then the GPU tests; detached from the device call
# (setsid bash bench/gpu_check.sh RESULTS COMMIT </dev/null >/dev/null 2>&1 &; poll RESULTS/done). Each part's exit
# code ends its log.
set -u
res=$1 commit=$2
mkdir -p "$res"
source bench/gpu_setup.sh > "$res/setup.txt" 2>&1
python3 bench/run.py --workload W1 --engines zerofit --engine-args 'zerofit=--estimate' --steps 4 --cap 8GiB \
  --timeout 160 --out "$res/w1_8" --commit "$commit" > "$res/w1_8.txt" 2>&1
echo "rc=$?" >> "$res/w1_8.txt"
timeout 150 python3 bench/mem_peak.py W1 8GiB 1 > "$res/mem_peak_w1_8.txt" 2>&1
echo "rc=$?" >> "$res/mem_peak_w1_8.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_split_updates.py > "$res/gpu_tests.txt" 2>&1
echo "rc=$?" >> "$res/gpu_tests.txt"
tar czf "$res.tgz" -C "$res" .
touch "$res/done"
