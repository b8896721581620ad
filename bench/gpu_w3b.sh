#!/usr/bin/env bash
# W3b, the 13B shape on one GPU with the disk tier, at a 24 GiB cap (micro-batch 2 x 4, host budget 108 GiB) and at
# an 8 GiB cap (micro-batch 1 x 8), each with `zerofit estimate`'s prediction made first in a process of its own.
# Detached from the device call that starts it:
#
#     setsid bash bench/gpu_w3b.sh RESULTS COMMIT </dev/null >/dev/null 2>&1 &
#
# then poll RESULTS/done; RESULTS.tgz holds the logs and results. Each run's exit code ends its log.
set -u
res=$1 commit=$2
mkdir -p "$res"
source bench/gpu_setup.sh > "$res/setup.txt" 2>&1
source bench/gpu_lib.sh
df -h /tmp > "$res/df.txt"
for cap in 24GiB 8GiB; do
  w=W3; [ "$cap" = 8GiB ] && w=W3-mb1
  zf_run "w3b_$cap" 420 --workload $w --engines zerofit \
    --engine-args 'zerofit=--set max_host_memory=108GiB --nvme /tmp/nv --estimate' --steps 3 --cap $cap
  zf_trace "w3b_$cap"
done
tar czf "$res.tgz" -C "$res" .
touch "$res/done"
