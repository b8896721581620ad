#!/usr/bin/env bash
# A workload on the disk tier against DeepSpeed ZeRO-Infinity (parameters and optimizer on the NVMe), one engine
# after the other (the GPU machine's 64 GB disk cannot hold both engines' files at once), detached from the
# device call that starts it so that it can outlive the call's 600 s:
#
#     setsid bash bench/gpu_disk_peers.sh RESULTS WORKLOAD COMMIT HOST_BUDGET </dev/null >/dev/null 2>&1 &
#
# then poll RESULTS/done (a later call on the same warm machine). DeepSpeed runs one step, timed (its first;
# WORKLOADS.md's W1 at 4 micro-batches: 99 s/step later, 103.9 s first); zerofit three (the first untimed).
# DS_TIMEOUT (default 750 s) bounds DeepSpeed's process: its start and one step (W1: 174 + 104 s). The 7B shape
# (W2, W3a's comparison) needs ~115 GB of disk: the nvidia-h200-x2 kind (128 GiB), not the one-GPU kind (64).
# Sources gpu_setup.sh and unpacks libaio for DeepSpeed's async_io op as shared/bench/peer-wheels.sh says.
set -u
res=$1 workload=$2 commit=$3 host=$4
mkdir -p "$res"
df -h /tmp > "$res/df_before.txt"; nproc >> "$res/df_before.txt"; nvidia-smi -L >> "$res/df_before.txt" 2>&1
source bench/gpu_setup.sh > "$res/setup.txt" 2>&1
mkdir -p /tmp/aio && for f in .whl/aio/*.deb; do dpkg -x "$f" /tmp/aio; done
lib=/tmp/aio/usr/lib/x86_64-linux-gnu
export CPATH=/tmp/aio/usr/include LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
       CFLAGS=-I/tmp/aio/usr/include LDFLAGS=-L$lib
rm -rf /tmp/nv && mkdir -p /tmp/nv/ds
python3 bench/run.py --workload "$workload" --engines deepspeed --engine-args 'deepspeed=--nvme /tmp/nv/ds --warmup 0' \
  --steps 1 --cap 24GiB --timeout "${DS_TIMEOUT:-750}" --out "$res/ds" --commit "$commit" > "$res/ds.txt" 2>&1
echo "rc=$?" >> "$res/ds.txt"
df -h /tmp > "$res/df.txt"; du -sh /tmp/nv >> "$res/df.txt"
rm -rf /tmp/nv && mkdir -p /tmp/nv
python3 bench/run.py --workload "$workload" --engines zerofit \
  --engine-args "zerofit=--set max_host_memory=$host --nvme /tmp/nv --estimate" \
  --steps 3 --cap 24GiB --timeout 500 --out "$res/zf" --commit "$commit" > "$res/zf.txt" 2>&1
echo "rc=$?" >> "$res/zf.txt"
rm -rf /tmp/nv
touch "$res/done"
