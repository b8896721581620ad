#!/usr/bin/env bash
# A scheduling change against the commit before it, in one call: tests/test_gpu.py, then W2 at 24 GiB (zerofit) with
# the working tree's src/, then with OLD_REPO's (the earlier commit's src/ and bench/, e.g. `git archive C src bench |
# tar -x -C .whl/old_repo`, carried: bench/engine_zerofit.py puts its own repository's src/ first), each followed by
# this tree's bench/trace.py --gaps. Detached:
#
#     OLD_REPO=.whl/old_repo setsid bash bench/gpu_ab.sh RESULTS COMMIT OLD_COMMIT </dev/null >/dev/null 2>&1 &
set -u
res=$1 commit=$2 old=$3
mkdir -p "$res"
source bench/gpu_setup.sh > "$res/setup.txt" 2>&1
source bench/gpu_lib.sh
zf_tests gpu_tests 200 -x tests/test_gpu.py
zf_run new 150 --workload W2 --engines zerofit --steps 4 --cap 24GiB
zf_trace new
commit=$old ZF_REPO=$OLD_REPO zf_run old 150 --workload W2 --engines zerofit --steps 4 --cap 24GiB
zf_trace old
touch "$res/done"
