#!/usr/bin/env bash
# Does the CPU optimizer's thread count slow the GPU's launches or itself? W2 at 24 GiB with torch's default
# intra-op threads, then with OMP_NUM_THREADS=15 and 14 (one and two cores left to the main thread), the in-GPU
# plain run first; each run's trace gaps and CPU tasks (bench/trace.py --gaps) after it. Detached:
#
#     setsid bash bench/gpu_threads.sh RESULTS COMMIT </dev/null >/dev/null 2>&1 &
#
# then poll RESULTS/done; RESULTS.tgz holds the logs. Each run's exit code ends its log. PLAIN=0 leaves out the
# plain run (when the same call has one); THREADS lists the settings (default: "default 15 14").
set -u
res=$1 commit=$2
mkdir -p "$res"
source bench/gpu_setup.sh > "$res/setup.txt" 2>&1
source bench/gpu_lib.sh
if [ "${PLAIN:-1}" = 1 ]; then
  zf_run plain 200 --workload W2 --engines plain --steps 4 --cap 24GiB
fi
for t in ${THREADS:-default 15 14}; do
  if [ "$t" = default ]; then unset OMP_NUM_THREADS; else export OMP_NUM_THREADS=$t; fi
  zf_run "t$t" 200 --workload W2 --engines zerofit --steps 5 --cap 24GiB
  zf_trace "t$t"
done
unset OMP_NUM_THREADS
tar czf "$res.tgz" -C "$res" .
touch "$res/done"
