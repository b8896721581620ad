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
python3 bench/run.py --workload W2 --engines zerofit --steps 4 --cap 24GiB --timeout 200 --out "$res/w2" \
  --commit "$commit" > "$res/w2.txt" 2>&1
echo "rc=$?" >> "$res/w2.txt"
python3 bench/trace.py "$res/w2/results_W2.json" --gaps >> "$res/w2.txt" 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_split_updates.py \
  > "$res/gpu_tests.txt" 2>&1
echo "rc=$?" >> "$res/gpu_tests.txt"
python3 bench/run.py --workload W2 --engines zerofit --engine-args 'zerofit=--set max_host_memory=32GiB --nvme /tmp/nv' \
  --steps 2 --cap 24GiB --timeout 300 --out "$res/w3a" --commit "$commit" > "$res/w3a.txt" 2>&1
echo "rc=$?" >> "$res/w3a.txt"
python3 bench/trace.py "$res/w3a/results_W2.json" --gaps >> "$res/w3a.txt" 2>&1
touch "$res/done"
